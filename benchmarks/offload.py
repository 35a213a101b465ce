"""ZeRO-Offload / ZeRO-Infinity in fsdpx against PyTorch's FSDP2 CPU offload and the raw disk,
side by side in one run.

Run from the repository root (one process, world size 1)::

    python benchmarks/offload.py                                   # 25M and 100M params
    python benchmarks/offload.py --sizes 25e6 100e6 --steps 7 --nvme-path /nvme/tmp
    python benchmarks/offload.py --device cuda --sizes 100e6 350e6 --gpu-size 1.3e9
    python benchmarks/offload.py --quick                           # smoke-sized, ~10 s
    python benchmarks/offload.py --parts 2 --nvme-size 1e9 --nvme-path /nvme/tmp   # NVMe only

The default run takes 2.5-4.5 minutes on 2 shared CPU cores and up to ~6 GB of memory.

What is compared
----------------
1. **Optimizer step with CPU offload.** The GPT of ``fsdpx/demo/gpt.py`` (built on meta,
   materialised from the same seed) is trained by

   * ``fsdpx``: ``fsdpx.shard(model, Config(zero=ZeroConfig(stage=3,
     offload_optimizer=OffloadConfig(device="cpu"))))``: fp32 master + Adam states in host
     memory, stepped by the fused ``fsdpx.ops.adam_step``;
   * ``torch``: ``fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=<CUDA in
     use>))`` on every block and the root, ``torch.optim.AdamW`` over the CPU params, in
     torch's default implementation (for CPU tensors: the single-tensor for-loop), with
     ``foreach=True`` and with ``fused=True``; the three optimizers share one FSDP2 model.

   Same hyper-parameters (AdamW, lr 1e-4, weight decay 0.01) and batches on both sides.
   **opt ms** is the optimizer's ``step()`` alone, timed by
   ``Optimizer.register_step_pre_hook``/``register_step_post_hook`` (``cuda.synchronize``
   in both hooks, so an asynchronous copy back to the GPU is inside); fsdpx's step is the
   one ``engine.step()`` makes (its zero_grad and counters are outside). **iter ms** is a
   whole iteration: forward, backward (where both sides copy gradients to the host),
   optimizer step, zero_grad. On CUDA FSDP2 copies the updated parameters back to the GPU
   in the next forward's all-gather, fsdpx inside its step: compare iter ms for the whole
   picture. Rounds are interleaved (every side once per round, the order rotating), after
   ``--warmup`` rounds, and the median of ``--steps`` rounds is reported.
   On a CPU-only host the "device" is host memory: this measures the optimizer math and
   the data movement between the sharded params and the host state, nothing else.
   Ratio: fsdpx / torch default (goal <= 0.7); the other anchors are printed as well.
2. **NVMe step.** ``offload_optimizer=OffloadConfig(device="nvme", nvme_path=<--nvme-path>,
   buffer_mb=<--nvme-buffer-mb>)``. A step reads and writes master + exp_avg + exp_avg_sq:
   24 bytes/param. Effective bandwidth = 24 * params / opt-step time, compared with ``dd``
   on the same directory: ``dd if=/dev/zero of=<path>/ddtest bs=1M count=<--dd-mb>
   conv=fdatasync`` (write) and ``dd if=<path>/ddtest of=/dev/null bs=1M iflag=direct``
   (read), measured before and after the fsdpx steps, best kept. Since a step does half
   reads and half writes on one disk, the disk-bound time is 12 P / R + 12 P / W: the ratio
   (goal >= 0.7) is that time over the measured step time, i.e. effective bandwidth over
   the harmonic mean of R and W. dd is one stream of 1 MiB requests, the swapper several
   O_DIRECT threads: on disks that gain from parallel requests the ratio can exceed 1.
   Host memory: ``engine.optimizer.host_buffer_bytes`` (the streaming buffers) and the
   peak growth of the process RSS (sampled every 5 ms) over its value before the model was
   built, while setting up and during the steps; on a CPU-only host that growth includes
   the model's params and grads, which live in host memory there.
3. **GPU (CUDA only).** ``torch.cuda.set_per_process_memory_fraction(--gpu-mem-fraction)``
   leaves too little memory for the ``--gpu-size`` GPT without offload (16 bytes/param for
   fp32 params, grads and Adam states). It is run with bf16 ``param_dtype`` without offload
   (expected: ``OOM``, caught ``torch.OutOfMemoryError``), with FSDP2 CPUOffloadPolicy + torch
   AdamW (anchor), with fsdpx ``offload_optimizer`` cpu and nvme. Per variant: median
   iteration time and peak ``torch.cuda.max_memory_allocated``.

The last line printed is a one-line JSON summary. Exit status 1 when an offloaded run fails.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fsdpx  # noqa: E402
from fsdpx.config import (  # noqa: E402
    OffloadConfig,
    OptimizerConfig,
    PrecisionConfig,
    ZeroConfig,
)
from fsdpx.demo.gpt import GPT, GPTConfig  # noqa: E402

OPT = OptimizerConfig(type="adamw", lr=1e-4, weight_decay=0.01)
STATE_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq per parameter
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
Batch = tuple[torch.Tensor, torch.Tensor]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[25e6, 100e6], help="params")
    p.add_argument("--steps", type=int, default=5, help="timed rounds (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    p.add_argument("--param-dtype", choices=list(DTYPES), default="fp32", help="parts 1-2")
    p.add_argument("--batch", type=int, default=0, help="0: 1 on CPU, 4 on CUDA")
    p.add_argument("--seq", type=int, default=0, help="0: 32 on CPU, 256 on CUDA")
    p.add_argument(
        "--nvme-path",
        type=Path,
        default=None,
        help="directory for the swap file and dd (default: a temp dir under the current dir)",
    )
    p.add_argument("--nvme-size", type=float, default=0, help="params (0: largest --sizes)")
    p.add_argument("--nvme-buffer-mb", type=int, default=256)
    p.add_argument("--dd-mb", type=int, default=1024, help="dd file size in MiB")
    p.add_argument("--gpu-size", type=float, default=1.3e9, help="params of the part-3 GPT")
    p.add_argument("--gpu-mem-fraction", type=float, default=0.2)
    p.add_argument("--gpu-steps", type=int, default=3)
    p.add_argument("--gpu-batch", type=int, default=4)
    p.add_argument("--gpu-seq", type=int, default=512)
    p.add_argument("--no-gpu-anchor", action="store_true", help="part 3 without FSDP2 offload")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few steps (smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.steps, args.warmup, args.dd_mb = [1e6], 2, 1, 8
        args.nvme_buffer_mb, args.gpu_size, args.gpu_steps = 1, 2e8, 1
    if args.steps < 1 or args.warmup < 0 or args.gpu_steps < 1:
        p.error("--steps and --gpu-steps must be >= 1, --warmup >= 0")
    if not 0 < args.gpu_mem_fraction <= 1 or min(args.sizes) < 1e5:
        p.error("--gpu-mem-fraction must be in (0, 1], --sizes at least 1e5 params")
    return args


# --- models ----------------------------------------------------------------------------------


def gpt_config(params: float, seq: int) -> GPTConfig:
    """A GPT of about `params` parameters (12 * n_layer * n_embd**2 plus small embeddings):
    the widest n_embd of a ladder whose nearest layer count (>= 4) lands within 10%, else
    the closest fit."""
    fits = []
    for width in (128, 256, 384, 512, 768, 1024, 1536, 2048):
        layers = max(round(params / (12 * width * width)), 2)
        fits.append((abs(12 * width * width * layers - params) / params, layers, width))
    good = [f for f in fits if f[0] <= 0.1 and f[1] >= 4]
    _, layers, width = good[-1] if good else min(fits)
    return GPTConfig(block_size=seq, n_layer=layers, n_head=max(width // 64, 1), n_embd=width)


def numel(cfg: GPTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def build_fsdpx(
    cfg: GPTConfig, device: torch.device, offload: OffloadConfig, param_dtype: str
) -> Any:
    """fsdpx ZeRO-3 engine with `offload` as offload_optimizer; built on meta."""
    config = fsdpx.Config(
        zero=ZeroConfig(stage=3, offload_optimizer=offload),
        precision=PrecisionConfig(param_dtype=param_dtype, reduce_dtype="fp32"),  # type: ignore[arg-type]
        optimizer=OPT,
        device=device.type,  # type: ignore[arg-type]
        seed=0,
    )
    with torch.device("meta"):
        model = GPT(cfg)
    return fsdpx.shard(model, config)


def build_fsdp2(
    cfg: GPTConfig, device: torch.device, param_dtype: str, offload: bool = True
) -> nn.Module:
    """Hand-written FSDP2 (torchtitan's recipe): fully_shard per block and root with
    CPUOffloadPolicy, meta init, params materialised on the host (device without offload)."""
    mesh = init_device_mesh(device.type, (1,))
    kw: dict[str, Any] = {"mesh": mesh}
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    if param_dtype != "fp32":
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32
        )
    with torch.device("meta"):
        model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, reshard_after_forward=False, **kw)
    model.to_empty(device="cpu" if offload else device)
    torch.manual_seed(0)
    model.reset_parameters()
    return model


def torch_adamw(model: nn.Module, variant: str) -> torch.optim.Optimizer:
    kw: dict[str, Any] = {"foreach": True} if variant == "foreach" else {}
    if variant == "fused":
        kw["fused"] = True
    return torch.optim.AdamW(
        model.parameters(),
        lr=OPT.lr,
        betas=OPT.betas,
        eps=OPT.eps,
        weight_decay=OPT.weight_decay,
        **kw,
    )


# --- measurement -----------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssPeak:
    """Samples this process's RSS every 5 ms in a thread; `.peak` is the largest seen."""

    def __init__(self) -> None:
        self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss())

    def reset(self) -> int:
        """The peak so far; the next peak counts from now."""
        peak, self.peak = max(self.peak, rss()), rss()
        return peak

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
        return self.peak


class OptTimer:
    """Wall time of every optimizer.step(), via the optimizer's step hooks (synchronized)."""

    def __init__(self, opt: torch.optim.Optimizer, device: torch.device) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

        def pre(*_: Any) -> None:
            sync(device)
            self._t0 = time.perf_counter()

        def post(*_: Any) -> None:
            sync(device)
            self.times.append(time.perf_counter() - self._t0)

        opt.register_step_pre_hook(pre)
        opt.register_step_post_hook(post)


@dataclass
class Side:
    name: str
    run: Callable[[Batch], None]
    """One iteration: forward, backward, optimizer step, zero_grad."""
    timer: OptTimer
    close: Callable[[], None] = lambda: None
    """Releases what the side holds outside the process (fsdpx: engine.close(), swap files)."""
    iters: list[float] = field(default_factory=list)

    def opt_ms(self, skip: int) -> float:
        return statistics.median(self.timer.times[skip:]) * 1e3

    def iter_ms(self, skip: int) -> float:
        return statistics.median(self.iters[skip:]) * 1e3


def engine_side(name: str, engine: Any, device: torch.device) -> Side:
    def run(batch: Batch) -> None:
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()

    return Side(name, run, OptTimer(engine.optimizer, device), engine.close)


def torch_side(name: str, model: nn.Module, opt: torch.optim.Optimizer, dev: torch.device) -> Side:
    def run(batch: Batch) -> None:
        model(*batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Side(name, run, OptTimer(opt, dev))


def run_rounds(sides: list[Side], batch: Batch, rounds: int, device: torch.device) -> None:
    """Every side once per round, the order rotating, so machine noise hits all alike."""
    for r in range(rounds):
        for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
            sync(device)
            t0 = time.perf_counter()
            side.run(batch)
            sync(device)
            side.iters.append(time.perf_counter() - t0)


def batch_for(cfg: GPTConfig, batch: int, device: torch.device) -> Batch:
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=gen)
    return x[:, :-1].to(device), x[:, 1:].to(device)


def free(device: torch.device) -> None:
    """Release freed memory, so that an RSS measured next starts from what is in use: glibc
    keeps freed heap chunks (tensors under its 32 MiB mmap threshold) mapped and reuses
    them, which would hide a later allocation from the RSS growth."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# --- part 1: optimizer step, CPU offload ---------------------------------------------------


def part_cpu_offload(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    print(
        f"\n[1] optimizer step with CPU offload: fsdpx vs FSDP2 CPUOffloadPolicy + torch AdamW "
        f"(device {device.type}, {args.param_dtype} params, batch {args.batch}x{args.seq}, "
        f"median of {args.steps} after {args.warmup} warm-up rounds)"
    )
    print(f"{'size':>8} {'params':>9}  {'side':<24}{'opt ms':>10}{'iter ms':>10}{'fsdpx/x':>8}")
    for size in args.sizes:
        cfg = gpt_config(size, args.seq)
        n = numel(cfg)
        engine = build_fsdpx(cfg, device, OffloadConfig(device="cpu"), args.param_dtype)
        model = build_fsdp2(cfg, device, args.param_dtype)
        sides = [engine_side("fsdpx offload cpu", engine, device)]
        sides += [
            torch_side(f"torch AdamW {v}", model, torch_adamw(model, v), device)
            for v in ("default", "foreach", "fused")
        ]
        try:
            run_rounds(sides, batch_for(cfg, args.batch, device), args.warmup + args.steps, device)
        finally:
            engine.close()
        opt = {s.name: s.opt_ms(args.warmup) for s in sides}
        it = {s.name: s.iter_ms(args.warmup) for s in sides}
        fx = opt["fsdpx offload cpu"]
        label = f"{size / 1e6:g}M"
        for i, s in enumerate(sides):
            ratio = "" if i == 0 else f"{fx / opt[s.name]:8.3f}"
            head = f"{label:>8} {n / 1e6:8.1f}M" if i == 0 else " " * 18
            print(f"{head}  {s.name:<24}{opt[s.name]:10.1f}{it[s.name]:10.1f}{ratio}")
        out[label] = {
            "params": n,
            "opt_ms": opt,
            "iter_ms": it,
            "ratio_default": fx / opt["torch AdamW default"],
            "ratio_foreach": fx / opt["torch AdamW foreach"],
            "ratio_fused": fx / opt["torch AdamW fused"],
            "iter_ratio_default": it["fsdpx offload cpu"] / it["torch AdamW default"],
        }
        del engine, model, sides
        free(device)
    print(
        "ratio fsdpx/torch-default opt-step (goal <= 0.7): "
        + " ".join(f"{k}={v['ratio_default']:.3f}" for k, v in out.items())
    )
    print(
        "ratio fsdpx/torch opt-step foreach, fused: "
        + " ".join(f"{k}={v['ratio_foreach']:.3f},{v['ratio_fused']:.3f}" for k, v in out.items())
    )
    return out


# --- part 2: NVMe ----------------------------------------------------------------------------


def dd(path: Path, mib: int) -> tuple[float, float, str]:
    """(write, read) bytes/s of dd on `path`: fdatasync'ed write, O_DIRECT read (buffered,
    with a note, where the file system refuses O_DIRECT)."""
    target = path / "ddtest"
    env = {**os.environ, "LC_ALL": "C"}  # dd's summary line in a parseable locale

    def rate(cmd: list[str]) -> float:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        found = re.search(r"^(\d+) bytes .* copied, ([0-9.e+-]+) s", proc.stderr, re.MULTILINE)
        if not found:
            raise RuntimeError(f"cannot parse dd's output: {proc.stderr!r}")
        return int(found.group(1)) / float(found.group(2))

    note = ""
    try:
        write = rate(
            ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}", "conv=fdatasync"]
        )
        try:
            read = rate(["dd", f"if={target}", "of=/dev/null", "bs=1M", "iflag=direct"])
        except subprocess.CalledProcessError:
            read = rate(["dd", f"if={target}", "of=/dev/null", "bs=1M"])
            note = " (read buffered: O_DIRECT refused)"
    finally:
        target.unlink(missing_ok=True)
    return write, read, note


def part_nvme(args: argparse.Namespace, device: torch.device, path: Path) -> dict[str, Any]:
    size = args.nvme_size or max(args.sizes)
    cfg = gpt_config(size, args.seq)
    n = numel(cfg)
    print(
        f"\n[2] NVMe offload step vs dd on {path} ({n / 1e6:.1f}M params, "
        f"buffer_mb {args.nvme_buffer_mb}, {args.param_dtype} params, device {device.type})"
    )
    w1, r1, note = dd(path, args.dd_mb)
    free(device)
    rss0 = rss()
    sampler = RssPeak()
    offload = OffloadConfig(device="nvme", nvme_path=str(path), buffer_mb=args.nvme_buffer_mb)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = build_fsdpx(cfg, device, offload, args.param_dtype)
    setup_peak = sampler.reset()
    try:
        side = engine_side("fsdpx offload nvme", engine, device)
        run_rounds([side], batch_for(cfg, args.batch, device), args.warmup + args.steps, device)
        peak = sampler.stop()
        host_buffers = int(engine.optimizer.host_buffer_bytes)
    finally:
        sampler.stop()
        engine.close()
    del engine
    free(device)
    w2, r2, _ = dd(path, args.dd_mb)
    write, read = max(w1, w2), max(r1, r2)
    t = side.opt_ms(args.warmup) / 1e3
    moved = 2 * STATE_BYTES * n
    combined = 2 / (1 / read + 1 / write)
    res = {
        "params": n,
        "opt_ms": t * 1e3,
        "iter_ms": side.iter_ms(args.warmup),
        "bytes_per_step": moved,
        "effective_GBps": moved / t / 1e9,
        "dd_write_GBps": write / 1e9,
        "dd_read_GBps": read / 1e9,
        "ratio": moved / t / combined,
        "ratio_vs_write": moved / t / write,
        "host_buffer_bytes": host_buffers,
        "rss_growth_bytes": peak - rss0,
        "rss_growth_setup_bytes": setup_peak - rss0,
        "state_bytes": STATE_BYTES * n,
    }
    for w in caught:
        print(f"warning during setup: {w.category.__name__}: {w.message}")
    print(
        f"opt step {res['opt_ms']:.1f} ms (iteration {res['iter_ms']:.1f} ms), "
        f"{moved / 2**20:.0f} MiB moved/step -> {res['effective_GBps']:.3f} GB/s"
    )
    print(
        f"dd: write+fdatasync {w1 / 1e9:.3f}/{w2 / 1e9:.3f} GB/s, read O_DIRECT "
        f"{r1 / 1e9:.3f}/{r2 / 1e9:.3f} GB/s (before/after, {args.dd_mb} MiB){note}; "
        f"harmonic mean of the best {combined / 1e9:.3f} GB/s"
    )
    device_note = ""
    if device.type == "cpu":
        pg = 2 * DTYPES[args.param_dtype].itemsize * n
        device_note = f" (incl. {pg / 2**20:.1f} MiB of params+grads: the 'device' is host memory)"
    print(
        f"host memory: streaming buffers {host_buffers / 2**20:.1f} MiB "
        f"(bound {args.nvme_buffer_mb} MiB); peak RSS growth over the process before the "
        f"model: {res['rss_growth_bytes'] / 2**20:.1f} MiB during the steps, "
        f"{res['rss_growth_setup_bytes'] / 2**20:.1f} MiB while setting up{device_note}; "
        f"offloaded state {res['state_bytes'] / 2**20:.1f} MiB on disk"
    )
    print(
        f"ratio nvme-step/dd (effective / harmonic(read, write); goal >= 0.7): {res['ratio']:.3f}; "
        f"vs dd write alone: {res['ratio_vs_write']:.3f}"
    )
    return res


# --- part 3: GPU, a model that does not fit without offload --------------------------------


def part_gpu(args: argparse.Namespace, device: torch.device, path: Path) -> dict[str, Any]:
    cfg = gpt_config(args.gpu_size, args.gpu_seq)
    n = numel(cfg)
    total = torch.cuda.get_device_properties(device).total_memory
    budget = total * args.gpu_mem_fraction
    print(
        f"\n[3] GPU: {n / 1e9:.2f}B-param GPT (n_layer {cfg.n_layer}, n_embd {cfg.n_embd}), "
        f"batch {args.gpu_batch}x{args.gpu_seq}, bf16 params; memory fraction "
        f"{args.gpu_mem_fraction} = {budget / 2**30:.1f} GiB of {total / 2**30:.1f} GiB "
        f"(without offload fp32 params+grads+Adam need {16 * n / 2**30:.1f} GiB)"
    )
    torch.cuda.set_per_process_memory_fraction(args.gpu_mem_fraction, device)
    variants: list[tuple[str, Callable[[], Side]]] = [
        (
            "fsdpx no offload",
            lambda: engine_side("", build_fsdpx(cfg, device, OffloadConfig(), "bf16"), device),
        ),
    ]
    if not args.no_gpu_anchor:

        def anchor() -> Side:
            model = build_fsdp2(cfg, device, "bf16")
            return torch_side("", model, torch_adamw(model, "default"), device)

        variants.append(("FSDP2 CPUOffloadPolicy", anchor))
    variants.append(
        (
            "fsdpx offload cpu",
            lambda: engine_side(
                "", build_fsdpx(cfg, device, OffloadConfig(device="cpu"), "bf16"), device
            ),
        )
    )
    nvme = OffloadConfig(device="nvme", nvme_path=str(path), buffer_mb=args.nvme_buffer_mb)
    variants.append(
        (
            "fsdpx offload nvme",
            lambda: engine_side("", build_fsdpx(cfg, device, nvme, "bf16"), device),
        )
    )
    batch = batch_for(cfg, args.gpu_batch, device)
    out: dict[str, Any] = {"params": n, "budget_bytes": budget}
    print(
        f"{'variant':<24}{'iter ms':>10}{'opt ms':>10}{'peak alloc GiB':>16}{'peak reserved GiB':>19}"
    )
    try:
        for name, make in variants:
            free(device)
            torch.cuda.reset_peak_memory_stats(device)
            side: Side | None = None
            try:
                side = make()
                run_rounds([side], batch, 1 + args.gpu_steps, device)
            except torch.OutOfMemoryError:
                out[name] = "OOM"
                print(f"{name:<24}{'OOM':>10}")
                continue
            finally:
                if side is not None:
                    side.close()
            peak, reserved = (
                torch.cuda.max_memory_allocated(device),
                torch.cuda.max_memory_reserved(device),
            )
            out[name] = {"iter_ms": side.iter_ms(1), "opt_ms": side.opt_ms(1), "peak_bytes": peak}
            print(
                f"{name:<24}{side.iter_ms(1):10.1f}{side.opt_ms(1):10.1f}{peak / 2**30:16.2f}{reserved / 2**30:19.2f}"
            )
            del side
    finally:
        free(device)
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    if out.get("fsdpx no offload") != "OOM":
        print("note: the model fit without offload; raise --gpu-size or lower --gpu-mem-fraction")
    if isinstance(out.get("FSDP2 CPUOffloadPolicy"), dict) and isinstance(
        out.get("fsdpx offload cpu"), dict
    ):
        r = out["fsdpx offload cpu"]["iter_ms"] / out["FSDP2 CPUOffloadPolicy"]["iter_ms"]
        out["iter_ratio_cpu_vs_fsdp2"] = r
        print(f"ratio fsdpx offload cpu / FSDP2 CPUOffloadPolicy (iteration): {r:.3f}")
    return out


# --- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available; use --device cpu or auto")
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise SystemExit("run as one process (world size 1), not under torchrun")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    args.batch = args.batch or (4 if use_cuda else 1)
    args.seq = args.seq or (256 if use_cuda else 32)
    fsdpx.init_distributed(
        fsdpx.Config(device="cuda" if use_cuda else "cpu")
    )  # one-rank group, no launcher
    if use_cuda:
        torch.zeros(1, device=device)  # CUDA context before any RSS baseline
    from fsdpx.ops import load_ops

    ops = load_ops()
    name = (
        torch.cuda.get_device_name(device) if use_cuda else torch.backends.cpu.get_cpu_capability()
    )
    print(
        f"torch {torch.__version__}, device {device} ({name}), {torch.get_num_threads()} torch "
        f"threads, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; fsdpx ops "
        f"{'native' if ops.available else 'UNAVAILABLE: ' + str(ops.reason)}"
    )
    made = args.nvme_path is None
    path = Path(tempfile.mkdtemp(prefix=".offload-bench-", dir=".")) if made else args.nvme_path
    path.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {
        "benchmark": "offload",
        "device": str(device),
        "torch": torch.__version__,
    }
    failed = False
    try:
        if 1 in args.parts:
            summary["cpu_offload"] = part_cpu_offload(args, device)
        if 2 in args.parts:
            summary["nvme"] = part_nvme(args, device, path)
        if 3 in args.parts and use_cuda:
            gpu = part_gpu(args, device, path)
            summary["gpu"] = gpu
            failed = any(gpu.get(k) == "OOM" for k in ("fsdpx offload cpu", "fsdpx offload nvme"))
        elif 3 in args.parts:
            print("\n[3] GPU part skipped: no CUDA device (run with --device cuda on a GPU host)")
    finally:
        if made:
            shutil.rmtree(path, ignore_errors=True)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")
    summary["failed"] = failed
    print(json.dumps(summary, separators=(",", ":")))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
