"""0/1 Adam (fsdpx.zero_one_adam) against a single-process reference of DeepSpeed's
algorithm on W replicas ([Note: 0/1 Adam's schedule]), through fsdpx.shard, its config and
DeepSpeed mapping, and its state across a save / load. The convergence run is
tests/test_onebit_convergence.py (slow); this file is its default-tier twin."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import fsdpx
from fsdpx.comm import comm_log
from fsdpx.demo.gpt import shard_batch
from fsdpx.zero_one_adam import ZeroOneAdam
from tests.dist import run_ranks
from tests.parity import STEPS, fsdpx_run, global_batches, make_model
from tests.test_onebit import _Reference

SHAPE = (5, 7)
LR, WD, EPS, B1, B2 = 1e-2, 0.1, 1e-8, 0.9, 0.999
# Variance steps at t = 1, 2, 4 (the interval doubles after each: var_update_scaler 1);
# t = 3 is a compressed-gradient step; from t = 5 the variance is frozen, local steps sync
# at t = 5, 6 (interval 1), then every 2nd step (local_step_scaler 2, clipper 2): t = 8.
SCHED = dict(var_freeze_step=4, var_update_scaler=1, local_step_scaler=2, local_step_clipper=2)
OPT_STEPS = 9
KINDS = {
    "variance": ["all_reduce"],
    "compressed": ["all_to_all_single"] + ["all_gather_single"] * 3,
    "local": [],
}
PLAN = ["variance", "variance", "compressed", "variance"] + [
    "compressed",
    "compressed",
    "local",
    "compressed",
    "local",
]


def _grads(world: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = [[torch.randn(SHAPE, generator=g) for _ in range(world)] for _ in range(OPT_STEPS)]
    for step in out:  # element (0, 0) never gets a gradient: the zero-variance mask
        for grad in step:
            grad[0, 0] = 0.0
    return out


def _opt_body(rank: int, world: int, bias_correction: bool) -> dict[str, Any]:
    p = torch.nn.Parameter(torch.linspace(-1, 1, math.prod(SHAPE)).view(SHAPE))
    opt = ZeroOneAdam(
        [p], lr=LR, weight_decay=WD, eps=EPS, bias_correction=bias_correction, **SCHED
    )  # type: ignore[arg-type]
    kinds = []
    for grads in _grads(world):
        p.grad = grads[rank].clone()
        mark = comm_log().mark()
        opt.step()
        kinds.append(comm_log().kinds_since(mark))
    return {"param": p.detach(), "kinds": kinds}


def _reference(world: int, bias_correction: bool) -> list[torch.Tensor]:
    """DeepSpeed's ZeroOneAdam update on W replicas in one process, the schedule of PLAN;
    bias_correction: fsdpx's correction ([Note: 0/1 Adam's bias correction]), m by
    1 - beta1^t, v by 1 - beta2^(the number of variance updates)."""
    ps = [torch.linspace(-1, 1, math.prod(SHAPE)).view(SHAPE) for _ in range(world)]
    ms = [torch.zeros(SHAPE) for _ in range(world)]
    us = [torch.zeros(SHAPE) for _ in range(world)]
    v = torch.zeros(SHAPE)
    lrs = 0.0
    var_updates = 0
    exchange = _Reference(math.prod(SHAPE), world)
    for t, grads in enumerate(_grads(world), start=1):
        kind = PLAN[t - 1]
        frozen = t > SCHED["var_freeze_step"]
        if kind == "variance":
            g = sum(grads) / world
            v = B2 * v + (1 - B2) * g * g
            var_updates += 1
            gs = [g] * world
        elif not frozen:
            g = exchange(grads)
            g[v == 0] = 0.0
            gs = [g] * world
        else:
            gs = grads
        c1, c2 = 1.0, 1.0
        if bias_correction:
            c1, c2 = 1 - B1**t, math.sqrt(1 - B2**var_updates)
        denom = v.sqrt() / c2 + EPS
        for r in range(world):
            ms[r] = B1 * ms[r] + (1 - B1) * gs[r]
            update = ms[r] / c1 / denom + WD * ps[r]
            ps[r] = ps[r] - LR * update
            if frozen:
                us[r] = us[r] - LR * update
        if frozen:
            lrs += LR
        if frozen and kind == "compressed":  # a synchronisation
            if t == SCHED["var_freeze_step"] + 1:
                exchange = _Reference(math.prod(SHAPE), world)  # errors restart at the freeze
            avg = exchange([us[r] * denom for r in range(world)])
            avg[v == 0] = 0.0
            for r in range(world):
                ps[r] = ps[r] - us[r] + avg / denom
                ms[r] = -avg / lrs * c1
                us[r] = torch.zeros(SHAPE)
            lrs = 0.0
    return ps


ZO_CFG: dict[str, Any] = {
    "zero": {"stage": 0},
    "optimizer": {
        "type": "zero_one_adam",
        "lr": 1e-2,
        "bias_correction": False,
        "var_freeze_step": 2,
        "var_update_scaler": 1,
        "local_step_scaler": 100,
        "local_step_clipper": 16,
    },
}


def _body(rank: int, world: int) -> dict[str, Any]:
    direct = {bc: _opt_body(rank, world, bc) for bc in (False, True)}
    mark = comm_log().mark()
    losses, params = fsdpx_run(ZO_CFG)
    kinds = comm_log().kinds_since(mark)
    # The same training on a plain replica, ZeroOneAdam averaging variance steps in step().
    model = make_model()
    opt = ZeroOneAdam(
        model.parameters(),
        lr=1e-2,
        bias_correction=False,
        var_freeze_step=2,
        var_update_scaler=1,
        local_step_scaler=100,
    )
    for micro in global_batches(STEPS, 1):
        for x, y in micro:
            model(shard_batch(x, rank, world), shard_batch(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
    plain = {n: p.detach() for n, p in model.named_parameters()}
    return {"direct": direct, "losses": losses, "params": params, "plain": plain, "kinds": kinds}


def test_zero_one_adam_matches_reference_and_through_shard() -> None:
    world = 2
    results = run_ranks(_body, world)
    for bc in (False, True):
        expected = _reference(world, bc)
        for rank, res in enumerate(results):
            torch.testing.assert_close(res["direct"][bc]["param"], expected[rank])
            assert res["direct"][bc]["kinds"] == [KINDS[k] for k in PLAN]
        # The last step was local: the replicas differ (0/1 Adam's local steps).
        assert not torch.allclose(expected[0], expected[1])
    # The correction matters: early steps are larger without it.
    assert not torch.allclose(_reference(world, False)[0], _reference(world, True)[0])
    # Through fsdpx.shard: FSDP's hook all-reduces in backward before variance steps only,
    # and the engine trains what plain replicas with the optimizer's own exchange train.
    for res in results:
        for name, ref in res["plain"].items():
            torch.testing.assert_close(res["params"][name], ref, msg=f"{name} differs")
    kinds = results[0]["kinds"]
    assert kinds.count("all_reduce") >= 2 and "all_to_all_single" in kinds


def test_zero_one_adam_resumes_from_its_state_dict() -> None:
    """One process (no exchange): save after 5 steps, load into a new optimizer, go on;
    equal to the uninterrupted run, the schedule included."""
    grads = _grads(1)
    kw: dict[str, Any] = dict(lr=LR, weight_decay=WD, **SCHED)

    def run(p: torch.nn.Parameter, opt: ZeroOneAdam, steps: range) -> None:
        for t in steps:
            p.grad = grads[t][0].clone()
            opt.step()

    p1 = torch.nn.Parameter(torch.ones(SHAPE))
    o1 = ZeroOneAdam([p1], **kw)
    run(p1, o1, range(OPT_STEPS))
    p2 = torch.nn.Parameter(torch.ones(SHAPE))
    o2 = ZeroOneAdam([p2], **kw)
    run(p2, o2, range(5))
    saved = o2.state_dict()
    o3 = ZeroOneAdam([p2], **kw)
    o3.load_state_dict(saved)
    run(p2, o3, range(5, OPT_STEPS))
    assert o3.schedule == o1.schedule
    torch.testing.assert_close(p2, p1)


@pytest.mark.parametrize(
    ("opt", "match"),
    [
        ({"var_update_scaler": 0}, "optimizer.var_update_scaler"),
        ({"zero_stage": 3}, r"needs zero.stage = 0; got 3"),
    ],
)
def test_zero_one_adam_config_refusals(opt: dict[str, Any], match: str) -> None:
    stage = opt.pop("zero_stage", 0)
    o = {**ZO_CFG["optimizer"], **opt}
    with pytest.raises(ValueError, match=match):
        fsdpx.Config.from_dict({"zero": {"stage": stage}, "optimizer": o})


def test_deepspeed_zero_one_adam_maps() -> None:
    params = {
        "lr": 1e-3,
        "weight_decay": 0.01,
        "bias_correction": False,  # DeepSpeed never applies it; fsdpx does unless false
        "var_freeze_step": 1000,
        "var_update_scaler": 16,
        "local_step_scaler": 1000,
        "local_step_clipper": 16,
        "cuda_aware": False,
        "comm_backend_name": "nccl",
    }
    cfg = fsdpx.Config.from_deepspeed(
        {"train_batch_size": 4, "optimizer": {"type": "ZeroOneAdam", "params": params}},
        world_size=4,
    )
    o = cfg.optimizer
    assert (o.type, o.bias_correction, o.var_freeze_step, o.local_step_scaler) == (
        "zero_one_adam",
        False,
        1000,
        1000,
    )
    assert cfg.zero.stage == 0
