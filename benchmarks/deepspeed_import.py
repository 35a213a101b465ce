"""Import time and peak RSS: `fsdpx-ckpt import-deepspeed` vs DeepSpeed's zero_to_fp32.

    .venv/bin/python benchmarks/deepspeed_import.py                   # ~500 MB ZeRO-2, 2 ranks
    .venv/bin/python benchmarks/deepspeed_import.py --deepspeed-python /tmp/dsvenv/bin/python

Both run in fresh interpreters on the same synthetic ZeRO-2 checkpoint
(benchmarks/deepspeed_synthetic.py), alternating --repeat times so that a change in
machine load hits both alike, and report the median wall time, CPU time (all threads)
and peak RSS growth over the interpreter with its imports loaded. zero_to_fp32 runs
where DeepSpeed is importable (this interpreter, or the one --deepspeed-python names);
else its column is skipped. Goal (issue 17): time <= 1.0x and peak RSS <= 0.5x
zero_to_fp32's, while also keeping the optimizer state that zero_to_fp32 drops.
Measured numbers: README.md, "Measured".
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
import json, resource, sys, time
def cpu():
    # All threads of this process (the writer's encode pool too).
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
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
c, t = cpu(), time.perf_counter()
import_deepspeed(sys.argv[1], sys.argv[2], compression=sys.argv[3])
took, used = time.perf_counter() - t, cpu() - c
after = status('VmHWM')
print(json.dumps({"s": took, "cpu": used, "rss": after - before}))
"""

_ZERO_TO_FP32 = """
import json, resource, sys, time
def cpu():
    # All threads of this process (the writer's encode pool too).
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
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
c, t = cpu(), time.perf_counter()
convert_zero_checkpoint_to_fp32_state_dict(sys.argv[1], sys.argv[2])
took, used = time.perf_counter() - t, cpu() - c
after = status('VmHWM')
print(json.dumps({"s": took, "cpu": used, "rss": after - before}))
"""


def _run(python: str, code: str, *args: str) -> dict[str, float]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": path}
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


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _line(name: str, runs: list[dict[str, float]], what: str) -> str:
    return (
        f"{name}: {_median([r['s'] for r in runs]):.2f} s "
        f"(runs {', '.join(format(r['s'], '.2f') for r in runs)}), "
        f"CPU {_median([r['cpu'] for r in runs]):.2f} s, "
        f"peak RSS +{_median([r['rss'] for r in runs]) / 2**20:.0f} MiB ({what})"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=44 * 1024 * 1024, help="model parameters")
    p.add_argument("--world", type=int, default=2, help="ZeRO ranks (files)")
    p.add_argument("--deepspeed-python", default=sys.executable)
    p.add_argument("--compression", choices=["zstd", "none"], default="zstd")
    p.add_argument(
        "--repeat", type=int, default=3, help="alternating runs of each; medians are compared"
    )
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ds_import_bench_"))
    try:
        tag = make_zero2_checkpoint(work / "ds", numel=args.numel, world=args.world)
        files = sorted(tag.glob("*_optim_states.pt"))
        size = sum(f.stat().st_size for f in files)
        print(
            f"checkpoint: ZeRO-2, {args.world} ranks, {args.numel} parameters, "
            f"{size / 2**20:.0f} MiB, largest file "
            f"{max(f.stat().st_size for f in files) / 2**20:.0f} MiB; "
            f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
        )
        deepspeed = _has_deepspeed(args.deepspeed_python)
        ours: list[dict[str, float]] = []
        refs: list[dict[str, float]] = []
        # Alternating, so that a change in machine load hits both sides alike.
        for _ in range(args.repeat):
            shutil.rmtree(work / "fsdpx", ignore_errors=True)
            ours.append(
                _run(
                    sys.executable, _FSDPX, str(work / "ds"), str(work / "fsdpx"), args.compression
                )
            )
            if deepspeed:
                shutil.rmtree(work / "fp32", ignore_errors=True)
                refs.append(
                    _run(args.deepspeed_python, _ZERO_TO_FP32, str(work / "ds"), str(work / "fp32"))
                )
        print(
            _line(
                f"fsdpx-ckpt import-deepspeed ({args.compression})", ours, "weights and Adam state"
            )
        )
        if not deepspeed:
            print("zero_to_fp32: skipped (DeepSpeed is not importable; see --deepspeed-python)")
            return
        print(_line("zero_to_fp32", refs, "weights only"))
        print(
            f"ratio of medians (fsdpx / zero_to_fp32): "
            f"time {_median([r['s'] for r in ours]) / _median([r['s'] for r in refs]):.3f}, "
            f"CPU {_median([r['cpu'] for r in ours]) / _median([r['cpu'] for r in refs]):.3f}, "
            f"peak RSS {_median([r['rss'] for r in ours]) / max(_median([r['rss'] for r in refs]), 1):.3f}; "
            f"load average now {os.getloadavg()[0]:.1f}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
