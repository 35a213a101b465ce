"""Writing a checkpoint: one RankWriter per rank, then rank 0 writes the MANIFEST last.

Nothing here knows about torch.distributed: the engine gathers each rank's local pieces
and calls these functions; tests and tools call them directly.
"""

from __future__ import annotations

import os
import queue
import struct
import threading
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import msgpack
import numpy as np
import torch

from checkpoint_tools.format import codec
from checkpoint_tools.format.kernels import DEFAULT_KERNELS, Kernels
from checkpoint_tools.format.layout import (
    BASE_MINOR,
    CODEC_PLANES,
    DATA_HEADER,
    DATA_MAGIC,
    DTYPE_NAMES,
    FORMAT_MAJOR,
    INDEX_MAGIC,
    MANIFEST_MAGIC,
    MANIFEST_NAME,
    MAX_CHUNK_BYTES,
    MAX_NDIM,
    check_tensor_name,
    data_file_name,
    index_file_name,
    pack_container,
)
from checkpoint_tools.format.root import fsync_dir, fsync_file
from checkpoint_tools.format.routing import ROUTING_MINOR, build_routing
from checkpoint_tools.format.writeback import WRITEBACK_BYTES, start_writeback

_Inflight = tuple[
    "Future[tuple[codec.Encoded, np.ndarray]]", list[list[int]], int, Callable[[], None] | None
]

# Names the MANIFEST's own version (informational; 1.2 with a tensor table); rank files
# carry theirs in headers.
WRITER_ID = f"fsdpx-checkpoint {FORMAT_MAJOR}.{BASE_MINOR}"


class RankWriter:
    """Streams one rank's tensor pieces into `rank-NNNNN.data` and, on close, writes the
    msgpack index `rank-NNNNN.index` that locates every chunk.

    Args:
        directory: checkpoint directory (created if missing); normally the temporary
            `<tag>.tmp-<nonce>` directory the engine renames on commit.
        rank: this writer's rank; each rank of a checkpoint writes its own pair of files.
        compression: "zstd" (byte shuffle + zstd per chunk) or "none".
        level: zstd level (1 is the measured sweet spot; higher levels cost much more time
            for a few percent).
        chunk_bytes: bytes of raw tensor data per independently checksummed frame.
        file_id: the 16 bytes tying the data file to its index; random by default (pass
            fixed bytes only for reproducible output, e.g. golden-file tests).
        threads: worker threads that shuffle, compress and checksum chunks in parallel
            (zstd, numpy, zlib and the native kernels release the GIL) while the calling
            thread writes finished chunks in order ([Note: pipelined writer]).
        kernels: shuffle / CRC kernels ([Note: codec injection]); numpy + zlib by default.
        defer: let `add` return once the piece's chunks are queued, so that encoding one
            piece overlaps writing the previous ones ([Note: deferred pieces]). The caller
            must leave each added tensor unchanged until its `written` callback has run
            (at the latest, until close()).

    Example::

        w = RankWriter(tmp_dir, rank=0)
        w.add("model/fc.weight", shard, global_shape=(8, 4), offsets=(0, 0))
        info = w.close()
        write_manifest(tmp_dir, world_size=1, rank_files=[info], state={"step": 3})
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        rank: int,
        *,
        compression: Literal["zstd", "none"] = "zstd",
        level: int = 1,
        chunk_bytes: int = 4 << 20,
        file_id: bytes | None = None,
        threads: int = 1,
        kernels: Kernels | None = None,
        defer: bool = False,
    ) -> None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive int; got {threads!r}")
        if file_id is not None and len(file_id) != 16:
            raise ValueError(f"file_id must be 16 bytes; got {len(file_id)}")
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int; got {rank!r}")
        if compression not in ("zstd", "none"):
            raise ValueError(f"compression must be 'zstd' or 'none'; got {compression!r}")
        if not -7 <= level <= 22:
            raise ValueError(f"zstd level must be in [-7, 22]; got {level}")
        if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [1, {MAX_CHUNK_BYTES}]; got {chunk_bytes}")
        self.directory = Path(directory)
        self.rank = rank
        self.compression = compression
        self.chunk_bytes = chunk_bytes
        self.level = level
        self.threads = threads
        self.kernels = kernels if kernels is not None else DEFAULT_KERNELS
        self._compress = compression == "zstd"
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"ckpt-encode-{rank}")
        # Scratch buffers for shuffled planes: one per chunk in flight plus the one being
        # written, reused (fresh multi-MiB buffers cost first-touch page faults).
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        self._buffers = 0
        self._buffer_lock = threading.Lock()
        self._minor = BASE_MINOR
        self._file_id = file_id if file_id is not None else os.urandom(16)
        self._pieces: list[dict[str, Any]] = []
        self._defer = defer
        # Chunks being encoded, in file order: (future, its piece's chunk list, raw
        # bytes, the piece's `written` callback when this is its last chunk).
        self._inflight: deque[_Inflight] = deque()
        self._names: set[str] = set()
        self._closed = False
        self.directory.mkdir(parents=True, exist_ok=True)
        self._data_path = self.directory / data_file_name(rank)
        # "x": two writers claiming the same rank in one directory is a bug; fail loudly.
        self._f = open(self._data_path, "xb")  # noqa: SIM115 - closed in close()/abort()
        header = DATA_HEADER.pack(DATA_MAGIC, FORMAT_MAJOR, BASE_MINOR, 0, self._file_id)
        self._f.write(header)
        self._pos = len(header)
        self._synced = 0  # bytes [0, _synced) were handed to start_writeback

    def add(
        self,
        name: str,
        local: torch.Tensor,
        *,
        global_shape: Sequence[int],
        offsets: Sequence[int],
        written: Callable[[], None] | None = None,
    ) -> None:
        """Append one piece: `local` is the rectangle of the global tensor `name` that
        starts at `offsets` (same number of dims as `global_shape`).

        Args:
            name: tensor name (`model/<fqn>`, `optim/<fqn>/<key>`, ...; FORMAT.md §5).
            local: this rank's piece; any device, dtype from layout.DTYPES, any strides.
            global_shape: shape of the whole tensor.
            offsets: index of the piece's first element in the global tensor.
            written: called (on this thread) once the piece's bytes are in the data file;
                before `add` returns unless the writer defers.
        """
        if self._closed:
            raise ValueError(
                f"RankWriter for rank {self.rank} is closed or aborted; cannot add {name!r}"
            )
        why = check_tensor_name(name)
        if why is not None:
            raise ValueError(f"invalid tensor name {name!r}: {why}")
        if name in self._names:
            raise ValueError(f"tensor {name!r} was already added on rank {self.rank}")
        if local.dtype not in DTYPE_NAMES:
            raise ValueError(
                f"tensor {name!r} has dtype {local.dtype}, which the format cannot store; "
                f"supported: {', '.join(str(d) for d in DTYPE_NAMES)}"
            )
        gshape = [int(s) for s in global_shape]
        offs = [int(o) for o in offsets]
        lshape = list(local.shape)
        if not (len(gshape) == len(offs) == len(lshape)) or len(gshape) > MAX_NDIM:
            raise ValueError(
                f"tensor {name!r}: expected offsets and local shape with the same number of "
                f"dims as global_shape (at most {MAX_NDIM}); got {global_shape=}, "
                f"{offsets=}, local.shape={tuple(lshape)}"
            )
        for o, s, g in zip(offs, lshape, gshape, strict=True):
            if not 0 <= o <= o + s <= g < 1 << 62:
                raise ValueError(
                    f"tensor {name!r}: piece at {offsets=} with shape {tuple(lshape)} does not "
                    f"fit inside global_shape={tuple(gshape)}"
                )
        if hasattr(local, "to_local") and hasattr(local, "placements"):
            raise ValueError(
                f"tensor {name!r} is a DTensor; pass its local shard (`t.to_local()`) with "
                "the shard's global offsets"
            )
        self._names.add(name)
        try:
            chunks = self._write_chunks(local, written)
        except BaseException:
            # The data file now ends in a partial piece: nothing more may be added.
            self.abort()
            raise
        self._pieces.append(
            {
                "name": name,
                "dtype": DTYPE_NAMES[local.dtype],
                "global_shape": gshape,
                "offsets": offs,
                "shape": lshape,
                "chunks": chunks,
            }
        )

    def _write_chunks(
        self, local: torch.Tensor, written: Callable[[], None] | None
    ) -> list[list[int]]:
        """[Note: pipelined writer] Chunks encode on the pool while the calling thread
        writes earlier ones, in order. At most 2 x threads chunks are in flight, each
        holding one of at most 2 x threads + 1 scratch buffers (one more is being
        written), so memory stays a few chunks however large the piece is. The data file
        is fsynced once, in close(); every finished 32 MiB is handed to the disk before
        that ([Note: early writeback]), so the fsync waits for the tail only.

        [Note: deferred pieces]
        Without `defer`, a piece's last chunks are waited for before `add` returns, so a
        model of chunk-sized tensors (4 MiB: a 1024 x 1024 fp32 weight) encodes one chunk
        at a time with the pool mostly idle. With `defer` the in-flight window spans
        pieces: `add` queues the chunks and returns, the window is drained as it fills,
        and close() writes the rest (the runtime's save and the DeepSpeed importer defer;
        a 300M model's 72 tensors drained the window 72 times). The returned chunk list is
        filled as chunks are
        written (file order is queue order either way, so the bytes are the same); a
        piece's `written` callback runs when its last chunk is (the importer returns a
        memory-mapped source's pages to the kernel then, not before)."""
        t = local.detach().to("cpu").contiguous().reshape(-1)
        size = t.element_size()
        raw = t.view(torch.uint8).numpy()
        step = max(1, self.chunk_bytes // size) * size
        chunks: list[list[int]] = []
        starts = range(0, len(raw), step)
        for a in starts:
            while len(self._inflight) >= 2 * self.threads:
                self._write_next()
            future = self._pool.submit(self._encode, raw[a : a + step], size)
            last = a + step >= len(raw)
            self._inflight.append(
                (future, chunks, min(step, len(raw) - a), written if last else None)
            )
        if not starts and written is not None:
            written()  # an empty piece: nothing to write
        if not self._defer:
            while self._inflight:
                self._write_next()
        return chunks

    def _write_next(self) -> None:
        """Write the oldest in-flight chunk (waiting for its encoding)."""
        future, chunks, nbytes, written = self._inflight[0]
        enc, buf = future.result()
        self._inflight.popleft()
        for part in enc.parts:
            self._f.write(part)
        self._free.put(buf)  # its planes are written: reusable
        if enc.codec == CODEC_PLANES:
            self._minor = max(self._minor, 1)
        chunks.append([self._pos, enc.size, nbytes, enc.crc, enc.codec])
        self._pos += enc.size
        if self._pos - self._synced >= 2 * WRITEBACK_BYTES:  # [Note: early writeback]
            self._f.flush()
            start_writeback(self._f.fileno(), self._synced, WRITEBACK_BYTES)
            self._synced += WRITEBACK_BYTES
        if written is not None:
            written()

    def _encode(self, raw: np.ndarray, size: int) -> tuple[codec.Encoded, np.ndarray]:
        buf = self._take_buffer()
        # a ZstdCompressor must not be used by two threads at once: one set per thread
        zstd = getattr(self._local, "zstd", None)
        if zstd is None and self._compress:
            zstd = self._local.zstd = self._new_compressors()
        return codec.encode(raw, size, zstd, self.kernels, buf[: len(raw)]), buf

    def _take_buffer(self) -> np.ndarray:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._buffer_lock:
            if self._buffers < 2 * self.threads + 1:
                self._buffers += 1
                return np.empty(self.chunk_bytes, dtype=np.uint8)
        return self._free.get()

    def _new_compressors(self) -> codec.Compressors:
        return codec.compressors(self.level)  # [Note: plane compressor]

    def close(self) -> dict[str, Any]:
        """Fsync the data file, write and fsync the index. Returns this rank's entry for
        `write_manifest` (file names, sizes, index checksum, file id, and under "pieces"
        each piece's name, dtype, global shape, offsets and shape): msgpack-able."""
        if self._closed:
            raise ValueError(f"RankWriter for rank {self.rank} is already closed or aborted")
        self._closed = True
        try:
            while self._inflight:  # deferred pieces ([Note: deferred pieces])
                self._write_next()
        except BaseException:
            self._pool.shutdown(cancel_futures=True)
            self._f.close()
            raise
        self._pool.shutdown()
        try:
            if self._minor != BASE_MINOR:
                # The header was written before any chunk; it names the version the
                # chunks turned out to need (the index, below, repeats it).
                self._f.flush()
                os.pwrite(self._f.fileno(), struct.pack("<H", self._minor), 10)
            fsync_file(self._f)
        finally:
            self._f.close()
        body = {
            "rank": self.rank,
            "file_id": self._file_id,
            "data_file": self._data_path.name,
            "data_size": self._pos,
            "compression": self.compression,
            "chunk_bytes": self.chunk_bytes,
            "pieces": self._pieces,
        }
        blob = pack_container(INDEX_MAGIC, msgpack.packb(body, use_bin_type=True), self._minor)
        index_name = index_file_name(self.rank)
        _write_file(self.directory / index_name, blob, exclusive=True)
        fsync_dir(self.directory)
        return {
            "rank": self.rank,
            "index_file": index_name,
            "index_size": len(blob),
            "index_crc32": zlib.crc32(blob),
            "data_file": self._data_path.name,
            "data_size": self._pos,
            "file_id": self._file_id,
            # For the MANIFEST's tensor table ([Note: tensor table]); write_manifest moves
            # it there, so it is not part of the MANIFEST's rank entry.
            "pieces": [
                [p["name"], p["dtype"], p["global_shape"], p["offsets"], p["shape"]]
                for p in self._pieces
            ],
        }

    def abort(self) -> None:
        """Close the data file without writing an index (the engine removes the directory)."""
        if not self._closed:
            self._closed = True
            self._inflight.clear()
            self._pool.shutdown(cancel_futures=True)
            self._f.close()


def write_manifest(
    directory: str | os.PathLike[str],
    *,
    world_size: int,
    rank_files: list[dict[str, Any]],
    state: dict[str, Any],
    tensor_table: bool = True,
) -> None:
    """Write the MANIFEST, the last file of a checkpoint (temp file, fsync, rename, fsync
    the directory). A directory without MANIFEST is an incomplete checkpoint.

    Args:
        directory: the checkpoint directory every RankWriter wrote into.
        world_size: number of ranks that wrote files.
        rank_files: the dicts returned by each rank's `RankWriter.close()`, any order.
            Their "pieces" lists become the tensor table ([Note: tensor table]).
        state: msgpack-able values (dict/list/str/bytes/int/float/bool/None): engine,
            scheduler and loss-scaler state, RNG states as bytes, client_state.
        tensor_table: write the tensor table (format 1.2; needs every entry's "pieces").
            False writes a 1.0 MANIFEST, which makes every reader read every index.

    Raises:
        ValueError: missing or duplicate ranks, state that msgpack cannot hold, a
            tensor table asked for without "pieces", or ranks that disagree on a
            tensor's dtype or global shape.

    Example::

        write_manifest(d, world_size=2, rank_files=[info0, info1], state={"step": 10})
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    ranks = sorted(int(f["rank"]) for f in rank_files)
    if ranks != list(range(world_size)):
        raise ValueError(
            f"expected one rank file entry for each rank 0..{world_size - 1}; got ranks {ranks}"
        )
    entries = sorted(rank_files, key=lambda f: int(f["rank"]))
    body: dict[str, Any] = {
        "writer": WRITER_ID
        if not tensor_table
        else f"fsdpx-checkpoint {FORMAT_MAJOR}.{ROUTING_MINOR}",
        "world_size": world_size,
        "ranks": [{k: v for k, v in f.items() if k != "pieces"} for f in entries],
        "state": state,
    }
    minor = BASE_MINOR
    if tensor_table:
        missing = [int(f["rank"]) for f in entries if "pieces" not in f]
        if missing:
            raise ValueError(
                f"rank file entries of ranks {missing[:5]} have no 'pieces' list (pass what "
                "RankWriter.close() returns, or tensor_table=False for a 1.0 MANIFEST)"
            )
        body.update(build_routing([f["pieces"] for f in entries]))
        minor = ROUTING_MINOR
    try:
        packed = msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(
            f"checkpoint state must hold only msgpack-able values (dict, list, str, bytes, "
            f"int, float, bool, None); packing failed: {exc}. Convert tensors to lists or "
            "bytes, or save them as tensors"
        ) from None
    d = Path(directory)
    tmp = d / (MANIFEST_NAME + ".tmp")
    _write_file(tmp, pack_container(MANIFEST_MAGIC, packed, minor), exclusive=False)
    os.replace(tmp, d / MANIFEST_NAME)
    fsync_dir(d)


def _write_file(path: Path, blob: bytes, *, exclusive: bool) -> None:
    with open(path, "xb" if exclusive else "wb") as f:
        f.write(blob)
        fsync_file(f)
