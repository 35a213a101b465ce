"""Where one rank's checkpoint save spends its time, per stage (issue 22's profile).

One process writes one rank's files with `RankWriter` (what `engine.save_checkpoint` does
on each rank after collecting its shards), over the state `benchmarks/checkpoint.py`
saves: its model (fp32 or bf16 weights ~N(0, 0.02)) after one AdamW step, parameters plus
exp_avg and exp_avg_sq, `--params-m` million parameters. Each stage is timed where it is
called:

* sample: `codec.worth_compressing` (zstd over a sample of each plane);
* shuffle+CRC: the kernels' one-pass shuffle (and CRC-32 of the raw planes);
* zstd: compressing the planes worth it;
* CRC: CRC-32 of compressed frames and raw chunks, CRC combination;
* write: the data file's write calls (copying into the page cache); fsync: the fsyncs;
* other CPU: the process's remaining CPU time (Python, tensor copies, the index).

All but fsync are CPU seconds of the calling thread (`time.thread_time`, kernel time
included), so the shares mean something on a loaded machine; fsync is wall seconds (it
waits on the disk), and the write calls' wall time is printed beside the total.
Shares are of their sum: the time one core spends on the save when nothing overlaps.

Each dtype runs twice in one process: with the work format 1.0 did (every byte plane
through zstd, numpy shuffle, zlib CRC) and as the writer runs now (format 1.1 byte
planes, the native shuffle+CRC op when built).

`--load` also reads the new writer's files back the way the runtime loads a CPU state
(`read_into` straight into preallocated tensors, [Note: decoding into the destination]),
timing pread, CRC, zstd and unshuffle (CPU seconds of all threads).

    python benchmarks/checkpoint_profile.py --params-m 10 [--dtype bf16] [--threads 1] [--load]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import checkpoint_tools.format.writer as writer_mod  # noqa: E402
from checkpoint_tools.format import (  # noqa: E402
    CheckpointReader,
    RankWriter,
    codec,
    files,
    write_manifest,
)
from checkpoint_tools.format.kernels import NumpyKernels  # noqa: E402
from fsdpx.ops.shuffle import checkpoint_kernels  # noqa: E402

_lock = threading.Lock()
seconds: dict[str, float] = defaultdict(float)


def timed(stage: str, fn: Callable[..., Any], *, wall: bool = False) -> Callable[..., Any]:
    clock = time.perf_counter if wall else time.thread_time

    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                seconds[stage] += clock() - t0

    return run


_sampling = threading.local()


def timed_sample(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The sample's own zstd calls count to "sample", not to "zstd"."""
    inner = timed("sample", fn)

    def run(*args: Any, **kwargs: Any) -> Any:
        _sampling.on = True
        try:
            return inner(*args, **kwargs)
        finally:
            _sampling.on = False

    return run


class TimedKernels:
    def __init__(self, inner: Any) -> None:
        self.name = inner.name
        self.shuffle_crc = timed("shuffle+CRC", inner.shuffle_crc)
        self.unshuffle_crc = timed("unshuffle", inner.unshuffle_crc)
        self.crc32 = timed("CRC", inner.crc32)
        self.crc32_combine = timed("CRC", inner.crc32_combine)


class TimedCctx:
    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._timed = timed("zstd", inner.compress)

    def compress(self, data: Any) -> bytes:
        if getattr(_sampling, "on", False):
            return self._inner.compress(data)  # type: ignore[no-any-return]
        return self._timed(data)  # type: ignore[no-any-return]


def level1_everywhere() -> codec.Compressors:
    whole = codec.compressors(1).whole  # one thread's, as the writer asks for them
    return codec.Compressors(whole, whole)


def timed_compressors(inner: codec.Compressors) -> codec.Compressors:
    return codec.Compressors(TimedCctx(inner.planes), TimedCctx(inner.whole))  # type: ignore[arg-type]


class TimedFile:
    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.write = timed("write", timed("write wall", inner.write, wall=True))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@functools.cache
def state(params: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The state `benchmarks/checkpoint.py` saves, in one piece per kind: a stack of 12
    tanh Linear blocks (weights ~N(0, 0.02)) after one AdamW step on a batch of 2, its
    parameters, exp_avg and exp_avg_sq each flattened into one tensor. The moments' byte
    planes differ from the weights' (exp_avg_sq is the square of a gradient), so a
    synthetic stand-in would mis-state what the plane decisions see."""
    layers = 12
    width = max(1, int((params / layers) ** 0.5))
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        fc = torch.nn.Linear(width, width)
        torch.nn.init.normal_(fc.weight, std=0.02)
        blocks += [fc, torch.nn.Tanh()]
    model = torch.nn.Sequential(*blocks).to(dtype)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width, dtype=dtype)).pow(2).mean().backward()
    opt.step()
    ps = list(model.parameters())
    return {
        "model/w": torch.cat([p.detach().reshape(-1) for p in ps]),
        "optim/w/exp_avg": torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in ps]),
        "optim/w/exp_avg_sq": torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in ps]),
    }


def profile(
    params: int, dtype: torch.dtype, threads: int, directory: Path, old: bool
) -> dict[str, Any]:
    seconds.clear()
    tensors = state(params, dtype)
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    real_worth = codec.worth_compressing
    # old: every plane through zstd and the numpy kernels, the work format 1.0's codec 1
    # did (shuffle, then zstd over all of it) before byte-plane coding and the native op
    worth = (lambda raw, size, cctx: [True] * size) if old else real_worth
    codec.worth_compressing = timed_sample(worth)  # type: ignore[assignment]
    real_fsync_file, real_fsync_dir = writer_mod.fsync_file, writer_mod.fsync_dir
    writer_mod.fsync_file = timed("fsync", real_fsync_file, wall=True)  # type: ignore[assignment]
    writer_mod.fsync_dir = timed("fsync", real_fsync_dir, wall=True)  # type: ignore[assignment]
    try:
        # loaded before the clock starts: the first call loads the native library
        kernels = NumpyKernels() if old else checkpoint_kernels()
        t0, c0 = time.perf_counter(), time.process_time()
        w = RankWriter(directory, 0, threads=threads, kernels=TimedKernels(kernels))  # type: ignore[arg-type]
        if old:  # 1.0 compressed whole chunks at zstd's own level-1 parameters
            w._new_compressors = lambda: timed_compressors(level1_everywhere())  # type: ignore[method-assign]
        else:
            real_new = w._new_compressors
            w._new_compressors = lambda: timed_compressors(real_new())  # type: ignore[method-assign]
        w._f = TimedFile(w._f)  # type: ignore[assignment]
        for name, t in tensors.items():
            w.add(name, t, global_shape=t.shape, offsets=(0,))
        info = w.close()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        codec.worth_compressing = real_worth  # type: ignore[assignment]
        writer_mod.fsync_file, writer_mod.fsync_dir = real_fsync_file, real_fsync_dir  # type: ignore[assignment]
    compute = ["sample", "shuffle+CRC", "zstd", "CRC", "write"]
    other = max(cpu - sum(seconds[s] for s in compute), 0.0)
    rows = [*((s, seconds[s]) for s in compute), ("other CPU", other)]
    rows += [("fsync", seconds["fsync"])]
    total = sum(v for _, v in rows)
    print(
        f"{'all planes zstd + numpy (1.0 work)' if old else 'byte planes + native op (1.1)'}: "
        f"{dtype}, {params / 1e6:.0f}M params ({raw / 1e6:.0f} MB raw -> "
        f"{info['data_size'] / 1e6:.0f} MB, {info['data_size'] / raw:.3f}), threads {threads}: "
        f"wall {wall:.2f} s, process CPU {cpu:.2f} s, write wall {seconds['write wall']:.2f} s"
    )
    for s, v in rows:
        print(f"  {s:12s} {v:7.2f} s  {100 * v / total:5.1f}%")
    return info


def load_profile(
    directory: Path, info: dict[str, Any], params: int, dtype: torch.dtype, threads: int
) -> None:
    """Read back what profile() wrote, as the runtime loads a CPU state: straight into
    preallocated tensors (`read_into`, chunks queued across tensors), on `threads`."""
    write_manifest(directory, world_size=1, rank_files=[info], state={})
    seconds.clear()
    outs = {name: torch.empty_like(t) for name, t in state(params, dtype).items()}
    for t in outs.values():
        t.fill_(0)  # first-touch page faults happen here, not in the timed load
    real_stored, real_decompress = files.DataFiles.stored, codec._decompress
    files.DataFiles.stored = timed("pread+CRC", real_stored)  # type: ignore[method-assign]
    codec._decompress = timed("zstd", real_decompress)  # type: ignore[assignment]
    try:
        kernels = TimedKernels(checkpoint_kernels())
        t0, c0 = time.perf_counter(), time.process_time()
        with CheckpointReader(directory, kernels=kernels, threads=threads) as r:  # type: ignore[arg-type]
            for name, out in outs.items():
                r.read_into(name, out, wait=False)
            r.wait()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        files.DataFiles.stored, codec._decompress = real_stored, real_decompress  # type: ignore[method-assign,assignment]
    pread = seconds["pread+CRC"] - seconds["CRC"]  # the CRC runs inside stored()
    rows = [("pread", pread), ("CRC", seconds["CRC"]), ("zstd", seconds["zstd"])]
    rows += [("unshuffle", seconds["unshuffle"])]
    rows += [("other CPU", max(cpu - sum(v for _, v in rows), 0.0))]
    total = sum(v for _, v in rows)
    print(f"load (read_into, threads {threads}): wall {wall:.2f} s, process CPU {cpu:.2f} s")
    for stage, v in rows:
        print(f"  {stage:12s} {v:7.2f} s  {100 * v / total:5.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params-m", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=("fp32", "bf16", "both"), default="both")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--load", action="store_true", help="also profile reading it back")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f} (shared)")
    dtypes = {"fp32": [torch.float32], "bf16": [torch.bfloat16]}.get(
        args.dtype, [torch.float32, torch.bfloat16]
    )
    for dtype in dtypes:
        for old in (True, False):
            with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                params = int(args.params_m * 1e6)
                info = profile(params, dtype, args.threads, Path(tmp), old)
                if args.load and not old:
                    load_profile(Path(tmp), info, params, dtype, args.threads)


if __name__ == "__main__":
    main()
