"""Running a benchmark script as a user would (tests/test_benchmarks_smoke.py and the
benchmark tests beside it): its stdout after exit 0, and finding its printed lines."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NUM = r"\d+\.\d+"  # a printed ratio, e.g. 0.838


def run_benchmark(args: list[str], ranks: int = 0) -> str:
    """Run benchmarks/`args[0]` with `args[1:]` (under torchrun with `ranks` > 0); its
    stdout, after exit 0."""
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    cmd = [sys.executable, *(launch if ranks else []), str(ROOT / "benchmarks" / args[0])]
    proc = subprocess.run(cmd + args[1:], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def line(pattern: str, out: str) -> str:
    """The whole line of `out` matching `pattern`, asserting there is one."""
    found = re.search(rf"^{pattern}$", out, re.MULTILINE)
    assert found, f"no line matching {pattern!r} in:\n{out}"
    return found.group(0)
