"""FSDP's HSDP cross-replica all-reduce in `comm_wait_s` and `sent_all_reduce`
(fsdpx/comm/fsdp_all_reduce.py [Note: timing FSDP's all-reduce]): on 4 gloo ranks (2
replicas x 2 shards) every FSDP module's all-reduce is counted once with its bytes and
timed once, and the comm wait is the sum of its spans, inside the compute spans."""

from __future__ import annotations

import math

from tests import hsdp_wait_bodies
from tests.dist import run_ranks


def test_hsdp_all_reduce_wait_is_timed_and_counted() -> None:
    results = run_ranks(hsdp_wait_bodies.hsdp_step_waits, 4)
    for result in results:
        assert len(result["steps"]) == hsdp_wait_bodies.HSDP_STEPS
        for step in result["steps"]:
            n = step["fsdp_modules"]
            # One all-reduce per FSDP module per step (no gradient accumulation), over
            # the 2 replicas, its bytes the formula's for the padded gradient shard.
            assert len(step["all_reduces"]) == n > 1
            assert {w for _, w in step["all_reduces"]} == {2}
            assert sum(b for b, _ in step["all_reduces"]) == result["expected_bytes"]
            # Each timed once, and the field is the sum of every comm-wait span: the
            # all-reduces' and the all-gathers' / reduce-scatters'.
            assert len(step["all_reduce_spans"]) == n
            assert all(s >= 0.0 for s in step["all_reduce_spans"])
            phases = step["phases"]
            total = sum(step["all_reduce_spans"]) + sum(step["other_spans"])
            assert math.isclose(phases["comm_wait"], total, rel_tol=1e-9)
            assert sum(step["all_reduce_spans"]) > 0.0
            # Waits lie inside the compute spans (the all-reduce runs in backward).
            assert sum(step["all_reduce_spans"]) <= phases["backward"]
            assert (
                phases["comm_wait"] <= phases["forward"] + phases["backward"] + phases["optimizer"]
            )
