"""benchmarks/step_overhead.py runs end to end on 2 gloo ranks with the smallest settings.

A smoke test only: it checks that the script exits 0 and prints its ratio and memory
lines for every stage. Timings are never asserted (DESIGN.md section 7: benchmarks are
scripts, not timed tests).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_step_overhead_script_runs() -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "benchmarks" / "step_overhead.py"),
        "--steps",
        "2",
        "--warmup",
        "1",
        "--tiny",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    ratio = re.search(r"^ratio fsdpx/raw .*$", out, re.MULTILINE)
    assert ratio, out
    for stage in (0, 1, 2, 3):
        assert re.search(rf"stage{stage}=\d+\.\d+", ratio.group(0)), ratio.group(0)
    memory = re.search(r"^model-state error vs ZeRO formula .*$", out, re.MULTILINE)
    assert memory, out
    for stage in (0, 1, 2, 3):
        assert re.search(rf"stage{stage}=[+-]\d+\.\d+%", memory.group(0)), memory.group(0)
    # Both sides ran the same model on the same data: identical losses (printed, not timed).
    assert re.search(r"max\|dloss\|", out), out
