"""1-bit Lamb (fsdpx.onebit_lamb) against a single-process reference of DeepSpeed's
OnebitLamb algorithm on W replicas ([Note: 1-bit Lamb's two phases]), and through
fsdpx.shard. The convergence run is tests/test_onebit_convergence.py (slow); this is its
default-tier twin."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import fsdpx
from fsdpx.comm import comm_log
from fsdpx.demo.gpt import shard_batch
from fsdpx.onebit_lamb import OneBitLamb
from tests.dist import run_ranks
from tests.parity import STEPS, fsdpx_run, global_batches, make_model
from tests.test_onebit import _Reference

SHAPES = [(5, 7), (6,)]
FREEZE, OPT_STEPS = 2, 6
KW: dict[str, Any] = dict(
    lr=1e-2,
    weight_decay=0.1,
    max_coeff=3.0,
    min_coeff=0.01,
    freeze_step=FREEZE,
    coeff_beta=0.9,
    factor_max=4.0,
    factor_min=0.5,
    factor_threshold=0.1,
)
B1, B2, EPS = 0.9, 0.999, 1e-8


def _grads(world: int) -> list[list[list[torch.Tensor]]]:
    """[step][rank][param]; element (0, 0) of the first never gets a gradient (the mask)."""
    g = torch.Generator().manual_seed(11)
    out = [
        [
            [torch.randn(s, generator=g) * (i + 1) for i, s in enumerate(SHAPES)]
            for _ in range(world)
        ]
        for _ in range(OPT_STEPS)
    ]
    for step in out:
        for grads in step:
            grads[0][0, 0] = 0.0
    return out


def _init() -> list[torch.Tensor]:
    return [torch.linspace(-1, 1, math.prod(s)).view(s) for s in SHAPES]


def _opt_body(rank: int, world: int) -> dict[str, Any]:
    params = [torch.nn.Parameter(t) for t in _init()]
    opt = OneBitLamb(params, **KW)
    kinds, coeffs = [], []
    for grads in _grads(world):
        for p, g in zip(params, grads[rank], strict=True):
            p.grad = g.clone()
        mark = comm_log().mark()
        opt.step()
        kinds.append(comm_log().kinds_since(mark))
        coeffs.append(opt.get_lamb_coeffs())
    return {"params": [p.detach() for p in params], "kinds": kinds, "coeffs": coeffs}


def _clamp(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def _reference(world: int) -> tuple[list[torch.Tensor], list[list[float]]]:
    """DeepSpeed's OnebitLamb on W replicas in one process, written out plainly."""
    ps = _init()
    n = len(ps)
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    fresh = [torch.zeros_like(p) for p in ps]
    lcf, last_factor = [0.0] * n, [1.0] * n
    scaling: list[float] = []
    exchange = _Reference(sum(p.numel() for p in ps), world)
    all_coeffs = []
    for t, grads in enumerate(_grads(world), start=1):
        coeffs = []
        if t <= FREEZE:
            for i in range(n):
                g = sum(grads[r][i] for r in range(world)) / world
                ms[i] = B1 * ms[i] + (1 - B1) * g
                vs[i] = B2 * vs[i] + (1 - B2) * g * g
                if t == FREEZE:
                    fresh[i] = vs[i].clone()
                u = ms[i] / (vs[i].sqrt() + EPS) + KW["weight_decay"] * ps[i]
                c = _clamp(float(ps[i].norm() / u.norm()), KW["min_coeff"], KW["max_coeff"])
                lcf[i] = 0.9 * lcf[i] + 0.1 * c
                coeffs.append(c)
                ps[i] = ps[i] - KW["lr"] * c * u
        else:
            if not scaling:
                rms = [float(m.norm()) / math.sqrt(m.numel()) for m in ms]
                scaling = [sum(rms) / n / r for r in rms]
            last = [m.clone() for m in ms]
            flats = [
                torch.cat(
                    [
                        ((B1 * ms[i] + (1 - B1) * grads[r][i]) * scaling[i]).reshape(-1)
                        for i in range(n)
                    ]
                )
                for r in range(world)
            ]
            avg = exchange(flats)
            off = 0
            for i in range(n):
                k = ms[i].numel()
                ms[i] = avg[off : off + k].view_as(ms[i]) / scaling[i]
                off += k
                ms[i][vs[i] == 0] = 0.0
                grad = (ms[i] - last[i] * B1) / (1 - B1)
                fresh[i] = B2 * fresh[i] + (1 - B2) * grad * grad
                denom = vs[i].sqrt() + EPS
                prelim = ms[i] / denom
                u = prelim + KW["weight_decay"] * ps[i]
                factor = float((denom / (fresh[i].sqrt() + EPS)).max())
                ratio = min(1.0, float(prelim.norm() / u.norm()))
                factor = factor * ratio + (1 - ratio)
                factor = _clamp(factor, 0.5, 4.0)
                factor = _clamp(factor, last_factor[i] * 0.9, last_factor[i] * 1.1)
                last_factor[i] = factor
                coeffs.append(lcf[i] * factor)
                ps[i] = ps[i] - KW["lr"] * lcf[i] * factor * u
        all_coeffs.append(coeffs)
    return ps, all_coeffs


OBL_CFG: dict[str, Any] = {
    "zero": {"stage": 0},
    "optimizer": {"type": "onebit_lamb", "lr": 1e-2, "bias_correction": False, "freeze_step": 2},
}


def _body(rank: int, world: int) -> dict[str, Any]:
    direct = _opt_body(rank, world)
    mark = comm_log().mark()
    _, params = fsdpx_run(OBL_CFG)
    kinds = comm_log().kinds_since(mark)
    model = make_model()
    opt = OneBitLamb(model.parameters(), lr=1e-2, freeze_step=2)
    for micro in global_batches(STEPS, 1):
        for x, y in micro:
            model(shard_batch(x, rank, world), shard_batch(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
    plain = {n: p.detach() for n, p in model.named_parameters()}
    return {"direct": direct, "params": params, "plain": plain, "kinds": kinds}


def test_onebit_lamb_matches_reference_and_through_shard() -> None:
    world = 2
    results = run_ranks(_body, world)
    expected, coeffs = _reference(world)
    compressed = ["all_to_all_single"] + ["all_gather_single"] * 3
    for res in results:
        d = res["direct"]
        for got, want in zip(d["params"], expected, strict=True):
            torch.testing.assert_close(got, want)
        for got_c, want_c in zip(d["coeffs"], coeffs, strict=True):
            assert got_c == pytest.approx(want_c, rel=1e-5)
        # One fp32 all-reduce per warmup step, then one compressed exchange for all tensors.
        assert d["kinds"] == [["all_reduce"]] * FREEZE + [compressed] * (OPT_STEPS - FREEZE)
        for name, ref in res["plain"].items():
            torch.testing.assert_close(res["params"][name], ref, msg=f"{name} differs")
    # The factor moved the trust ratio away from its frozen average (clamped by threshold).
    assert coeffs[-1][0] != pytest.approx(coeffs[FREEZE][0])
    kinds = results[0]["kinds"]
    last = len(kinds) - kinds[::-1].index("all_reduce")
    assert set(kinds[last:]) == {"all_to_all_single", "all_gather_single"}


@pytest.mark.parametrize(
    ("opt", "match"),
    [
        ({"bias_correction": True}, "has no bias correction"),
        ({"factor_min": 5.0}, "0 < factor_min <= factor_max"),
        ({"zero_stage": 1}, r"needs zero.stage = 0; got 1"),
    ],
)
def test_onebit_lamb_config_refusals(opt: dict[str, Any], match: str) -> None:
    stage = opt.pop("zero_stage", 0)
    with pytest.raises(ValueError, match=match):
        fsdpx.Config.from_dict(
            {"zero": {"stage": stage}, "optimizer": {**OBL_CFG["optimizer"], **opt}}
        )
