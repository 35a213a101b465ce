"""Expert parallelism on gloo ranks against the single-process reference (tests/moe_bodies.py):
same initial weights, same per-rank micro-batches; gradients after the first backward,
losses and parameters after 3 AdamW steps with gradient clipping on."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdpx.config import MeshConfig
from fsdpx.parallel_dims import ParallelDims
from tests import moe_bodies as mb
from tests.dist import run_ranks

TOP1 = dict(num_experts=4, ep_size=2, k=1, capacity_factor=1.0, min_capacity=1, use_rts=False)
TOP2 = dict(
    num_experts=4,
    ep_size=2,
    k=2,
    capacity_factor=0.5,
    min_capacity=1,
    use_rts=False,
    top2_2nd_expert_sampling=False,
)
DROPLESS = dict(num_experts=4, ep_size=2, k=2, capacity_factor=None, shared=True, z_loss_coef=0.01)


def _case(moe: dict[str, Any], cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    return {**moe, "reinit_experts": True}, cfg


def _check(results: list[dict[str, Any]], cases: dict[str, Any], dp: int) -> None:
    for name, (moe_kwargs, cfg) in cases.items():
        ref_losses, ref_grads, ref_params = mb.reference_run(
            moe_kwargs, dp, cfg.get("gradient_clipping", 0.0)
        )
        for rank, result in enumerate(results):
            losses, grads, params = result[name]
            torch.testing.assert_close(losses, ref_losses)
            assert grads.keys() == ref_grads.keys(), f"{name}, rank {rank}"
            for n, g in ref_grads.items():
                _close(grads[n], g, f"{name}, rank {rank}, gradient of {n}")
            for n, p in ref_params.items():
                _close(params[n], p, f"{name}, rank {rank}, {n} after {mb.STEPS} steps")


def _close(actual: torch.Tensor, expected: torch.Tensor, where: str) -> None:
    try:
        torch.testing.assert_close(actual, expected)
    except AssertionError as exc:
        raise AssertionError(f"{where}: {exc}") from None


def test_ep2_zero3_parity_two_ranks() -> None:
    """ep = 2 on 2 ranks (edp = 1), ZeRO-3, clipping: DeepSpeed top-1 with dropped tokens,
    top-2 with capacity, dropless top-2 with a shared expert and z-loss (also with the
    experts computed by torch._grouped_mm, and built on the meta device)."""
    cfg = {"mesh": {"ep": 2}, "zero": {"stage": 3}, "gradient_clipping": 0.5}
    cases = {
        "top1": _case(TOP1, cfg),
        "top2": _case(TOP2, cfg),
        "dropless": _case(DROPLESS, cfg),
        "dropless_grouped_mm": _case({**DROPLESS, "grouped": "grouped_mm"}, cfg),
        # Built on the meta device, materialised shard by shard by per_param_init: trains
        # as the CPU-built model initialised by the same function (mb.INIT).
        "dropless_meta": ({**DROPLESS, "meta": True}, cfg),
    }
    results = run_ranks(mb.parity_body, 2, args=(cases,))
    _check(results, cases, dp=2)


def test_ep2_times_edp2_parity_four_ranks() -> None:
    """ep = 2 x edp = 2 on 4 ranks: experts FSDP-sharded (ZeRO-3) over the
    expert-data-parallel pair, the rest over all 4 ranks."""
    cases = {
        "zero3": _case(TOP1, {"mesh": {"ep": 2}, "zero": {"stage": 3}, "gradient_clipping": 0.5}),
    }
    results = run_ranks(mb.parity_body, 4, args=(cases,))
    _check(results, cases, dp=4)


@pytest.mark.slow
def test_ep_composed_parity_four_ranks() -> None:
    """ep = 4 on 4 ranks; ep = 2 under HSDP (dp_replicate 2 x dp_shard 2); ZeRO-1 and
    ZeRO-2 at ep = 2 x edp = 2. Default-tier twins: the two tests above."""
    ep4 = {**TOP2, "num_experts": 8, "ep_size": 4}
    cases = {
        "zero2_dropless": _case(DROPLESS, {"mesh": {"ep": 2}, "zero": {"stage": 2}}),
        "ep4": _case(ep4, {"mesh": {"ep": 4}, "zero": {"stage": 3}, "gradient_clipping": 0.5}),
        "hsdp": _case(TOP1, {"mesh": {"ep": 2, "dp_replicate": 2}, "zero": {"stage": 3}}),
        "zero1": _case(DROPLESS, {"mesh": {"ep": 2}, "zero": {"stage": 1}}),
    }
    results = run_ranks(mb.parity_body, 4, args=(cases,))
    _check(results, cases, dp=4)


def test_ep_must_divide_dp_shard() -> None:
    with pytest.raises(ValueError, match=r"mesh.ep \(4\) must divide mesh.dp_shard \(6\)"):
        ParallelDims.from_config(MeshConfig(ep=4), world_size=6)
    dims = ParallelDims.from_config(MeshConfig(ep=2, dp_replicate=2), world_size=8)
    assert (dims.dp, dims.dp_shard, dims.ep) == (8, 4, 2)  # ep does not change dp


def _check_composed(
    results: list[tuple[list[float], dict[str, torch.Tensor]]],
    moe_kwargs: dict[str, Any],
    dp: int,
    gas: int,
) -> None:
    ref_losses, ref_params = mb.reference_composed(moe_kwargs, dp, gas)
    seen: set[str] = set()
    for rank, (losses, params) in enumerate(results):
        torch.testing.assert_close(losses, ref_losses)
        for n, p in params.items():
            _close(p, ref_params[n], f"rank {rank}, {n} after {mb.STEPS} steps")
        seen |= params.keys()
    assert seen == ref_params.keys()  # under pp: the stages together hold every parameter


@pytest.mark.slow
def test_ep2_tp2_parity_four_ranks() -> None:
    """ep = 2 x tp = 2 (the dense MLPs split by TP, the experts by EP), ZeRO-3."""
    moe = {**DROPLESS, "dense": True, "reinit_experts": True}
    cfg = {
        "mesh": {"ep": 2, "tp": 2},
        "tensor_parallel": {"plan": mb.TP_PLAN},
        "gradient_accumulation_steps": 2,
    }
    _check_composed(run_ranks(mb.composed_body, 4, args=(moe, cfg)), moe, dp=2, gas=2)


@pytest.mark.slow
def test_ep2_pp2_parity_four_ranks() -> None:
    """ep = 2 x pp = 2 (one block per stage, 1F1B, 2 micro-batches), ZeRO-3."""
    moe = {**TOP2, "pp": True, "reinit_experts": True}
    cfg = {
        "mesh": {"ep": 2, "pp": 2},
        "pipeline": {"schedule": "1F1B"},
        "gradient_accumulation_steps": 2,
    }
    _check_composed(run_ranks(mb.composed_body, 4, args=(moe, cfg)), moe, dp=2, gas=2)


BAD: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "built with ep_size=2 but mesh.ep is 1: they must be equal": (TOP1, {"mesh": {"ep": 1}}),
    "built with ep_size=1 but mesh.ep is 2": ({**TOP1, "ep_size": 1}, {"mesh": {"ep": 2}}),
    "mesh.ep = 2 needs ZeRO stage 1, 2 or 3": (TOP1, {"mesh": {"ep": 2}, "zero": {"stage": 0}}),
    "mesh.ep = 2 but the model has no fsdpx.moe MoE layer": ({}, {"mesh": {"ep": 2}}),
    "a model built on the meta device with mesh.ep = 2 needs init_fn": (
        {**TOP1, "meta": True},
        {"mesh": {"ep": 2}},
    ),
}


def test_bad_ep_fails_on_every_rank() -> None:
    """Each rank raises the same error before the first collective of the step: no rank
    hangs (the run has a timeout), and the ranks then go on to the next case together."""
    results = run_ranks(mb.bad_input_body, 2, args=(BAD,), timeout_s=180)
    for rank, errors in enumerate(results):
        for match, error in zip(BAD, errors, strict=True):
            assert error is not None and match in error, f"rank {rank}: {error!r}"
