"""Checkpoint codec micro-benchmarks, one process, side by side in one run:

* kernels: numpy + zlib (the `checkpoint_tools` default) vs the native one-pass
  shuffle+CRC (`fsdpx.ops.shuffle`), MB/s of raw chunk bytes;
* encode / decode of whole 4 MiB chunks (1.0's codec 1 vs 1.1's byte planes), bytes ratio;
* GIL: the same encode work on 1 thread and on 2 threads (a ratio near 2 means the codec
  calls really run in parallel), next to a pure-Python control that holds the GIL;
* index reading: what opening a checkpoint and locating one rank's pieces costs with a
  synthetic 1,024-rank index (`--ranks`, `--pieces` per rank), when every index is read
  (format 1.1) and with the 1.2 tensor table (`--only index` runs just this part;
  `--only gil` just the GIL check, which also decodes chunks as the reader threads do).

    python benchmarks/checkpoint_codec.py            # ~1 min on 2 busy cores
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from checkpoint_tools.format import CheckpointReader, codec, write_manifest  # noqa: E402
from checkpoint_tools.format.kernels import Kernels, NumpyKernels  # noqa: E402
from checkpoint_tools.format.layout import (  # noqa: E402
    DATA_HEADER,
    INDEX_MAGIC,
    pack_container,
)
from fsdpx.ops.shuffle import checkpoint_kernels  # noqa: E402


def best(fn: Callable[[], object], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def trained_like(n: int, dtype: torch.dtype) -> np.ndarray:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(n, generator=g) * 0.02).to(dtype).view(torch.uint8).numpy()


def kernels_table(chunk: int) -> None:
    native, ref = checkpoint_kernels(), NumpyKernels()
    raw = trained_like(chunk // 4, torch.float32)
    out = np.empty_like(raw)
    mb = len(raw) / 1e6
    print(f"kernels ({native.name} vs numpy), 4 MiB fp32 chunk, MB/s (best of 5):")
    dst = np.empty_like(raw)
    q = len(raw) // 4
    planes = [out[i * q : (i + 1) * q] for i in range(4)]
    jobs: list[tuple[str, Callable[[Kernels], object]]] = [
        ("shuffle+CRC all planes", lambda k: k.shuffle_crc(raw, 4, out, [True] * 4)),
        ("unshuffle+CRC all planes", lambda k: k.unshuffle_crc(planes, dst, True)),
        ("CRC-32", lambda k: k.crc32(raw)),
    ]
    for label, fn in jobs:
        n = best(functools.partial(fn, native))
        r = best(functools.partial(fn, ref))
        print(f"  {label:26s} native {mb / n:8.0f}  numpy {mb / r:8.0f}  ratio {r / n:5.2f}x")


def chunk_table(chunk: int, level: int) -> None:
    cctx = codec.compressors(level)  # what the writer uses ([Note: plane compressor])
    print(f"one chunk of {chunk >> 20} MiB, zstd level {level}: ms (best of 5), stored/raw")
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        _chunk_row(trained_like(chunk // size, dtype), dtype, size, cctx)


def _chunk_row(raw: np.ndarray, dtype: torch.dtype, size: int, cctx: codec.Compressors) -> None:
    scratch, dst = np.empty_like(raw), np.empty_like(raw)

    def old() -> bytes:  # format 1.0: shuffle, zstd over the whole chunk, CRC
        NumpyKernels().shuffle_crc(raw, size, scratch, [False] * size)
        frame = cctx.whole.compress(scratch.data)  # zstd's own level parameters, as 1.0
        zlib.crc32(frame)
        return frame

    t_old = best(old)
    ratio_old = len(old()) / len(raw)
    for k in (NumpyKernels(), checkpoint_kernels()):
        enc = codec.encode(raw, size, cctx, k, scratch)
        t_new = best(functools.partial(codec.encode, raw, size, cctx, k, scratch))
        stored = memoryview(b"".join(bytes(p) for p in enc.parts))

        def decode(k: Kernels = k, enc: codec.Encoded = enc, stored: memoryview = stored) -> None:
            codec.decode_into(
                stored,
                enc.codec,
                size,
                dst,
                scratch,
                kernels=k,
                expected_crc=enc.crc,
                path=Path("x"),
                tensor="x",
                offset=0,
            )

        t_dec = best(decode)
        print(
            f"  {str(dtype):15s} 1.0 encode {t_old * 1e3:6.1f} ({ratio_old:.3f})  "
            f"1.1 {k.name:6s} encode {t_new * 1e3:6.1f} ({enc.size / len(raw):.3f}) "
            f"decode {t_dec * 1e3:6.1f}"
        )


def gil_table(chunk: int, level: int, jobs: int) -> None:
    native = checkpoint_kernels()
    raw = trained_like(chunk // 4, torch.float32)

    def encode_work() -> None:
        cctx = codec.compressors(level)
        scratch = np.empty_like(raw)
        for _ in range(jobs):
            codec.encode(raw, 4, cctx, native, scratch)

    enc = codec.encode(raw, 4, codec.compressors(level), native, np.empty_like(raw))
    stored = memoryview(b"".join(bytes(p) for p in enc.parts))

    def decode_work() -> None:  # what a load's reader threads run: CRC, zstd, unshuffle
        dst, planes = np.empty_like(raw), np.empty_like(raw)
        for _ in range(jobs):
            codec.decode_into(
                stored,
                enc.codec,
                4,
                dst,
                planes,
                kernels=native,
                expected_crc=enc.crc,
                path=Path("x"),
                tensor="x",
                offset=0,
            )

    def python_work() -> None:  # holds the GIL: the control
        x = 0
        for i in range(3_000_000):
            x += i

    print(
        f"GIL: {jobs} chunk encodes (decodes) per thread, 2 threads at once; process CPU "
        "seconds / wall "
        "seconds (above 1.0 only if both threads ran at the same time; a busy machine lowers "
        "both rows alike):"
    )
    for label, work in (
        ("encode (1.1, native)", encode_work),
        ("decode (1.1, native)", decode_work),
        ("pure Python (control)", python_work),
    ):
        ratios = []
        for _ in range(3):
            ts = [threading.Thread(target=work) for _ in range(2)]
            t0, c0 = time.perf_counter(), time.process_time()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            ratios.append((time.process_time() - c0) / (time.perf_counter() - t0))
        print(f"  {label:22s} CPU/wall {max(ratios):4.2f} (best of 3; 2.00 = fully parallel)")


def synthetic_index(d: Path, ranks: int, pieces: int, *, table: bool, distinct: bool) -> float:
    """`ranks` index files of `pieces` row-split tensors each (4 chunks per piece, no data
    files) and a MANIFEST with or without the 1.2 tensor table; `distinct` gives every
    tensor its own row count, so no two share a layout (the table's worst case). Returns
    the CPU seconds write_manifest took (what rank 0 adds to a save)."""
    infos = []
    for r in range(ranks):
        body_pieces, summary = [], []
        for p in range(pieces):
            rows = 4096 + (p if distinct else 0)
            gshape, offs, shape = [rows * ranks, 1024], [rows * r, 0], [rows, 1024]
            name = f"model/layer{p}.weight"
            raw = [4 << 20] * 3 + [rows * 1024 * 4 - (12 << 20)]  # the piece's bytes
            chunks = [
                [DATA_HEADER.size + (p * 4 + c) * (8 << 20), 3 << 20, raw[c], 0, 2]
                for c in range(4)
            ]
            body_pieces.append(
                {
                    "name": name,
                    "dtype": "F32",
                    "global_shape": gshape,
                    "offsets": offs,
                    "shape": shape,
                    "chunks": chunks,
                }
            )
            summary.append([name, "F32", gshape, offs, shape])
        body = {
            "rank": r,
            "file_id": bytes(16),
            "data_file": f"rank-{r:05d}.data",
            "data_size": 1 << 40,
            "compression": "zstd",
            "chunk_bytes": 4 << 20,
            "pieces": body_pieces,
        }
        blob = pack_container(INDEX_MAGIC, msgpack.packb(body, use_bin_type=True))
        (d / f"rank-{r:05d}.index").write_bytes(blob)
        (d / f"rank-{r:05d}.data").touch()  # present (readers check), never read here
        infos.append(
            {
                "rank": r,
                "index_file": f"rank-{r:05d}.index",
                "index_size": len(blob),
                "index_crc32": zlib.crc32(blob),
                "data_file": f"rank-{r:05d}.data",
                "data_size": 1 << 40,
                "file_id": bytes(16),
                "pieces": summary,
            }
        )
    t0 = time.process_time()
    write_manifest(d, world_size=ranks, rank_files=infos, state={}, tensor_table=table)
    return time.process_time() - t0


def open_and_plan(d: Path, rank: int) -> tuple[float, float, int, int]:
    """What loading rank `rank` does before reading data at the saved world size: open
    the checkpoint and find the pieces of its rows of every tensor. Returns (wall
    seconds, CPU seconds, index files read, their bytes)."""
    t0, c0 = time.perf_counter(), time.process_time()
    with CheckpointReader(d, prefer_rank=rank) as r:
        ranks = r.world_size
        for name in r.names():
            info = r.info(name)
            rows = info.shape[0] // ranks
            r.pieces_for(name, (rows * rank, 0), (rows, info.shape[1]))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return wall, cpu, r.index_reads, r.index_bytes


def index_table(ranks: int, pieces: int) -> None:
    """[Note: tensor table]: a loading rank's cost to open the checkpoint and locate its
    pieces, before (MANIFEST without the table: every index read at open, as in format
    1.1) and after (1.2: the table, then only the indexes holding its pieces)."""
    for label, table, distinct in [
        ("1.1 MANIFEST (every index)", False, False),
        ("1.2 table, shared layouts", True, False),
        ("1.2 table, a layout per tensor", True, True),
    ]:
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            build = synthetic_index(d, ranks, pieces, table=table, distinct=distinct)
            indexes = sum(f.stat().st_size for f in d.glob("*.index"))
            manifest = (d / "MANIFEST").stat().st_size
            wall, cpu, reads, nbytes = open_and_plan(d, ranks // 3)
            print(
                f"index: {ranks} ranks x {pieces} pieces x 4 chunks ({indexes / 1e6:.1f} MB of "
                f"indexes), {label}: MANIFEST {manifest / 1e6:.2f} MB written in {build:.2f} "
                f"CPU s; a rank opens and plans its reads in {wall:.2f} s ({cpu:.2f} CPU s), "
                f"reading {reads} index files ({nbytes / 1e6:.2f} MB)",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunk-mib", type=int, default=4)
    ap.add_argument("--level", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--pieces", type=int, default=100)
    ap.add_argument("--only", choices=["index", "gil"], help="run only this part")
    args = ap.parse_args()
    torch.set_num_threads(1)
    chunk = args.chunk_mib << 20
    print(f"machine: {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f} (shared)")
    if args.only == "index":
        index_table(args.ranks, args.pieces)
        return
    if args.only == "gil":
        gil_table(chunk, args.level, args.jobs)
        return
    kernels_table(chunk)
    chunk_table(chunk, args.level)
    gil_table(chunk, args.level, args.jobs)
    index_table(args.ranks, args.pieces)


if __name__ == "__main__":
    main()
