"""fsdpx's native ops against their anchors, side by side in one run.

Run from the repository root (takes ~2-4 minutes; needs ~4 GB of free memory at 200M)::

    python benchmarks/ops.py                          # 50M and 200M elements, 1 and 2 threads
    python benchmarks/ops.py --sizes 1e6 --iters 2 --skip-build    # smoke-sized

adam_step (one fp32 tensor of N elements, fp32 gradient)
--------------------------------------------------------
* **step**: `fsdpx.ops.adam_step` vs `torch.optim.AdamW(fused=True)` (goal: >= 1.0x the
  faster anchor) and vs DeepSpeedCPUAdam when deepspeed is importable (never a dependency).
  Every side updates the same param/grad/exp_avg/exp_avg_sq tensors (torch's optimizer state is
  pointed at them), so memory stays at ~18 bytes/element and the data is identical.
* **step + bf16 copy**: adam_step writing the bf16 copy of the params in the same pass vs
  the anchor's step followed by a separate `bf16.copy_(param)` pass (what ZeRO-Offload does
  since DeepSpeed dropped its fused copy); goal: fused <= 0.85x the faster anchor.
* GB/s: bytes a step must move (28 B/element: read p, g, m, v, write p, m, v; +2 with the
  bf16 copy; +6 for a separate copy pass, which rereads p) over the time, next to the
  measured bandwidth of a plain fp32 `copy_` (8 B/element) at the same thread count.
Runs are interleaved (every side once per round, the order rotating) and the median of
`--iters` rounds is reported, so load from other processes hits every side alike; on a
shared machine the numbers still move between runs by 10-20%.

Build time
----------
A fresh interpreter JIT-builds the CPU ops into an empty cache directory (what the first use
costs), then a second one loads that cache (what every later process costs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdpx.ops import adam_step, load_ops  # noqa: E402

HYPER: dict[str, Any] = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
STEP_BYTES = 28
COPY_BYTES = 2
SEPARATE_COPY_BYTES = 6


def _median_times(
    fns: dict[str, Callable[[], object]], iters: int, warmup: int = 1
) -> dict[str, float]:
    """Median wall time of each fn, running them round-robin (order rotating each round)."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(iters):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            start = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - start)
    return {n: statistics.median(t) for n, t in times.items()}


def _deepspeed_adam(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor
) -> Callable[[], object] | None:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]
    except Exception:
        return None
    param = torch.nn.Parameter(p, requires_grad=False)
    # DeepSpeedCPUAdam.step skips a parameter whose .grad is None: without this line the
    # column timed an empty loop (0.3 ms for 50M elements).
    param.grad = g
    opt = DeepSpeedCPUAdam(
        [param], lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], adamw_mode=True
    )
    opt.state[param] = {"step": 0, "exp_avg": m, "exp_avg_sq": v}
    return lambda: opt.step()


def bench_adam(n: int, threads: int, iters: int) -> None:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-2
    m = torch.zeros(n)
    v = torch.zeros(n)
    bf16 = torch.empty(n, dtype=torch.bfloat16)
    src = torch.empty(n)
    step = [0]

    def fsdpx_step(copy: bool) -> Callable[[], None]:
        def run() -> None:
            step[0] += 1
            adam_step(
                [p], [g], [m], [v], step=step[0], param_copies=[bf16] if copy else None, **HYPER
            )

        return run

    param = torch.nn.Parameter(p, requires_grad=False)
    param.grad = g
    opt = torch.optim.AdamW([param], lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], fused=True)
    opt.state[param] = {"step": torch.tensor(0.0), "exp_avg": m, "exp_avg_sq": v}

    def torch_then_copy() -> None:
        opt.step()
        bf16.copy_(p)

    fns: dict[str, Callable[[], object]] = {
        "copy_": lambda: src.copy_(p),
        "fsdpx": fsdpx_step(False),
        "torch_fused": opt.step,
        "fsdpx+bf16": fsdpx_step(True),
        "torch_fused,copy": torch_then_copy,
    }
    ds = _deepspeed_adam(p, g, m, v)
    if ds is not None:
        fns["deepspeed"] = ds

        def ds_then_copy() -> None:
            ds()
            bf16.copy_(p)

        fns["deepspeed,copy"] = ds_then_copy
    t = _median_times(fns, iters)

    def line(name: str, nbytes: int) -> str:
        return f"{name:>17} {t[name] * 1e3:8.1f} ms {nbytes * n / t[name] / 1e9:6.1f} GB/s"

    bw = 8 * n / t["copy_"] / 1e9
    print(
        f"\n[adam_step] {n / 1e6:.0f}M elements, {threads} thread(s); fp32 copy_ bandwidth {bw:.1f} GB/s"
    )
    print(line("fsdpx", STEP_BYTES) + f"  ({STEP_BYTES * n / t['fsdpx'] / 1e9 / bw:.2f}x copy bw)")
    print(line("torch_fused", STEP_BYTES))
    anchors = ["torch_fused"] + (["deepspeed"] if ds is not None else [])
    if ds is not None:
        print(line("deepspeed", STEP_BYTES))
    print(
        line("fsdpx+bf16", STEP_BYTES + COPY_BYTES)
        + f"  ({(STEP_BYTES + COPY_BYTES) * n / t['fsdpx+bf16'] / 1e9 / bw:.2f}x copy bw)"
    )
    print(line("torch_fused,copy", STEP_BYTES + SEPARATE_COPY_BYTES))
    if ds is not None:
        print(line("deepspeed,copy", STEP_BYTES + SEPARATE_COPY_BYTES))
    fastest = min(t[a] for a in anchors)
    fastest_copy = min(t[f"{a},copy"] for a in anchors)
    print(
        f"ratio step: anchor/fsdpx = {fastest / t['fsdpx']:.2f}x (goal >= 1.0); "
        f"step+bf16: fsdpx/(anchor step, then copy) = {t['fsdpx+bf16'] / fastest_copy:.2f}x "
        "(goal <= 0.85)"
    )


def bench_build() -> None:
    """Build time of the CPU ops in a fresh cache, then the load time from that cache. The
    compilers' CPU seconds are printed too: on a shared machine they say more than wall time
    (on 2 idle cores the wall time is about max(CPU / 2, the slowest file))."""
    code = (
        "import json, resource, time; t = time.perf_counter(); from fsdpx.ops import load_ops; "
        "s = load_ops(); r = resource.getrusage(resource.RUSAGE_CHILDREN); "
        "print(json.dumps([s.available, s.build_seconds, time.perf_counter() - t, "
        "r.ru_utime + r.ru_stime, s.reason, s.library_path]))"
    )
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "FSDPX_OPS_CACHE": cache}
        runs = []
        for _ in range(2):
            out = subprocess.run(
                [sys.executable, "-c", code],
                env=env,
                cwd=root,
                capture_output=True,
                text=True,
                check=True,
            )
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        (ok, built, _, cpu, reason, lib), (_, _, load, _, _, _) = runs
        if not ok:
            print(f"\n[build] failed: {reason}")
            return
        log = (Path(lib).parent / ".ninja_log").read_text().splitlines()[1:]
        per_file = ", ".join(
            f"{parts[3]} {(int(parts[1]) - int(parts[0])) / 1e3:.1f} s"
            for parts in (line.split("\t") for line in log)
        )
    jobs = os.environ.get("MAX_JOBS", str(os.cpu_count()))
    print(
        f"\n[build] CPU ops from an empty cache: {built:.1f} s wall, {cpu:.1f} s compiler CPU "
        f"(ninja -j {jobs}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}); "
        f"per file: {per_file}"
    )
    print(f"[build] a new process loading that cache: {load:.2f} s (incl. import)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[50e6, 200e6])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument(
        "--skip-build", action="store_true", help="skip the (tens of seconds) build timing"
    )
    args = ap.parse_args()

    status = load_ops()
    if not status.available:
        raise SystemExit(f"the native ops are unavailable ({status.reason}); nothing to compare")
    load1 = os.getloadavg()[0]
    print(
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores, load average {load1:.1f}"
    )
    for n in args.sizes:
        for threads in args.threads:
            bench_adam(int(n), threads, args.iters)
    if not args.skip_build:
        bench_build()

    # ---- aio -------------------------------------------------------------------------------
    # Place for the aio section (read/write GB/s vs dd with fdatasync on the same file system),
    # to be merged here from ops-io's benchmarks/ops_aio.py by the lead.
    # -----------------------------------------------------------------------------------------

    print(
        f"\nload average at the end: {os.getloadavg()[0]:.1f} (machine shared: other load skews timings)"
    )


if __name__ == "__main__":
    main()
