"""benchmarks/monitor_cpu.py runs end to end with the smallest settings (a smoke test:
timings are printed by the script, never asserted here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_monitor_cpu_benchmark_runs() -> None:
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "monitor_cpu.py"),
        "--ranks", "16", "--seconds", "1", "--warmup", "0.5", "--size", "80x24",
        "--frames", "as-sent", "coalesced",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    for table in ("line", "datatable"):
        for frames in ("as-sent", "coalesced"):
            line = rf"^{table}\s+{frames}\s+ranks=\s+16 load\s+[\d.]+\s+monitor CPU\s+[\d.]+%"
            assert re.search(line, proc.stdout, re.M), proc.stdout
        side_by_side = rf"^ranks=16 {table}: CPU % by relay frames: as-sent [\d.]+; coalesced"
        assert re.search(side_by_side, proc.stdout, re.M), proc.stdout
    assert re.search(r"^ranks=16: target 80 records/s; .* CPU % per 1k", proc.stdout, re.M)


@pytest.mark.slow
def test_monitor_receive_path_benchmark_runs() -> None:
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "monitor_cpu.py"),
        "--receive-only", "--ranks", "16", "--seconds", "2",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    # Both streams carry every record (16 ranks x 5/s x 2 s), in frames per rank or batches.
    assert re.search(r"as-sent\s+ranks=\s+16\s+64 frames,\s+160 records", proc.stdout), proc.stdout
    assert re.search(r"coalesced\s+ranks=\s+16\s+4 frames,\s+160 records", proc.stdout)


@pytest.mark.slow
def test_monitor_tui_virtual_benchmark_runs() -> None:
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "monitor_cpu.py"),
        "--tui-virtual", "--ranks", "16", "--seconds", "2", "--size", "80x24",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    # 2 s of traffic in 4 refresh intervals, the first 2 not measured: 16 x 5/s x 1 s.
    line = r"^whole TUI, virtual time\s+ranks=\s+16\s+80 records for 1 s of traffic:\s+[\d.]+%"
    assert re.search(line, proc.stdout, re.M), proc.stdout
