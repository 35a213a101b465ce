"""Issue 13 item 5, end to end: rank 1 is SIGKILLed mid-training with telemetry on; the
relay reports it disconnected, rank 0's RankFailureError names it, and the monitor shows
rank 1 dead and failed first, rank 0 exited because of it (not two identical dead rows).

Slow (two ranks train with telemetry); tests/test_monitor_rank_failure.py and
tests/test_rank_failure.py cover the same parts in the default tier."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

from fsdpx.telemetry.wire.logfile import iter_log
from fsdpx.telemetry.wire.relay import Relay
from monitor.model import Flag, MonitorModel, RankStatus
from tests import failure_bodies
from tests.dist import spawn_ranks

pytestmark = pytest.mark.slow


def _relay_events(relay: Relay) -> list[dict[str, Any]]:
    """The events the relay holds now (its late-join history, read from this thread)."""
    events: list[dict[str, Any]] = []
    for body in relay.history.frames():
        events.extend(msgpack.unpackb(body, raw=False).get("events") or [])
    return events


def _wait_for_events(relay: Relay, wanted: set[tuple[int, str]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            seen = {(e.get("rank"), e.get("kind")) for e in _relay_events(relay)}
        except RuntimeError:  # the relay thread changed its history mid-read: look again
            seen = set()
        if wanted <= seen:
            return
        assert time.monotonic() < deadline, f"relay events {sorted(seen)}; want {wanted}"
        time.sleep(0.05)


def test_monitor_tells_the_killed_rank_from_the_rank_it_stopped(tmp_path: Path) -> None:
    log = tmp_path / "run.tlm"
    relay = Relay(str(tmp_path / "relay.sock"), log_path=log)
    address = relay.bind()
    relay.start_thread()
    try:
        args = (str(address), str(tmp_path))
        outcomes = spawn_ranks(failure_bodies.killed_with_telemetry, 2, args)
        # The relay makes rank 1's "disconnected" on its own thread: wait for that state
        # (a stopping relay makes none).
        _wait_for_events(relay, {(1, "disconnected"), (0, "exception"), (0, "exit")}, 60)
    finally:
        relay.stop()
    survivor, killed = outcomes
    assert killed.exitcode == -9
    assert survivor.error_type == "RankFailureError" and survivor.failed_rank == 1, survivor.error
    assert survivor.error_message and survivor.error_message.startswith("rank 1 (pid ")

    model = MonitorModel()
    last = 0.0
    for message in iter_log(log):  # what `python -m monitor replay` feeds the model
        if message["type"] == "records":
            model.add_records(message["records"], now=None)
            last = max([last] + [r["time"] for r in message["records"]])
        elif message["type"] == "events":
            model.add_events(message["events"])
    rows = model.snapshot(last).rows
    assert (rows[1].status, rows[1].flags) == (RankStatus.DEAD, Flag.STALE | Flag.FAILED_FIRST)
    assert (rows[0].status, rows[0].flags) == (RankStatus.EXITED, Flag.PEER_FAILED)
    assert rows[0].stopped_by == 1
