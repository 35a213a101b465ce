"""fsdpx.ops.aio read/write throughput against ``dd`` on the same file system, and the
quantization kernels' throughput against their pure-PyTorch references.

Run from the repository root::

    python benchmarks/ops_aio.py                       # 1 GiB file under /tmp, 3 repeats
    python benchmarks/ops_aio.py --dir /nvme --size-mb 4096 --repeats 5
    python benchmarks/ops_aio.py --size-mb 64 --repeats 1 --quant-mb 16   # quick check

``main(argv)`` returns the measured numbers as a dict, so benchmarks/ops.py can call it.

Method (aio vs dd, one file of ``--size-mb`` in ``--dir``, each measurement repeated and the
best kept; the two sides alternate so that noise hits both):

* **write**: ``dd if=/dev/zero of=F bs=8M count=N conv=fdatasync`` (buffered writes, then one
  fdatasync) vs ``AioPool.write(F, buf, fsync=True)`` from a 4 KiB-aligned buffer
  (``aligned_empty``) with O_DIRECT, also followed by fdatasync; both timed to durability.
  The file is deleted before each write so neither side overwrites allocated blocks.
* **read**: page-cache state decides read speed, and dropping the caches
  (``/proc/sys/vm/drop_caches``) needs root on the host and would disturb everyone else on a
  shared machine. So both sides read with O_DIRECT, which bypasses the cache:
  ``dd if=F of=/dev/null bs=8M iflag=direct`` vs ``AioPool.read(F, buf)`` with O_DIRECT into
  an aligned buffer. A second, "cached" line reads buffered from the page cache on both
  sides (``dd`` without iflag vs ``o_direct=False``): memory-copy speed, not the disk.

GB/s are 1e9 bytes per second. The ratio is aio / dd (goal >= 0.8). ``dd`` prints its own
rate, but we time the ``dd`` process from outside like the aio call (process start-up is
~1 ms, noise at these sizes).

Quantization: ``--quant-mb`` of float32 (block size 2048) through the native op and the
reference; GB/s counts bytes read plus bytes written (float32 in, 1 byte (int4: half a
byte) + scales out). ``accumulate_*`` is qgZ's fused ``acc += dequantize(q)`` (float32 acc
read and written, the payload read) against the reference's dequantize-then-add.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fsdpx.ops import quant, quant_int4
from fsdpx.ops._loader import load_ops
from fsdpx.ops.aio import AioPool, aligned_empty

DD_BLOCK = 8 << 20


def _best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _dd(*args: str) -> None:
    subprocess.run(["dd", *args, "status=none"], check=True)


def bench_aio(
    directory: Path, size_mb: int, repeats: int, threads: int, chunk_mb: int
) -> dict[str, float]:
    """aio and dd GB/s for durable writes, O_DIRECT reads and page-cache reads."""
    size = size_mb << 20
    count = max(1, size // DD_BLOCK)
    size = count * DD_BLOCK  # the same byte count on both sides
    path = directory / "fsdpx-aio-bench.bin"
    buf = aligned_empty((size,))
    buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    direct = AioPool(
        threads=threads, queue_depth=4, chunk_bytes=chunk_mb << 20, o_direct=True, backend="native"
    )
    buffered = AioPool(
        threads=threads, queue_depth=4, chunk_bytes=chunk_mb << 20, o_direct=False, backend="native"
    )

    def aio_write() -> None:
        path.unlink(missing_ok=True)
        direct.write(path, buf, 0, fsync=True).wait()

    def dd_write() -> None:
        path.unlink(missing_ok=True)
        _dd("if=/dev/zero", f"of={path}", f"bs={DD_BLOCK}", f"count={count}", "conv=fdatasync")

    results: dict[str, list[float]] = {
        k: [] for k in ("write_aio", "write_dd", "read_aio", "read_dd", "cached_aio", "cached_dd")
    }
    try:
        for r in range(repeats):
            # Alternate which side goes first so drift (other load, disk state) is shared.
            pairs: list[tuple[str, Callable[[], object]]] = [
                ("write_aio", aio_write),
                ("write_dd", dd_write),
            ]
            for key, fn in pairs if r % 2 == 0 else reversed(pairs):
                results[key].append(_best(fn, 1))
            reads: list[tuple[str, Callable[[], object]]] = [
                ("read_aio", lambda: direct.read(path, buf, 0).wait()),
                (
                    "read_dd",
                    lambda: _dd(f"if={path}", "of=/dev/null", f"bs={DD_BLOCK}", "iflag=direct"),
                ),
                ("cached_aio", lambda: buffered.read(path, buf, 0).wait()),
                ("cached_dd", lambda: _dd(f"if={path}", "of=/dev/null", f"bs={DD_BLOCK}")),
            ]
            for key, fn in reads if r % 2 == 0 else reversed(reads):
                results[key].append(_best(fn, 1))
        stats = direct.stats()
    finally:
        direct.close()
        buffered.close()
        path.unlink(missing_ok=True)
    gbps = {k: size / min(v) / 1e9 for k, v in results.items()}
    gbps["bytes"] = float(size)
    gbps["direct_bytes"], gbps["bounce_bytes"], gbps["buffered_bytes"] = map(float, stats)
    return gbps


def bench_quant(size_mb: int, repeats: int, block_size: int = 2048) -> dict[str, float]:
    """Native vs reference GB/s for each (de)quantize op on float32 data."""
    n = (size_mb << 20) // 4
    x = torch.randn(n)
    out: dict[str, float] = {}
    cases = [
        (
            "int8",
            quant.quantize_int8,
            quant.quantize_int8_reference,
            quant.dequantize_int8,
            quant.dequantize_int8_reference,
        ),
        (
            "fp8",
            quant.quantize_fp8,
            quant.quantize_fp8_reference,
            quant.dequantize_fp8,
            quant.dequantize_fp8_reference,
        ),
    ]
    scales = (n // block_size) * 4
    moved = n * 4 + n + scales  # fp32 in, 1 byte + scales out (and back)
    for name, q_native, q_ref, dq_native, dq_ref in cases:
        q, s = q_native(x, block_size=block_size)
        for side, qf, dqf in (("native", q_native, dq_native), ("reference", q_ref, dq_ref)):
            t_q = _best(functools.partial(qf, x, block_size=block_size), repeats)
            t_dq = _best(functools.partial(dqf, q, s, block_size=block_size), repeats)
            out[f"quantize_{name}_{side}"] = moved / t_q / 1e9
            out[f"dequantize_{name}_{side}"] = moved / t_dq / 1e9
    q4 = quant_int4
    p, s4 = q4.quantize_int4(x, block_size=block_size)
    moved4 = n * 4 + n // 2 + scales
    for side, qf4, dqf4 in (
        ("native", q4.quantize_int4, q4.dequantize_int4),
        ("reference", q4.quantize_int4_reference, q4.dequantize_int4_reference),
    ):
        t_q = _best(functools.partial(qf4, x, block_size=block_size), repeats)
        t_dq = _best(functools.partial(dqf4, p, s4, numel=n, block_size=block_size), repeats)
        out[f"quantize_int4_{side}"] = moved4 / t_q / 1e9
        out[f"dequantize_int4_{side}"] = moved4 / t_dq / 1e9
    q8, s8 = quant.quantize_int8(x, block_size=block_size)
    acc = torch.zeros(n)
    for side, a8, a4 in (
        ("native", quant.dequantize_accumulate_int8, q4.dequantize_accumulate_int4),
        (
            "reference",
            quant.dequantize_accumulate_int8_reference,
            q4.dequantize_accumulate_int4_reference,
        ),
    ):
        t8 = _best(functools.partial(a8, acc, q8, s8, block_size=block_size), repeats)
        t4 = _best(functools.partial(a4, acc, p, s4, block_size=block_size), repeats)
        out[f"accumulate_int8_{side}"] = (n * 8 + n + scales) / t8 / 1e9
        out[f"accumulate_int4_{side}"] = (n * 8 + n // 2 + scales) / t4 / 1e9
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run both benchmarks, print a table, return the numbers (GB/s and ratios).

    Args:
        argv: command-line arguments (see ``--help``); None reads sys.argv.

    Returns:
        Flat dict: ``write_aio``, ``write_dd``, ``read_aio``, ... in GB/s, ``ratio_*``
        (aio / dd, native / reference).

    Example:
        >>> main(["--size-mb", "64", "--repeats", "1", "--quant-mb", "8"])
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="directory on the file system to test (default: the temp dir)",
    )
    parser.add_argument("--size-mb", type=int, default=1024, help="file size in MiB")
    parser.add_argument("--repeats", type=int, default=3, help="repeats; the best is kept")
    parser.add_argument("--threads", type=int, default=4, help="aio threads")
    parser.add_argument("--chunk-mb", type=int, default=8, help="aio chunk size in MiB")
    parser.add_argument("--quant-mb", type=int, default=256, help="float32 MiB to quantize")
    parser.add_argument(
        "--quant-threads",
        type=int,
        default=1,
        help="torch threads for the quantization part (1: per-core numbers, stable on a "
        "shared machine)",
    )
    args = parser.parse_args(argv)
    status = load_ops()
    if not status.available:
        raise SystemExit(f"the native fsdpx ops are unavailable: {status.reason}")
    if shutil.which("dd") is None:
        raise SystemExit("dd not found; install coreutils")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs; directory {args.dir}"
    )
    res = bench_aio(args.dir, args.size_mb, args.repeats, args.threads, args.chunk_mb)
    print(f"\naio vs dd, {res['bytes'] / 2**20:.0f} MiB file, best of {args.repeats} (GB/s)")
    print(f"{'':32s}{'aio':>8s}{'dd':>8s}{'aio/dd':>8s}")
    for key, label in (
        ("write", "write + fdatasync (O_DIRECT)"),
        ("read", "read, O_DIRECT both"),
        ("cached", "read, page cache both"),
    ):
        res[f"ratio_{key}"] = res[f"{key}_aio"] / res[f"{key}_dd"]
        print(
            f"{label:32s}{res[f'{key}_aio']:8.2f}{res[f'{key}_dd']:8.2f}{res[f'ratio_{key}']:8.2f}"
        )
    print(
        f"aio bytes: {res['direct_bytes']:.0f} O_DIRECT ({res['bounce_bytes']:.0f} via "
        f"bounce buffer), {res['buffered_bytes']:.0f} buffered"
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(args.quant_threads)
    try:
        q = bench_quant(args.quant_mb, args.repeats)
    finally:
        torch.set_num_threads(threads)
    print(
        f"\nquantization, {args.quant_mb} MiB float32, block 2048, {args.quant_threads} "
        "thread(s) (GB/s moved)"
    )
    print(f"{'':20s}{'native':>8s}{'ref':>8s}{'ratio':>8s}")
    timed = [k.removesuffix("_native") for k in q if k.endswith("_native")]  # in order
    for op in timed:
        q[f"ratio_{op}"] = q[f"{op}_native"] / q[f"{op}_reference"]
        print(f"{op:20s}{q[f'{op}_native']:8.2f}{q[f'{op}_reference']:8.2f}{q[f'ratio_{op}']:8.2f}")
    return {**res, **q}


if __name__ == "__main__":
    main()
