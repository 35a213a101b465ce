"""Sequence parallelism with pipeline parallelism (mesh pp 2 x sp 2 on 4 gloo ranks) against
one process on the whole sequences: losses and parameters after 3 SGD steps of 2
micro-batches each (and an eval_batch loss) ([Note: sp under pipeline parallelism] in fsdpx/sequence/plan.py).
Each rank holds its stage's parameters only; together the two stages hold the model.
fp32, torch's default tolerances (the sharded attention sums in another order)."""

from __future__ import annotations

from typing import Any

import pytest
from torch.testing import assert_close

from tests import sp_bodies
from tests.dist import run_ranks

PP_SP = {"pp": 2, "sp": 2}


def _check(results: list[dict[str, Any]], cases: dict[str, dict[str, Any]]) -> None:
    for name, case in cases.items():
        losses, params = sp_bodies.reference(case)
        held: set[str] = set()
        for r in results:
            got = r[name]
            assert_close(
                got["losses"], losses, rtol=1.3e-6, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
            )
            assert got["params"], f"{name}: a rank holds no parameters"
            assert got["params"].keys() <= params.keys()
            held |= got["params"].keys()
            for key, value in got["params"].items():
                assert_close(value, params[key], msg=lambda m, n=name, k=key: f"{n} {k}: {m}")
        # Both stages together hold every parameter of the model.
        assert held == params.keys(), f"{name}: missing {sorted(params.keys() - held)}"


def test_ulysses_pp2_sp2_matches_single_process() -> None:
    cases = {
        # RoPE in every block: position_ids must reach the second stage too. seq 15:
        # padded to 16 by shard_batch (with a warning); -100 labels spread unevenly over
        # the shards; GQA; activation checkpointing re-enters Ulysses in recompute; then
        # eval_batch through the schedule.
        "llama_kv2_1f1b_ac": {
            "model": "llama_kv2",
            "pairs": True,
            "seq": 15,
            "mesh": PP_SP,
            "gas": 2,
            "ac": "full",
            "eval": True,
        },
    }
    results = run_ranks(sp_bodies.sweep_body, 4, args=(cases,))
    _check(results, cases)


@pytest.mark.slow
def test_more_pp2_sp2_layouts_match_single_process() -> None:
    cases = {
        # GPT's learned positions on the first stage; GPipe.
        "gpt_gpipe": {
            "model": "gpt",
            "seq": 16,
            "mesh": PP_SP,
            "gas": 2,
            "pipeline": {"schedule": "GPipe"},
        },
        # Ring attention on the load-balanced layout (global positions out of order),
        # tiled MLP, and a zero-bubble schedule (backward split into input and weight
        # gradients around the ring's backward).
        "llama_kv1_ring_tiled": {
            "model": "llama_kv1",
            "pairs": True,
            "seq": 16,
            "mesh": PP_SP,
            "gas": 2,
            "mode": "ring",
            "mlp_tile": 4,
        },
        "gpt4_ring_zbv": {
            "model": "gpt4",
            "seq": 16,
            "mesh": PP_SP,
            "gas": 2,
            "mode": "ring",
            "pipeline": {"schedule": "ZBVZeroBubble", "stages_per_rank": 2},
        },
    }
    results = run_ranks(sp_bodies.sweep_body, 4, args=(cases,))
    _check(results, cases)
