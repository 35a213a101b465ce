"""1-bit Adam's compressed exchange (fsdpx.comm.onebit) and optimizer (fsdpx.onebit_adam)
against a single-process reference of the same algorithm, and the bytes fsdpx.comm counts."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fsdpx
from fsdpx.comm import OneBitState, comm_log, compressed_all_reduce, padded_numel
from fsdpx.comm.onebit import pack_signs, unpack_signs
from fsdpx.demo.gpt import shard_batch
from fsdpx.onebit_adam import OneBitAdam
from tests.dist import RankError, run_ranks
from tests.parity import STEPS, fsdpx_run, global_batches, make_model

SHAPE = (5, 7)  # 35 elements: padded to 48 on 2 ranks
CALLS = 3


def _inputs(world: int, calls: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [[torch.randn(SHAPE, generator=g) for _ in range(world)] for _ in range(calls)]


def _sign(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0)


class _Reference:
    """The whole exchange on W ranks' tensors in one process, written out plainly."""

    def __init__(self, numel: int, world: int) -> None:
        self.n, self.w = numel, world
        self.big_n = padded_numel(numel, world)
        self.worker_err = [torch.zeros(self.big_n) for _ in range(world)]
        self.server_err = [torch.zeros(self.big_n // world) for _ in range(world)]

    def __call__(self, xs: list[torch.Tensor]) -> torch.Tensor:
        c = self.big_n // self.w
        signs, scales = [], []
        for r, x in enumerate(xs):
            y = torch.cat([x.reshape(-1), torch.zeros(self.big_n - self.n)]) + self.worker_err[r]
            scale = y.norm() / math.sqrt(self.big_n)
            self.worker_err[r] = y - scale * _sign(y)
            signs.append(_sign(y))
            scales.append(scale)
        out = []
        for j in range(self.w):
            m = sum(scales[r] * signs[r][j * c : (j + 1) * c] for r in range(self.w)) / self.w
            m = m + self.server_err[j]
            scale = m.norm() / math.sqrt(c)
            self.server_err[j] = m - scale * _sign(m)
            out.append(scale * _sign(m))
        return torch.cat(out)[: self.n].view(xs[0].shape)


def test_pack_unpack_signs_round_trip() -> None:
    x = torch.tensor([0.5, -1.0, 0.0, -0.0, 3.0, -2.0, 1.0, -1e-9, 2.0, 2.0, -2, 1, 1, 1, 1, -1])
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 2
    torch.testing.assert_close(unpack_signs(packed), _sign(x))


def _exchange_body(rank: int, world: int) -> dict[str, Any]:
    state = OneBitState.zeros(math.prod(SHAPE), world, torch.device("cpu"))
    outs = []
    mark = comm_log().mark()
    for xs in _inputs(world, CALLS):
        t = xs[rank].clone()
        compressed_all_reduce(t, state, None)
        outs.append(t)
    records = comm_log().since(mark)
    return {
        "outs": outs,
        "worker_error": state.worker_error,
        "server_error": state.server_error,
        "records": [(r.kind, r.bytes_sent) for r in records],
    }


def test_compressed_all_reduce_matches_reference_and_counts_bytes() -> None:
    world = 2
    results = run_ranks(_exchange_body, world)
    ref = _Reference(math.prod(SHAPE), world)
    for call, xs in enumerate(_inputs(world, CALLS)):
        expected = ref(xs)
        for res in results:  # every rank gets the same average
            torch.testing.assert_close(res["outs"][call], expected)
        # compressed: not the exact mean
        assert not torch.allclose(expected, torch.stack(xs).mean(0))
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["worker_error"], ref.worker_err[rank])
        torch.testing.assert_close(res["server_error"], ref.server_err[rank])
    # 48 padded elements on 2 ranks: 6 sign bytes, half to the peer; 4-byte scales; 3
    # server-sign bytes; 4-byte server scale.
    one_call = [
        ("all_to_all_single", 3),
        ("all_gather_single", 4),
        ("all_gather_single", 3),
        ("all_gather_single", 4),
    ]
    assert results[0]["records"] == one_call * CALLS
    fp32_all_reduce = 2 * (world - 1) * 4 * math.prod(SHAPE) // world
    assert sum(b for _, b in one_call) * 10 == fp32_all_reduce  # 14 vs 140 bytes


def test_compressed_all_reduce_refuses_a_wrong_state() -> None:
    # The size check needs the group size, so it runs on 2 ranks.
    with pytest.raises(RankError, match="OneBitState sized for 16 elements"):
        run_ranks(_wrong_state_body, 2)


def _wrong_state_body(rank: int, world: int) -> None:
    compressed_all_reduce(torch.zeros(35), OneBitState.zeros(10, world, torch.device("cpu")))


# --- the optimizer ------------------------------------------------------------------------

FREEZE = 2
OPT_STEPS = 5
LR = 1e-2
WD = 0.1


def _grads(world: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = [[torch.randn(SHAPE, generator=g) for _ in range(world)] for _ in range(OPT_STEPS)]
    for step in out:  # element (0, 0) never gets a gradient: [Note: zero-variance mask]
        for grad in step:
            grad[0, 0] = 0.0
    return out


def _opt_body(rank: int, world: int) -> dict[str, Any]:
    p = torch.nn.Parameter(torch.linspace(-1, 1, math.prod(SHAPE)).view(SHAPE))
    opt = OneBitAdam([p], lr=LR, weight_decay=WD, freeze_step=FREEZE)
    kinds = []
    for grads in _grads(world):
        p.grad = grads[rank].clone()
        mark = comm_log().mark()
        opt.step()
        kinds.append(comm_log().kinds_since(mark))
    return {"param": p.detach(), "kinds": kinds}


def _reference_adam(world: int) -> torch.Tensor:
    """1-bit Adam on W replicas in one process ([Note: 1-bit Adam's two phases])."""
    p = torch.linspace(-1, 1, math.prod(SHAPE)).view(SHAPE)
    m, v = torch.zeros(SHAPE), torch.zeros(SHAPE)
    ms = [torch.zeros(SHAPE) for _ in range(world)]
    exchange = _Reference(math.prod(SHAPE), world)
    b1, b2, eps = 0.9, 0.999, 1e-8
    for t, grads in enumerate(_grads(world), start=1):
        if t <= FREEZE:
            g = sum(grads) / world
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            ms = [m.clone() for _ in range(world)]
        else:
            m = exchange([b1 * ms[r] + (1 - b1) * grads[r] for r in range(world)])
            m[v == 0] = 0.0
            ms = [m.clone() for _ in range(world)]
        update = (m / (1 - b1**t)) / ((v / (1 - b2 ** min(t, FREEZE))).sqrt() + eps)
        p = p - LR * (update + WD * p)
    return p


def test_onebit_adam_matches_reference_and_compresses_after_freeze() -> None:
    world = 2
    results = run_ranks(_opt_body, world)
    expected = _reference_adam(world)
    for res in results:
        torch.testing.assert_close(res["param"], expected)
    # The element with no gradient moved by weight decay alone.
    assert float(expected[0, 0]) == pytest.approx(-1 * (1 - LR * WD) ** OPT_STEPS)
    compressed = ["all_to_all_single"] + ["all_gather_single"] * 3
    assert results[0]["kinds"] == [["all_reduce"]] * FREEZE + [compressed] * (OPT_STEPS - FREEZE)


# --- through fsdpx.shard ------------------------------------------------------------------

ONEBIT_CFG: dict[str, dict[str, Any]] = {
    "zero": {"stage": 0},
    "optimizer": {"type": "onebit_adam", "lr": 1e-2, "weight_decay": 0.1, "freeze_step": 2},
}


def _shard_body(rank: int, world: int) -> dict[str, Any]:
    mark = comm_log().mark()
    losses, params = fsdpx_run(ONEBIT_CFG)
    kinds = comm_log().kinds_since(mark)
    # The same training on a plain replica, OneBitAdam exchanging in step().
    model = make_model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, weight_decay=0.1, freeze_step=2)
    for micro in global_batches(STEPS, 1):
        for x, y in micro:
            model(shard_batch(x, rank, world), shard_batch(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
    plain = {n: p.detach() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "plain": plain, "kinds": kinds}


def test_shard_onebit_adam_equals_plain_replicas() -> None:
    results = run_ranks(_shard_body, 2)
    for res in results:
        for name, ref in res["plain"].items():
            torch.testing.assert_close(res["params"][name], ref, msg=f"{name} differs")
    for name in results[0]["params"]:  # replicas stay equal
        torch.testing.assert_close(results[0]["params"][name], results[1]["params"][name])
    kinds = results[0]["kinds"]
    assert "all_to_all_single" in kinds and "all_reduce" in kinds
    # After the freeze phase no fp32 all-reduce is counted (FSDP issues none either).
    last = len(kinds) - kinds[::-1].index("all_reduce")
    assert set(kinds[last:]) == {"all_to_all_single", "all_gather_single"}


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"zero": {"stage": 2}}, "needs zero.stage = 0; got 2"),
        ({"zero": {"stage": 0}, "mesh": {"tp": 2}}, "needs mesh.tp = 1; got 2"),
        (
            {"zero": {"stage": 0}, "optimizer": {"freeze_step": 0}},
            "optimizer.freeze_step",
        ),
    ],
)
def test_onebit_adam_config_refusals(extra: dict[str, Any], match: str) -> None:
    cfg = copy.deepcopy(ONEBIT_CFG)
    for key, value in extra.items():
        cfg.setdefault(key, {}).update(value)
    with pytest.raises(ValueError, match=match):
        fsdpx.Config.from_dict(cfg)


def test_onebit_adam_refuses_a_model_fsdp_all_reduces() -> None:
    with pytest.raises(RankError, match="FSDP all-reduces them too"):
        run_ranks(_callable_body, 2)


def _callable_body(rank: int, world: int) -> None:
    cfg = fsdpx.Config.from_dict({"zero": {"stage": 0}})
    fsdpx.shard(make_model(), cfg, optimizer=lambda ps: OneBitAdam(ps, freeze_step=2))


def test_freeze_step_must_be_positive() -> None:
    with pytest.raises(ValueError, match="freeze_step must be >= 1"):
        OneBitAdam([torch.nn.Parameter(torch.zeros(2))], freeze_step=0)


def test_single_process_is_plain_adam_in_warmup() -> None:
    assert not dist.is_initialized()
    p = torch.nn.Parameter(torch.ones(3))
    q = torch.nn.Parameter(torch.ones(3))
    opt = OneBitAdam([p], lr=0.1, freeze_step=10)
    ref = torch.optim.Adam([q], lr=0.1)
    for _ in range(3):
        p.grad = torch.tensor([1.0, -2.0, 0.5])
        q.grad = p.grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(p, q)


def _resume_body(rank: int, world: int, root: str) -> dict[str, Any]:
    cfg = fsdpx.Config.from_dict(
        {"zero": {"stage": 0}, "optimizer": {"type": "onebit_adam", "lr": 1e-2, "freeze_step": 2}}
    )
    data = global_batches(4, 1)

    def run(engine: Any, steps: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        for micro in steps:
            for x, y in micro:
                engine.backward(engine(shard_batch(x, rank, world), shard_batch(y, rank, world)))
                engine.step()

    def params(e: Any) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach().clone() for n, p in e.module.named_parameters()}

    straight = fsdpx.shard(make_model(), cfg)
    run(straight, data)
    first = fsdpx.shard(make_model(), cfg)
    run(first, data[:1])  # inside the freeze phase: no error buffers exist yet
    first.save_checkpoint(root)
    resumed = fsdpx.shard(make_model(seed=5), cfg)
    resumed.load_checkpoint(root)
    assert isinstance(resumed.optimizer, OneBitAdam) and not resumed.optimizer.compressing
    run(resumed, data[1:])  # one more warmup step, then two compressed ones
    assert resumed.optimizer.compressing
    # A load inside the compressed phase brings back the moments exactly (and each rank's
    # error buffers: tests/test_resume_optimizers.py checks the run that follows).
    resumed.save_checkpoint(root)
    again = fsdpx.shard(make_model(seed=6), cfg)
    again.load_checkpoint(root)
    moments = {}
    for (name, p), q in zip(
        resumed.module.named_parameters(), again.module.parameters(), strict=True
    ):
        saved, loaded = resumed.optimizer.state[p], again.optimizer.state[q]
        moments[name] = [
            float((saved[k].full_tensor() - loaded[k].full_tensor()).abs().max())
            for k in ("exp_avg", "exp_avg_sq")
        ] + [int(saved["step"]), int(loaded["step"])]
    return {"straight": params(straight), "resumed": params(resumed), "moments": moments}


def test_onebit_adam_resumes_from_a_checkpoint(tmp_path: Any) -> None:
    results = run_ranks(_resume_body, 2, (str(tmp_path),))
    for res in results:
        for name, p in res["resumed"].items():
            torch.testing.assert_close(p, res["straight"][name], msg=f"{name} differs")
        for name, (dm, dv, step_a, step_b) in res["moments"].items():
            assert dm == dv == 0.0 and step_a == step_b == 4, name


def _attach_to_sharded_body(rank: int, world_size: int) -> str:
    """The 1-bit family refuses a model FSDP shards over more than one rank."""
    from fsdpx.comm import take_over_gradient_exchange

    engine = fsdpx.shard(make_model(), fsdpx.Config.from_dict({"zero": {"stage": 3}}))
    try:
        take_over_gradient_exchange(
            engine.module, lambda t: None, owner="OneBitLamb", optimizer_type="onebit_lamb"
        )
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_the_1bit_family_refuses_a_model_fsdp_already_shards() -> None:
    for message in run_ranks(_attach_to_sharded_body, 2):
        assert message == (
            "OneBitLamb exchanges gradients itself, but this model's parameters live on a "
            "2-rank FSDP mesh, so FSDP all-reduces them too. Build it with fsdpx.shard and "
            "optimizer.type = 'onebit_lamb' at zero.stage 0 in the config (not "
            "optimizer=callable)"
        )
