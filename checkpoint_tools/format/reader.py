"""Reading a checkpoint: validate MANIFEST (and its tensor table, format 1.2) up front,
read a rank's index when one of its pieces is needed (before 1.2: every index up front),
then read any rectangle of any tensor, touching only the chunks that hold it.

Files are opened only by their canonical names inside the checkpoint directory (see
files.py). Nothing is unpickled; nothing is executed.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from checkpoint_tools.format import codec, parts
from checkpoint_tools.format.assemble import ChunkAssembler, check_destination
from checkpoint_tools.format.coverage import Box, blocks, numel, uncovered
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
from checkpoint_tools.format.routing import choose, parse_routing
from checkpoint_tools.format.schema import (
    Piece,
    RankFile,
    TensorInfo,
    TensorMeta,
    parse_index,
    parse_manifest,
)


class CheckpointReader(ChunkAssembler):
    """Random access to a checkpoint directory (one tag, not the root with `latest`).

    Args:
        directory: the checkpoint directory holding MANIFEST and rank-NNNNN.* files.
        kernels: shuffle / CRC kernels ([Note: codec injection]); numpy + zlib by default.
        threads: threads that read and decode the whole chunks of one read in parallel
            ([Note: parallel reads]); 1 reads on the calling thread.
        prefer_rank: the reading rank: of replicated pieces, its own are read (its own
            index and data file) when it holds one.
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
        prefer_rank: int | None = None,
        present_only: bool = False,
    ) -> None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive int; got {threads!r}")
        self.directory = Path(directory)
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []
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
        self._manifest_version = (major, minor)
        self.writer: str = str(body.get("writer", "unknown"))
        self.prefer_rank = prefer_rank
        self.index_reads = 0
        """Index files read so far ([Note: tensor table]: 1.2 checkpoints read only the
        indexes of ranks whose pieces were asked for)."""
        self.index_bytes = 0
        """Their bytes."""
        self._data = DataFiles(self.directory)
        self._cache: tuple[tuple[str, int, int], np.ndarray] | None = None
        self._turn = 0
        self._indexes: dict[int, dict[str, tuple[torch.dtype, tuple[int, ...], Piece]]] = {}
        self._meta: dict[str, TensorMeta] = {}
        missing = parts.missing_files(self.directory, self.rank_files)
        self.absent_ranks = parts.absent_ranks(self.rank_files, missing)
        if missing and not present_only:
            raise CheckpointNotFoundError(
                parts.missing_message(
                    self.directory, self.world_size, missing, self.absent_ranks, self.state
                )
            )
        self._routing = parse_routing(body, minor, self.world_size, mpath)
        if self._routing is None:  # before 1.2: every index, read now
            grouped: dict[str, list[tuple[torch.dtype, tuple[int, ...], Piece]]] = {}
            for rf in self._present():
                for name, (dtype, gshape, piece) in self._index(rf.rank).items():
                    grouped.setdefault(name, []).append((dtype, gshape, piece))
            self._meta = {name: self._check_tensor(name, g) for name, g in grouped.items()}

    @property
    def format_version(self) -> tuple[int, int]:
        """The newest format version any file of the checkpoint uses (a 1.1 checkpoint
        keeps a 1.0 MANIFEST; a 1.2 MANIFEST may name 1.0 files). Reads every index
        (that is here: see present_only)."""
        for rf in self._present():
            self._index(rf.rank)
        return max([self._manifest_version, *self._data.versions.values()])

    def _present(self) -> list[RankFile]:
        """The rank files in this directory (all of them unless present_only)."""
        return [rf for rf in self.rank_files if rf.rank not in self.absent_ranks]

    def _index(self, rank: int) -> dict[str, tuple[torch.dtype, tuple[int, ...], Piece]]:
        """Rank `rank`'s pieces by name, its index read and checked on first use."""
        pieces = self._indexes.get(rank)
        if pieces is not None:
            return pieces
        rf = self.rank_files[rank]
        path = self.directory / rf.index_file
        raw = read_whole(self.directory, rf.index_file, MAX_INDEX_BYTES)
        self.index_reads += 1
        self.index_bytes += len(raw)
        if len(raw) != rf.index_size or zlib.crc32(raw) != rf.index_crc32:
            raise CheckpointCorruptError(
                f"index file is {len(raw)} bytes with CRC-32 {zlib.crc32(raw):#010x}; the "
                f"MANIFEST expects {rf.index_size} bytes with {rf.index_crc32:#010x} "
                "(damaged, truncated or swapped file)",
                path=path,
            )
        body = unpack_container(path, raw, INDEX_MAGIC, MAX_INDEX_BYTES)
        _, major, minor, _, _ = CONTAINER_HEADER.unpack_from(raw)
        parsed = parse_index(body, path, rf, minor)
        if self._routing is not None:
            self._routing.check_index(rank, parsed, path)
        self._data.versions[rf.rank] = (major, minor)
        pieces = {name: (dtype, gshape, piece) for name, dtype, gshape, piece in parsed}
        self._indexes[rank] = pieces
        return pieces

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
        if self._routing is not None:
            return list(self._routing.tensors)
        return list(self._meta)

    def info(self, name: str) -> TensorInfo:
        """dtype and global shape of tensor `name`, without reading any index."""
        if self._routing is None:
            return self.meta(name)
        route = self._routing.tensors.get(name)
        if route is None:
            raise self._no_such(name)
        return TensorInfo(name, route.dtype, route.shape)

    def meta(self, name: str) -> TensorMeta:
        """dtype, global shape and every piece of tensor `name` (in a 1.2 checkpoint this
        reads the index of every rank holding a piece of it; `info` reads none)."""
        meta = self._meta.get(name)
        if meta is not None:
            return meta
        if self._routing is None or name not in self._routing.tensors:
            raise self._no_such(name)
        info = self.info(name)
        pieces = tuple(
            self._index(rank)[name][2]
            for rank, _ in self._routing.entries(name)
            if rank not in self.absent_ranks
        )
        meta = self._meta[name] = TensorMeta(info.name, info.dtype, info.shape, pieces)
        return meta

    def pieces_for(
        self, name: str, offsets: Sequence[int] | None = None, shape: Sequence[int] | None = None
    ) -> TensorMeta:
        """Tensor `name` with only the pieces a read of the rectangle at `offsets` with
        `shape` (default: the whole tensor) decodes from: one per distinct rectangle
        overlapping it, `prefer_rank`'s own replica where it holds one. In a 1.2
        checkpoint only those pieces' ranks' indexes are read ([Note: tensor table]).

        Raises:
            ValueError: the rectangle does not fit the tensor.
        """
        info = self.info(name)
        want = self._rectangle(info, offsets, shape)
        if self._routing is None:
            entries = [(p.rank, (p.offsets, p.shape)) for p in self.meta(name).pieces]
            chosen = choose(entries, want, self.prefer_rank)
        elif self.absent_ranks:  # present_only: the replicas here; _fill checks coverage
            here = [e for e in self._routing.entries(name) if e[0] not in self.absent_ranks]
            chosen = choose(here, want, self.prefer_rank)
        else:
            chosen = self._routing.select(name, want, self.prefer_rank)
        pieces = tuple(self._index(rank)[name][2] for rank, _ in chosen)
        return TensorMeta(info.name, info.dtype, info.shape, pieces)

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
        meta = self.pieces_for(name, offsets, shape)
        want = self._rectangle(meta, offsets, shape)
        out = torch.empty(want[1], dtype=meta.dtype)
        if out.numel():
            self._fill(meta, want, out)
        return out

    def read_into(
        self,
        name: str,
        out: torch.Tensor,
        offsets: Sequence[int] | None = None,
        *,
        wait: bool = True,
    ) -> None:
        """Read the rectangle at `offsets` (default: the origin) with `out`'s shape
        straight into `out`, a contiguous CPU tensor of the tensor's dtype: no output
        allocation and no copy ([Note: decoding into the destination]).

        With `wait=False` (and `threads` > 1) the chunks that decode whole into `out` are
        left to the worker threads and the call returns; `wait()` waits for all of them
        and raises the first error. `out` must not be used before then. On an error,
        `out` may hold part of the rectangle.

        Raises:
            ValueError: `out` is not a contiguous CPU tensor of the tensor's dtype, or
                the rectangle does not fit the tensor.
            CheckpointCorruptError: a chunk fails its checksum or does not decode.
        """
        check_destination(name, out, self.info(name).dtype)
        shape = tuple(out.shape)
        meta = self.pieces_for(name, offsets, shape)
        want = self._rectangle(meta, offsets, shape)
        if out.numel():
            self._fill(meta, want, out, defer=not wait)
        if wait:
            self.wait()

    def _rectangle(
        self, info: TensorInfo, offsets: Sequence[int] | None, shape: Sequence[int] | None
    ) -> Box:
        offs = tuple(offsets) if offsets is not None else (0,) * len(info.shape)
        shp = (
            tuple(shape)
            if shape is not None
            else tuple(g - o for g, o in zip(info.shape, offs, strict=True))
        )
        if (
            len(offs) != len(info.shape)
            or len(shp) != len(info.shape)
            or any(
                o < 0 or s < 0 or o + s > g for o, s, g in zip(offs, shp, info.shape, strict=True)
            )
        ):
            raise ValueError(
                f"rectangle at offsets={offs} with shape={shp} does not fit tensor "
                f"{info.name!r} of shape {info.shape}"
            )
        return offs, shp

    def _no_such(self, name: str) -> CheckpointNotFoundError:
        return CheckpointNotFoundError(
            "no such tensor in the checkpoint", path=self.directory, tensor=name
        )

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
        for name in self.names():
            self.meta(name)  # every index read and checked, coverage too
        for rf in self._present():
            items = sorted(
                (
                    (c, name, dtype)
                    for name, (dtype, _, p) in self._index(rf.rank).items()
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
        """Close the data files opened by reads (reading again reopens them). Reads
        started with `wait=False` are waited for first (their errors are not raised:
        call `wait()` for them)."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.exception()
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
