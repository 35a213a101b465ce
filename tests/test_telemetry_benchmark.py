"""benchmarks/telemetry.py runs end to end with the smallest settings (a smoke test: it
checks the script exits 0 and prints its lines; timings are never asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_telemetry_benchmark_runs() -> None:
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "telemetry.py"),
        "--tiny",
        "--steps",
        "4",
        "--warmup",
        "2",
        "--fanin-conns",
        "4",
        "--fanin-frames",
        "50",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert re.search(r"^ratio on/off of medians \d+\.\d+", proc.stdout, re.MULTILINE)
    assert re.search(r"telemetry calls on the training thread: [\d.]+ us/step", proc.stdout)
    assert len(re.findall(r"^  [\d,]+ frames per relay CPU-second", proc.stdout, re.M)) == 2
    assert "(frames as sent)" in proc.stdout
    assert re.search(r"\(frames batch_s=0\.5 \([1-9]\d* batches\)\)", proc.stdout), proc.stdout
