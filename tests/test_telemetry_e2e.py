"""End to end: 2 CPU ranks train with telemetry on -> relay -> zstd log -> iter_log shows
the steps and losses the training computed; telemetry does not change the losses."""

from __future__ import annotations

import math
from pathlib import Path

from fsdpx.telemetry.wire.logfile import iter_log
from fsdpx.telemetry.wire.protocol import RECORD_FIELDS
from fsdpx.telemetry.wire.relay import Relay
from tests import telemetry_bodies
from tests.dist import run_ranks


def test_two_rank_run_reaches_the_log(tmp_path: Path) -> None:
    log_path = tmp_path / "run.tlm"
    relay = Relay(str(tmp_path / "relay.sock"), log_path=log_path)
    address = relay.bind()
    relay.start_thread()
    try:
        steps, gas = telemetry_bodies.E2E_STEPS, telemetry_bodies.E2E_GAS
        results = run_ranks(
            telemetry_bodies.train_with_and_without_telemetry, 2, (str(address), steps, gas)
        )
    finally:
        relay.stop()
    messages = list(iter_log(log_path))
    records = [r for m in messages if m["type"] == "records" for r in m["records"]]
    events = [e for m in messages if m["type"] == "events" for e in m["events"]]
    hellos = [m for m in messages if m["type"] == "hello"]
    assert sorted(h["rank"] for h in hellos) == [0, 1]
    assert all(h["run_id"] == "e2e" and "auth" not in h for h in hellos)
    for rank, result in enumerate(results):
        # Counting FLOPs on the first step must not change the numbers.
        assert result["losses_on"] == result["losses_off"]
        assert result["dropped"] == 0 and result["records_sent"] == steps
        mine = [r for r in records if r["rank"] == rank]
        assert [r["step"] for r in mine] == list(range(1, steps + 1))
        assert [r["loss"] for r in mine] == result["losses_on"]
        assert [r["lr"] for r in mine] == result["lrs"]  # the lr each step used (warm-up)
        assert len(set(result["lrs"])) > 2  # it changed from step to step
        for r in mine:
            assert tuple(r) == RECORD_FIELDS
            assert r["host"] and r["pid"] and r["local_rank"] == rank
            assert r["grad_norm"] > 0 and r["loss_scale"] == 1.0
            assert r["skipped"] is False and r["dropped"] == 0
            assert r["host_rss"] > 0 and r["mem_allocated"] is None  # CPU: no allocator
            assert r["device_util"] is None and r["mfu"] is None
            assert r["comm_bytes"] == result["comm_bytes"] > 0
        # Bytes this rank sent per step through fsdpx's FSDP slot: the same every step
        # (ZeRO-3: all-gathers and reduce-scatters; no all-to-all without qgZ).
        sent = {(r["sent_all_gather"], r["sent_reduce_scatter"]) for r in mine}
        assert len(sent) == 1 and min(next(iter(sent))) > 0
        assert all(r["sent_all_to_all"] == 0 == r["sent_all_reduce"] for r in mine)
        assert mine[0]["step_time_s"] is None  # the measured (slow) step is not timed
        for r in mine[1:]:
            assert r["step_time_s"] > 0
            assert math.isclose(r["tokens_per_s"], 128 / r["step_time_s"])
            assert math.isclose(r["tflops"], result["flops"] / r["step_time_s"] / 1e12)
        kinds = [e["kind"] for e in events if e["rank"] == rank]
        assert kinds == ["start", "checkpoint_saved", "exit"]
    # Both ranks run the same model on equal-sized batches: the same FLOPs per step.
    assert results[0]["flops"] == results[1]["flops"] > 0
