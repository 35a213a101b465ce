"""`q` in `fsdpx demo`'s monitor is a user stop: the training stops cleanly (exit 0, no
traceback in train.log, exit events rather than dead ranks), the demo says so and
returns 0. A real 2-rank CPU run under torchrun (slow)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from fsdpx.telemetry.wire.logfile import iter_log
from monitor import demo


def _quit_once_training_runs(log: Path, timeout_s: float = 300.0) -> None:
    """Stands in for the monitor: returns (the user pressed q) once a step arrived."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.exists() and any(m["type"] == "records" for m in iter_log(log)):
            return
        time.sleep(0.5)
    raise AssertionError("no training step reached the relay")


@pytest.mark.slow
def test_quitting_the_monitor_stops_training_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = demo.DemoPaths(tmp_path)
    monkeypatch.setattr(demo.sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(demo, "_watch", lambda address: _quit_once_training_runs(paths.log))
    args = argparse.Namespace(steps=100_000, ranks=2, out=tmp_path, every=10)
    code = demo.run_demo(args)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "training stopped (monitor quit)" in out and "exited with" not in out
    train_log = paths.train_output.read_text()
    assert "Traceback" not in train_log and "SignalException" not in train_log, train_log
    assert "stopping:" in train_log  # the ranks' own word that they stopped on request
    events = [e for m in iter_log(paths.log) if m["type"] == "events" for e in m["events"]]
    exits = sorted(e["rank"] for e in events if e["kind"] == "exit")
    assert exits == [0, 1], events  # both said goodbye: exited, not dead
    assert not [e for e in events if e["kind"] in ("disconnected", "exception")]
