"""Assembling rectangles from verified chunk frames: the data path of CheckpointReader
(which pieces to read is reader.py's business; this module decodes them into the output).

[Note: decoding into the destination]
A load used to decode each tensor into a fresh output (`read`), then copy it into the
model's shard: for a 3.6 GB state on one rank that is 3.6 GB of first-touch page faults
(outputs above the allocator's mmap threshold are fresh pages every time) plus a 3.6 GB
copy, both on the main thread while the decode threads waited for it, and at every
tensor's end the threads drained. `read_into(name, out, wait=False)` decodes the chunks
that lie whole in the rectangle straight into `out` (the shard's own memory) on the
worker threads and returns; the loader queues every tensor this way and waits once at
the end, so the threads never drain between tensors and the main thread does nothing
but queue. Only the rectangle's edge chunks go through the one-chunk cache (on the
calling thread); a contiguous rectangle is one span (slabs would cut a chunk at every
slab boundary). Nothing about checking changes: every frame's CRC is checked before it
is decoded, and an error is raised by `wait()`, after which `out` may hold part of the
data (the loader then says the state is partly overwritten, as for any failed load).
Measured at 100M fp32 parameters, 1 rank x 2 threads, load average 20-26: load CPU
1.17-1.24 -> 0.91-0.99 s, the main
thread's share 0.38 -> 0.02 s (README, Measured).
"""

from __future__ import annotations

import bisect
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from checkpoint_tools.format import codec, parts
from checkpoint_tools.format.coverage import Box, c_strides, intersect, numel
from checkpoint_tools.format.files import DataFiles
from checkpoint_tools.format.kernels import Kernels
from checkpoint_tools.format.layout import itemsize
from checkpoint_tools.format.routing import choose
from checkpoint_tools.format.schema import Chunk, Piece, RankFile, TensorMeta

# A read is assembled in slabs of at most this many bytes per piece, so reading a large
# rectangle costs its output plus one slab, not output plus a full copy of each piece.
SLAB_BYTES = 16 << 20


def check_destination(name: str, out: object, dtype: torch.dtype) -> None:
    """Refuse an output `read_into` cannot decode into in place.

    Raises:
        ValueError: `out` is not a contiguous CPU tensor of `dtype` without grad.
    """
    if (
        isinstance(out, torch.Tensor)
        and out.device.type == "cpu"
        and out.dtype == dtype
        and out.is_contiguous()
        and not out.requires_grad
    ):
        return
    found = (
        f"{out.dtype} on {out.device}, contiguous={out.is_contiguous()}, "
        f"requires_grad={out.requires_grad}"
        if isinstance(out, torch.Tensor)
        else type(out).__name__
    )
    raise ValueError(
        f"read_into({name!r}) needs a contiguous CPU tensor of dtype {dtype} that does not "
        f"require grad; got {found}. Pass a detached contiguous CPU tensor, or use read() "
        "and copy"
    )


class ChunkAssembler:
    """Decodes chunks (in parallel on `threads`) into rectangles of an output tensor."""

    directory: Path
    kernels: Kernels
    threads: int
    prefer_rank: int | None
    absent_ranks: list[int]
    state: dict[str, Any]
    rank_files: list[RankFile]
    _data: DataFiles
    _local: threading.local
    _pool: ThreadPoolExecutor | None
    _pending: list[Future[None]]
    _cache: tuple[tuple[str, int, int], np.ndarray] | None

    def _scratch(self, key: str, nbytes: int) -> np.ndarray:
        """A reusable uint8 buffer of at least `nbytes`. Reusing buffers matters: fresh
        multi-MiB allocations are mmapped by the allocator, and first-touch page faults
        cost more than decoding (measured: 2x slower consolidation)."""
        bufs: dict[str, np.ndarray] | None = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = {}  # one set per thread: worker threads decode at once
        buf = bufs.get(key)
        if buf is None or len(buf) < nbytes:
            buf = np.empty(max(nbytes, 1), dtype=np.uint8)
            bufs[key] = buf
        return buf[:nbytes]

    def _stored(self, rf: RankFile, chunk: Chunk, name: str) -> memoryview:
        buf = self._scratch("stored", chunk.stored_size)
        return self._data.stored(rf, chunk, name, buf, self.kernels.crc32)

    def _decode(self, meta: TensorMeta, piece: Piece, k: int, dst: np.ndarray) -> None:
        chunk = piece.chunks[k]
        rf = self.rank_files[piece.rank]
        codec.decode_into(
            self._stored(rf, chunk, meta.name),
            chunk.codec,
            itemsize(meta.dtype),
            dst,
            self._scratch("planes", chunk.raw_size),
            kernels=self.kernels,
            expected_crc=None,  # _stored checked it
            path=self.directory / rf.data_file,
            tensor=meta.name,
            offset=chunk.offset,
        )

    def _fill(self, meta: TensorMeta, want: Box, out: torch.Tensor, defer: bool = False) -> None:
        """Copy the rectangle `want` of `meta` into `out` (contiguous, shape want[1]).
        `defer`: chunks that decode whole into `out` may still be decoding on return
        (`wait()` collects them)."""
        if self.absent_ranks:  # present_only: is the rectangle in the files here?
            parts.check_present(meta, want, self.absent_ranks, self.directory, self.state)
        by_rank = {p.rank: p for p in meta.pieces}
        for rank, box in choose(
            [(p.rank, (p.offsets, p.shape)) for p in meta.pieces], want, self.prefer_rank
        ):
            piece = by_rank[rank]
            inter = intersect(box, want)
            if inter is None:
                continue
            self._copy(meta, piece, inter, want, out, defer)

    def _copy(
        self,
        meta: TensorMeta,
        piece: Piece,
        inter: Box,
        want: Box,
        out: torch.Tensor,
        defer: bool = False,
    ) -> None:
        """Copy `inter` (global coordinates) from `piece` into `out`. When the rows are
        contiguous in both the piece and `out` (whole trailing dims: row shards, blocks),
        chunks decode straight into `out`, all rows as one span; else slab by slab along
        the first dim through a scratch span, so the bytes decoded at once stay near
        SLAB_BYTES ([Note: decoding into the destination])."""
        size = itemsize(meta.dtype)
        if not inter[1]:  # 0-d
            self._span(meta, piece, 0, 1, out.reshape(1).view(torch.uint8).numpy())
            return
        strides = c_strides(piece.shape)
        lo = [i - p for i, p in zip(inter[0], piece.offsets, strict=True)]
        dst_lo = [i - w for i, w in zip(inter[0], want[0], strict=True)]
        shp = list(inter[1])
        row = numel(shp[1:]) * size
        direct = shp[1:] == list(piece.shape[1:]) == list(want[1][1:])
        flat_out = out.reshape(-1).view(torch.uint8).numpy() if direct else None
        # Direct: one span, so only the rectangle's two edge chunks can be partial (slabs
        # would split a chunk at every slab boundary and decode it through the cache).
        rows = shp[0] if direct else max(1, SLAB_BYTES // max(row, 1))
        for r0 in range(0, shp[0], rows):
            n = min(rows, shp[0] - r0)
            start = [lo[0] + r0, *lo[1:]]
            first = sum(i * s for i, s in zip(start, strides, strict=True))
            if flat_out is not None:
                at = (dst_lo[0] + r0) * row
                span = flat_out[at : at + n * row]
                self._span(meta, piece, first, n * row // size, span, defer)
                continue
            last = first + sum((x - 1) * s for x, s in zip([n, *shp[1:]], strides, strict=True))
            count = last + 1 - first
            span = self._span(meta, piece, first, count, self._scratch("span", count * size))
            src = torch.from_numpy(span).view(meta.dtype).as_strided([n, *shp[1:]], strides)
            index = tuple(
                slice(d + r0, d + r0 + n) if k == 0 else slice(d, d + x)
                for k, (d, x) in enumerate(zip(dst_lo, shp, strict=True))
            )
            out[index].copy_(src)

    def _span(
        self,
        meta: TensorMeta,
        piece: Piece,
        first: int,
        count: int,
        dst: np.ndarray,
        defer: bool = False,
    ) -> np.ndarray:
        """Decode elements [first, first+count) of `piece` (C order) into `dst` (uint8);
        with `defer`, whole chunks may still be decoding on return."""
        size = itemsize(meta.dtype)
        begin, end = first * size, (first + count) * size
        k = max(0, bisect.bisect_right(piece.starts, begin) - 1)
        whole: list[tuple[int, np.ndarray]] = []
        while k < len(piece.chunks) and piece.starts[k] < end:
            cstart = piece.starts[k]
            cend = cstart + piece.chunks[k].raw_size
            if begin <= cstart and cend <= end:
                whole.append((k, dst[cstart - begin : cend - begin]))
            else:
                cached = self._cached(meta, piece, k)
                a, b = max(begin, cstart), min(end, cend)
                dst[a - begin : b - begin] = cached[a - cstart : b - cstart]
            k += 1
        self._decode_all(meta, piece, whole, defer)
        return dst

    def _decode_all(
        self,
        meta: TensorMeta,
        piece: Piece,
        jobs: list[tuple[int, np.ndarray]],
        defer: bool = False,
    ) -> None:
        """[Note: parallel reads] Whole chunks decode straight into disjoint slices of the
        output, so they are independent: with `threads` > 1 each worker reads (pread) and
        decodes its own chunks into its own scratch buffers (zstd, zlib, numpy and the
        native kernels release the GIL), so reading one chunk overlaps decoding another.
        Memory: per thread one stored and one planes buffer of a chunk. Partial chunks
        (the edges of a rectangle) go through the shared one-chunk cache on the calling
        thread. With `defer` the futures go to `_pending` instead of being waited for
        ([Note: decoding into the destination])."""
        if self.threads == 1 or (len(jobs) < 2 and not defer):
            for k, out in jobs:
                self._decode(meta, piece, k, out)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-read")
        futures = [self._pool.submit(self._decode, meta, piece, k, out) for k, out in jobs]
        if defer:  # read_into(wait=False): wait() collects them
            self._pending.extend(futures)
            return
        for f in futures:
            f.result()

    def wait(self) -> None:
        """Wait for every chunk of the reads started with `read_into(..., wait=False)`;
        raises the first error among them (after all have finished, so no worker still
        writes into an output when this returns)."""
        pending, self._pending = self._pending, []
        error: BaseException | None = None
        for f in pending:
            exc = f.exception()
            if exc is not None and error is None:
                error = exc
        if error is not None:
            raise error

    def _cached(self, meta: TensorMeta, piece: Piece, k: int) -> np.ndarray:
        """A whole decoded chunk, kept until the next partial chunk is needed: slabs and
        blocks that split a chunk decode it once."""
        key = (meta.name, piece.rank, k)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        whole = self._scratch("cached", piece.chunks[k].raw_size)
        self._cache = None
        self._decode(meta, piece, k, whole)
        self._cache = (key, whole)
        return whole
