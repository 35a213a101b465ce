"""Reading a checkpoint: validate MANIFEST and indexes up front, then read any rectangle
of any tensor, touching only the chunks that hold it.

Files are opened only by their canonical names inside the checkpoint directory (see
files.py). Nothing is unpickled; nothing is executed.
"""

from __future__ import annotations

import bisect
import os
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from checkpoint_tools.format import codec, parts
from checkpoint_tools.format.coverage import Box, blocks, c_strides, intersect, numel, uncovered
from checkpoint_tools.format.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
)
from checkpoint_tools.format.files import DataFiles, read_whole
from checkpoint_tools.format.kernels import DEFAULT_KERNELS, Kernels
from checkpoint_tools.format.layout import (
    CONTAINER_HEADER,
    INDEX_MAGIC,
    MANIFEST_MAGIC,
    MANIFEST_NAME,
    MAX_INDEX_BYTES,
    MAX_MANIFEST_BYTES,
    itemsize,
    unpack_container,
)
from checkpoint_tools.format.schema import (
    Chunk,
    Piece,
    RankFile,
    TensorMeta,
    parse_index,
    parse_manifest,
)

# A read is assembled in slabs of at most this many bytes per piece, so reading a large
# rectangle costs its output plus one slab, not output plus a full copy of each piece.
SLAB_BYTES = 16 << 20


class CheckpointReader:
    """Random access to a checkpoint directory (one tag, not the root with `latest`).

    Args:
        directory: the checkpoint directory holding MANIFEST and rank-NNNNN.* files.
        kernels: shuffle / CRC kernels ([Note: codec injection]); numpy + zlib by default.
        threads: threads that read and decode the whole chunks of one read in parallel
            ([Note: parallel reads]); 1 reads on the calling thread.
        present_only: read a directory that holds only some ranks' files (one node's
            part of a node-local checkpoint, FORMAT.md §2.2): the others' files are
            skipped, and a read whose rectangle is not in the files here raises
            CheckpointNotFoundError. False: such a directory is refused up front.

    Raises:
        CheckpointNotFoundError: no directory or no MANIFEST (an unfinished checkpoint).
        CheckpointError subtypes: anything invalid in MANIFEST or an index.

    Example::

        with CheckpointReader("ckpt/global_step100") as r:
            w = r.read("model/fc.weight")                      # whole tensor
            top = r.read("model/fc.weight", (0, 0), (2, 4))    # a rectangle of it
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        kernels: Kernels | None = None,
        threads: int = 1,
        present_only: bool = False,
    ) -> None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive int; got {threads!r}")
        self.directory = Path(directory)
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self.kernels = kernels if kernels is not None else DEFAULT_KERNELS
        if not self.directory.is_dir():
            raise CheckpointNotFoundError(
                "checkpoint directory does not exist", path=self.directory
            )
        mpath = self.directory / MANIFEST_NAME
        if not os.path.lexists(mpath):
            raise CheckpointNotFoundError(
                "no MANIFEST: the checkpoint is incomplete (its writer did not finish) or "
                "this is not a checkpoint directory; load an older checkpoint",
                path=mpath,
            )
        raw = read_whole(self.directory, MANIFEST_NAME, MAX_MANIFEST_BYTES)
        body = unpack_container(mpath, raw, MANIFEST_MAGIC, MAX_MANIFEST_BYTES)
        self.world_size, self.rank_files, self.state = parse_manifest(body, mpath)
        _, major, minor, _, _ = CONTAINER_HEADER.unpack_from(raw)
        self.format_version: tuple[int, int] = (major, minor)
        self.writer: str = str(body.get("writer", "unknown"))
        self._data = DataFiles(self.directory)
        self._cache: tuple[tuple[str, int, int], np.ndarray] | None = None
        self._turn = 0
        missing = parts.missing_files(self.directory, self.rank_files)
        self.absent_ranks = parts.absent_ranks(self.rank_files, missing)
        if missing and not present_only:
            raise CheckpointNotFoundError(
                parts.missing_message(
                    self.directory, self.world_size, missing, self.absent_ranks, self.state
                )
            )
        grouped: dict[str, list[tuple[torch.dtype, tuple[int, ...], Piece]]] = {}
        for rf in self.rank_files:
            if rf.rank in self.absent_ranks:
                continue
            for name, dtype, gshape, piece in self._load_index(rf):
                grouped.setdefault(name, []).append((dtype, gshape, piece))
        self._meta = {name: self._check_tensor(name, g) for name, g in grouped.items()}
        # The newest version any file uses (a 1.1 checkpoint keeps a 1.0 MANIFEST).
        self.format_version = max([self.format_version, *self._data.versions.values()])

    def _load_index(self, rf: RankFile) -> list[tuple[str, torch.dtype, tuple[int, ...], Piece]]:
        path = self.directory / rf.index_file
        raw = read_whole(self.directory, rf.index_file, MAX_INDEX_BYTES)
        if len(raw) != rf.index_size or zlib.crc32(raw) != rf.index_crc32:
            raise CheckpointCorruptError(
                f"index file is {len(raw)} bytes with CRC-32 {zlib.crc32(raw):#010x}; the "
                f"MANIFEST expects {rf.index_size} bytes with {rf.index_crc32:#010x} "
                "(damaged, truncated or swapped file)",
                path=path,
            )
        body = unpack_container(path, raw, INDEX_MAGIC, MAX_INDEX_BYTES)
        _, major, minor, _, _ = CONTAINER_HEADER.unpack_from(raw)
        self._data.versions[rf.rank] = (major, minor)
        return parse_index(body, path, rf, minor)

    def _check_tensor(
        self, name: str, group: list[tuple[torch.dtype, tuple[int, ...], Piece]]
    ) -> TensorMeta:
        dtype, shape, _ = group[0]
        for d, s, p in group:
            if d != dtype or s != shape:
                raise CheckpointFormatError(
                    f"rank {p.rank} stores dtype {d} shape {s}, rank {group[0][2].rank} "
                    f"stores dtype {dtype} shape {shape}",
                    path=self.directory / self.rank_files[p.rank].index_file,
                    tensor=name,
                )
        pieces = tuple(p for _, _, p in group)
        if self.absent_ranks:  # present_only: each read checks its own rectangle
            return TensorMeta(name, dtype, shape, pieces)
        try:
            gap = uncovered(shape, [(p.offsets, p.shape) for p in pieces])
        except ValueError as exc:
            raise CheckpointFormatError(
                f"cannot check piece coverage: {exc}", tensor=name
            ) from None
        if gap is not None:
            raise CheckpointFormatError(
                f"the pieces of this {shape} tensor leave element {gap} uncovered (a rank's "
                "files are missing or the checkpoint was written incompletely)",
                path=self.directory,
                tensor=name,
            )
        return TensorMeta(name, dtype, shape, pieces)

    # --- public queries -------------------------------------------------------------

    def names(self) -> list[str]:
        """Tensor names in the order they were written (rank 0's order first, then names
        only later ranks hold), which is the model's state-dict order for fsdpx saves."""
        return list(self._meta)

    def meta(self, name: str) -> TensorMeta:
        """dtype, global shape and pieces of tensor `name`."""
        try:
            return self._meta[name]
        except KeyError:
            raise CheckpointNotFoundError(
                "no such tensor in the checkpoint", path=self.directory, tensor=name
            ) from None

    def read(
        self,
        name: str,
        offsets: Sequence[int] | None = None,
        shape: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Read the rectangle at `offsets` with `shape` (default: the whole tensor) into a
        new contiguous CPU tensor, decoding only the chunks that hold it.

        Raises:
            ValueError: the rectangle does not fit the tensor.
            CheckpointCorruptError: a chunk fails its checksum or does not decode.
        """
        meta = self.meta(name)
        offs = tuple(offsets) if offsets is not None else (0,) * len(meta.shape)
        shp = (
            tuple(shape)
            if shape is not None
            else tuple(g - o for g, o in zip(meta.shape, offs, strict=True))
        )
        if (
            len(offs) != len(meta.shape)
            or len(shp) != len(meta.shape)
            or any(
                o < 0 or s < 0 or o + s > g for o, s, g in zip(offs, shp, meta.shape, strict=True)
            )
        ):
            raise ValueError(
                f"rectangle at offsets={offs} with shape={shp} does not fit tensor {name!r} "
                f"of shape {meta.shape}"
            )
        out = torch.empty(shp, dtype=meta.dtype)
        if out.numel():
            self._fill(meta, (offs, shp), out)
        return out

    def iter_blocks(
        self, name: str, max_bytes: int = 4 << 20, *, buffers: int = 1
    ) -> Iterator[torch.Tensor]:
        """Yield the whole tensor as consecutive flat C-order blocks of at most about
        `max_bytes` each (at least one element), so a tensor streams to a file with memory
        bounded by one block however the checkpoint was sharded.

        Blocks are views of `buffers` reused buffers taken in turn (across calls too): a
        block stays valid until `buffers` more blocks have been produced. With the default
        of 1, write or `.clone()` each block before advancing; a consumer that writes in a
        background thread while the next block decodes needs 3.
        """
        meta = self.meta(name)
        size = itemsize(meta.dtype)
        for off, shp in blocks(meta.shape, max_bytes // size):
            n = numel(shp)
            self._turn = (self._turn + 1) % buffers
            raw = self._scratch(f"block{self._turn}", n * size)
            out = torch.from_numpy(raw).view(meta.dtype)
            self._fill(meta, (off, shp), out.view(shp))
            yield out

    def verify(self, progress: Callable[[int], None] | None = None, *, deep: bool = False) -> None:
        """Check every chunk of every data file against its CRC-32 (and with deep=True,
        also decode every frame). Reads each data file once, in file order.

        Args:
            progress: called with the number of stored bytes just checked.
            deep: also decompress each frame and check its size.

        Raises:
            CheckpointCorruptError: the first damaged chunk, naming file, tensor, offset.
        """
        self._cache = None  # deep decoding below reuses the cached-chunk buffer
        for rf in self.rank_files:
            items = sorted(
                (
                    (c, m.name, m.dtype)
                    for m in self._meta.values()
                    for p in m.pieces
                    if p.rank == rf.rank
                    for c in p.chunks
                ),
                key=lambda item: item[0].offset,  # file order; chunks themselves don't compare
            )
            for chunk, name, dtype in items:
                stored = self._stored(rf, chunk, name)
                if deep:
                    codec.decode_into(
                        stored,
                        chunk.codec,
                        itemsize(dtype),
                        self._scratch("cached", chunk.raw_size),
                        self._scratch("planes", chunk.raw_size),
                        kernels=self.kernels,
                        expected_crc=None,
                        path=self.directory / rf.data_file,
                        tensor=name,
                        offset=chunk.offset,
                    )
                if progress is not None:
                    progress(chunk.stored_size)

    def close(self) -> None:
        """Close the data files opened by reads (reading again reopens them)."""
        self._data.close()
        self._cache = None
        self._local = threading.local()  # drops this thread's buffers; workers' go with the pool
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- reading chunks -------------------------------------------------------------

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

    def _fill(self, meta: TensorMeta, want: Box, out: torch.Tensor) -> None:
        """Copy the rectangle `want` of `meta` into `out` (contiguous, shape want[1])."""
        if self.absent_ranks:
            parts.check_present(meta, want, self.absent_ranks, self.directory, self.state)
        seen: set[Box] = set()
        for piece in meta.pieces:
            box = (piece.offsets, piece.shape)
            if box in seen:  # a replica of a piece already copied
                continue
            seen.add(box)
            inter = intersect(box, want)
            if inter is None:
                continue
            self._copy(meta, piece, inter, want, out)

    def _copy(
        self, meta: TensorMeta, piece: Piece, inter: Box, want: Box, out: torch.Tensor
    ) -> None:
        """Copy `inter` (global coordinates) from `piece` into `out`, slab by slab along
        the first dim so the bytes decoded at once stay near SLAB_BYTES. When the slab is
        contiguous in both the piece and `out` (whole trailing dims: row shards, blocks),
        chunks decode straight into `out`."""
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
        rows = max(1, SLAB_BYTES // max(row, 1))
        for r0 in range(0, shp[0], rows):
            n = min(rows, shp[0] - r0)
            start = [lo[0] + r0, *lo[1:]]
            first = sum(i * s for i, s in zip(start, strides, strict=True))
            if flat_out is not None:
                at = (dst_lo[0] + r0) * row
                self._span(meta, piece, first, n * row // size, flat_out[at : at + n * row])
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
        self, meta: TensorMeta, piece: Piece, first: int, count: int, dst: np.ndarray
    ) -> np.ndarray:
        """Decode elements [first, first+count) of `piece` (C order) into `dst` (uint8)."""
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
        self._decode_all(meta, piece, whole)
        return dst

    def _decode_all(
        self, meta: TensorMeta, piece: Piece, jobs: list[tuple[int, np.ndarray]]
    ) -> None:
        """[Note: parallel reads] Whole chunks decode straight into disjoint slices of the
        output, so they are independent: with `threads` > 1 each worker reads (pread) and
        decodes its own chunks into its own scratch buffers (zstd, zlib, numpy and the
        native kernels release the GIL), so reading one chunk overlaps decoding another.
        Memory: per thread one stored and one planes buffer of a chunk. Partial chunks
        (the edges of a rectangle) go through the shared one-chunk cache on the calling
        thread."""
        if self.threads == 1 or len(jobs) < 2:
            for k, out in jobs:
                self._decode(meta, piece, k, out)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-read")
        for f in [self._pool.submit(self._decode, meta, piece, k, out) for k, out in jobs]:
            f.result()

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
