"""The engine's saves and loads reach the relay as `checkpoint_saved` / `checkpoint_loaded`
events ([Note: checkpoint events] in fsdpx/checkpoint/saving.py): 2 CPU ranks, a
synchronous and an asynchronous save, each loaded back; only rank 0 sends them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsdpx.telemetry.wire.logfile import iter_log
from fsdpx.telemetry.wire.relay import Relay
from tests import telemetry_bodies
from tests.dist import run_ranks

CHECKPOINT_KINDS = ("checkpoint_saved", "checkpoint_loaded")


def _size_on_disk(checkpoint: Path) -> int:
    """Every rank's data and index file: what was written besides the MANIFEST."""
    return sum(f.stat().st_size for f in checkpoint.glob("rank-*.*"))


def test_saves_and_loads_are_sent_by_rank_0(tmp_path: Path) -> None:
    log_path, root = tmp_path / "run.tlm", tmp_path / "ckpts"
    relay = Relay(str(tmp_path / "relay.sock"), log_path=log_path)
    address = relay.bind()
    relay.start_thread()
    try:
        results = run_ranks(
            telemetry_bodies.save_and_load_with_telemetry, 2, (str(address), str(root))
        )
    finally:
        relay.stop()
    events = [e for m in iter_log(log_path) if m["type"] == "events" for e in m["events"]]

    def kinds(run_id: str, rank: int) -> list[str]:
        return [e["kind"] for e in events if e["run_id"] == run_id and e["rank"] == rank]

    for mode in ("sync", "async"):
        run = f"ckpt-{mode}"
        assert kinds(run, 0) == ["start", "checkpoint_saved", "checkpoint_loaded", "exit"]
        assert kinds(run, 1) == ["start", "exit"]  # one event per save or load, not per rank
        saved, loaded = (
            next(e for e in events if e["run_id"] == run and e["kind"] == kind)
            for kind in CHECKPOINT_KINDS
        )
        path = root / mode
        size = _size_on_disk(path)
        assert size > 0
        expect: dict[str, Any] = {"path": str(path), "tag": mode, "bytes": size}
        assert saved["step"] == 2 and {k: saved["detail"][k] for k in expect} == expect
        assert saved["detail"]["async"] is (mode == "async")
        assert saved["detail"]["duration_s"] > 0
        assert loaded["step"] == 2 == results[0][f"{mode}_step_after_load"]
        assert {k: loaded["detail"][k] for k in expect} == expect
        assert loaded["detail"]["duration_s"] > 0
        assert set(saved["detail"]) == {*expect, "duration_s", "async"}
        assert set(loaded["detail"]) == {*expect, "duration_s"}
    # The async save is reported when its background commit is done, not when save()
    # returned: after rank 0 wrote the MANIFEST.
    async_saved = next(
        e for e in events if e["run_id"] == "ckpt-async" and e["kind"] == "checkpoint_saved"
    )
    assert async_saved["time"] >= results[0]["async_manifest_mtime"]
