"""`fsdpx demo`: argument checks (fast) and a real 2-rank CPU run in plain mode (slow)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsdpx.cli import main as fsdpx_main
from fsdpx.telemetry.wire.logfile import iter_log

ROOT = Path(__file__).resolve().parent.parent


def test_demo_rejects_bad_numbers(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert fsdpx_main(["demo", "--steps", "0", "--out", str(tmp_path)]) == 2
    assert "--steps, --ranks and --every must be >= 1; got 0, 2, 10" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_plain_progress_matches_the_replay_log(tmp_path: Path) -> None:
    """Not a terminal: progress lines, then the relay's log holds the same steps."""
    result = subprocess.run(
        [sys.executable, "-m", "fsdpx.cli", "demo", "--steps", "6", "--every", "2",
         "--out", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    steps = [int(m) for m in re.findall(r"^step\s+(\d+)", result.stdout, re.MULTILINE)]
    assert steps and steps[-1] == 6 and steps == sorted(steps)
    assert "done: step 6" in result.stdout and "ranks 2 exited 0 dead" in result.stdout
    logged = {
        (r["rank"], r["step"])
        for m in iter_log(tmp_path / "run.tlm")
        if m["type"] == "records"
        for r in m["records"]
    }
    assert logged == {(r, s) for r in range(2) for s in range(1, 7)}
    # The training's own output names the same last step.
    assert "step    6 |" in (tmp_path / "train.log").read_text()
