"""Import time and peak RSS: `fsdpx-ckpt import-deepspeed` vs DeepSpeed's zero_to_fp32.

    .venv/bin/python benchmarks/deepspeed_import.py                   # ~500 MB ZeRO-2, 2 ranks
    .venv/bin/python benchmarks/deepspeed_import.py --deepspeed-python /tmp/dsvenv/bin/python

Both run in fresh interpreters on the same synthetic ZeRO-2 checkpoint
(benchmarks/deepspeed_synthetic.py) and report wall time and their own peak RSS growth
over the interpreter with its imports loaded. zero_to_fp32 runs where DeepSpeed is
importable (this interpreter, or the one --deepspeed-python names); else its column is
skipped. Goal (issue 17): time <= 1.0x and peak RSS <= 0.5x zero_to_fp32's, while also
keeping the optimizer state that zero_to_fp32 drops.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from deepspeed_synthetic import make_zero2_checkpoint  # noqa: E402

_FSDPX = """
import json, sys, time
def status(key):
    with open('/proc/self/status') as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ':'))
def rss_now():
    # Reset the high-water mark to the current resident set (Linux clear_refs 5): the
    # imports before may have peaked higher than what stays resident.
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')
    return status('VmRSS')
from checkpoint_tools.deepspeed import import_deepspeed
before = rss_now()
t = time.perf_counter()
import_deepspeed(sys.argv[1], sys.argv[2], compression=sys.argv[3])
took = time.perf_counter() - t
after = status('VmHWM')
print(json.dumps({"s": took, "rss": after - before}))
"""

_ZERO_TO_FP32 = """
import json, sys, time
def status(key):
    with open('/proc/self/status') as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ':'))
def rss_now():
    # Reset the high-water mark to the current resident set (Linux clear_refs 5): the
    # imports before may have peaked higher than what stays resident.
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')
    return status('VmRSS')
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
before = rss_now()
t = time.perf_counter()
convert_zero_checkpoint_to_fp32_state_dict(sys.argv[1], sys.argv[2])
took = time.perf_counter() - t
after = status('VmHWM')
print(json.dumps({"s": took, "rss": after - before}))
"""


def _run(python: str, code: str, *args: str) -> dict[str, float]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [python, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"{python} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _has_deepspeed(python: str) -> bool:
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    probe = [python, "-c", "import deepspeed.utils.zero_to_fp32"]
    return subprocess.run(probe, env=env, capture_output=True).returncode == 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=44 * 1024 * 1024, help="model parameters")
    p.add_argument("--world", type=int, default=2, help="ZeRO ranks (files)")
    p.add_argument("--deepspeed-python", default=sys.executable)
    p.add_argument("--compression", choices=["zstd", "none"], default="zstd")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ds_import_bench_"))
    try:
        tag = make_zero2_checkpoint(work / "ds", numel=args.numel, world=args.world)
        files = sorted(tag.glob("*_optim_states.pt"))
        size = sum(f.stat().st_size for f in files)
        print(
            f"checkpoint: ZeRO-2, {args.world} ranks, {args.numel} parameters, "
            f"{size / 2**20:.0f} MiB, largest file {max(f.stat().st_size for f in files) / 2**20:.0f} MiB"
        )
        ours = _run(sys.executable, _FSDPX, str(work / "ds"), str(work / "fsdpx"), args.compression)
        print(
            f"fsdpx-ckpt import-deepspeed ({args.compression}): {ours['s']:.2f} s, peak RSS +{ours['rss'] / 2**20:.0f} MiB "
            "(weights and Adam state)"
        )
        if not _has_deepspeed(args.deepspeed_python):
            print("zero_to_fp32: skipped (DeepSpeed is not importable; see --deepspeed-python)")
            return
        ref = _run(args.deepspeed_python, _ZERO_TO_FP32, str(work / "ds"), str(work / "fp32"))
        print(
            f"zero_to_fp32: {ref['s']:.2f} s, peak RSS +{ref['rss'] / 2**20:.0f} MiB (weights only)"
        )
        print(
            f"ratio (fsdpx / zero_to_fp32): time {ours['s'] / ref['s']:.3f}, "
            f"peak RSS {ours['rss'] / max(ref['rss'], 1):.3f}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
