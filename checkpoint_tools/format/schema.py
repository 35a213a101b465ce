"""Strict validation of decoded MANIFEST and index bodies into frozen dataclasses.

Decoded msgpack is untrusted: every field is type- and range-checked here, before any
size in it is used to seek, read or allocate. Unknown keys are ignored (a newer minor
version MAY add fields); missing or mistyped known keys raise CheckpointFormatError.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpoint_tools.format.errors import CheckpointCorruptError, CheckpointFormatError
from checkpoint_tools.format.layout import (
    CODEC_PLANES,
    CODEC_RAW,
    CODEC_SHUFFLE_ZSTD,
    DATA_HEADER,
    DTYPES,
    MAX_CHUNK_BYTES,
    MAX_NDIM,
    check_tensor_name,
    data_file_name,
    index_file_name,
    itemsize,
)

MAX_WORLD_SIZE = 1 << 20
# zstd encodes at most 128 KiB per block and a block takes at least 4 bytes, so no
# valid frame expands more than 32768x; a chunk declaring more is refused unread.
MAX_ZSTD_RATIO = 32768


@dataclass(frozen=True)
class Chunk:
    """One stored frame: where it is, how big stored and raw, its CRC-32 and codec."""

    offset: int
    stored_size: int
    raw_size: int
    crc32: int
    codec: int


@dataclass(frozen=True)
class Piece:
    """A rectangle of a global tensor written by one rank, stored as C-order chunks."""

    rank: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    starts: tuple[int, ...]  # raw byte offset of each chunk within the piece

    @property
    def stored_bytes(self) -> int:
        return sum(c.stored_size for c in self.chunks)


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of the checkpoint: name, dtype and global shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True)
class TensorMeta(TensorInfo):
    """A tensor of the checkpoint with the pieces that tile it (all of them from
    `CheckpointReader.meta`, the ones a read takes from `pieces_for`)."""

    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class RankFile:
    """A rank's pair of files as the MANIFEST names them."""

    rank: int
    index_file: str
    index_size: int
    index_crc32: int
    data_file: str
    data_size: int
    file_id: bytes


def _get(obj: dict[Any, Any], key: str, kind: type, path: Path, where: str) -> Any:
    value = obj.get(key)
    ok = type(value) is int if kind is int else isinstance(value, kind)
    if not ok:
        raise CheckpointFormatError(
            f"{where}: field {key!r} must be {kind.__name__}, found {type(value).__name__}",
            path=path,
        )
    return value


def _ints(value: Any, path: Path, where: str, *, lo: int = 0) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        raise CheckpointFormatError(
            f"{where}: expected a list of at most {MAX_NDIM} ints", path=path
        )
    if not all(type(v) is int and lo <= v < 1 << 62 for v in value):
        raise CheckpointFormatError(
            f"{where}: expected ints in [{lo}, 2**62), found {value!r}", path=path
        )
    return tuple(value)


def parse_manifest(body: Any, path: Path) -> tuple[int, list[RankFile], dict[str, Any]]:
    """Return (world_size, rank files in rank order, state) from a decoded MANIFEST."""
    if not isinstance(body, dict):
        raise CheckpointFormatError("MANIFEST body must be a map", path=path)
    world = _get(body, "world_size", int, path, "MANIFEST")
    if not 1 <= world <= MAX_WORLD_SIZE:
        raise CheckpointFormatError(
            f"world_size {world} is outside [1, {MAX_WORLD_SIZE}]", path=path
        )
    ranks = _get(body, "ranks", list, path, "MANIFEST")
    if len(ranks) != world:
        raise CheckpointFormatError(
            f"MANIFEST lists {len(ranks)} rank entries for world_size {world}", path=path
        )
    state = _get(body, "state", dict, path, "MANIFEST")
    files = []
    for r, entry in enumerate(ranks):
        where = f"MANIFEST rank entry {r}"
        if not isinstance(entry, dict):
            raise CheckpointFormatError(f"{where} must be a map", path=path)
        rf = RankFile(
            rank=_get(entry, "rank", int, path, where),
            index_file=_get(entry, "index_file", str, path, where),
            index_size=_get(entry, "index_size", int, path, where),
            index_crc32=_get(entry, "index_crc32", int, path, where),
            data_file=_get(entry, "data_file", str, path, where),
            data_size=_get(entry, "data_size", int, path, where),
            file_id=_get(entry, "file_id", bytes, path, where),
        )
        # Only the canonical names are accepted: a name is never joined onto the
        # directory unless it is exactly rank-NNNNN.{index,data} for this rank.
        if rf.rank != r or rf.index_file != index_file_name(r) or rf.data_file != data_file_name(r):
            raise CheckpointFormatError(
                f"{where}: expected rank {r} with files {index_file_name(r)!r} and "
                f"{data_file_name(r)!r}, found rank {rf.rank} with {rf.index_file!r} and "
                f"{rf.data_file!r}",
                path=path,
            )
        if rf.index_size < 0 or rf.data_size < DATA_HEADER.size or len(rf.file_id) != 16:
            raise CheckpointFormatError(f"{where}: sizes or file id out of range", path=path)
        files.append(rf)
    return world, files, state


def parse_index(
    body: Any, path: Path, rf: RankFile, minor: int = 0
) -> list[tuple[str, torch.dtype, tuple[int, ...], Piece]]:
    """Validate one rank's decoded index (format 1.`minor`) against its MANIFEST entry;
    return its pieces as (name, dtype, global shape, piece)."""
    if not isinstance(body, dict):
        raise CheckpointFormatError("index body must be a map", path=path)
    checks = (
        ("rank", int, rf.rank),
        ("file_id", bytes, rf.file_id),
        ("data_file", str, rf.data_file),
        ("data_size", int, rf.data_size),
    )
    for key, kind, want in checks:
        if _get(body, key, kind, path, "index") != want:
            raise CheckpointCorruptError(
                f"index field {key!r} does not match the MANIFEST ({body.get(key)!r} vs "
                f"{want!r}): rank files were swapped or mixed from different checkpoints",
                path=path,
            )
    out = []
    seen: set[str] = set()
    for i, raw in enumerate(_get(body, "pieces", list, path, "index")):
        if not isinstance(raw, dict):
            raise CheckpointFormatError(f"piece {i} must be a map", path=path)
        name = raw.get("name")
        why = check_tensor_name(name)
        if why is not None:
            raise CheckpointFormatError(
                f"piece {i}: invalid tensor name {name!r}: {why}", path=path
            )
        assert isinstance(name, str)
        out.append(_parse_piece(raw, name, path, rf, minor))
        if name in seen:
            raise CheckpointFormatError(
                "tensor appears twice in one rank's index", path=path, tensor=name
            )
        seen.add(name)
    return out


def _parse_piece(
    raw: dict[Any, Any], name: str, path: Path, rf: RankFile, minor: int
) -> tuple[str, torch.dtype, tuple[int, ...], Piece]:
    where = f"tensor {name!r}"
    dname = raw.get("dtype")
    if not isinstance(dname, str) or dname not in DTYPES:
        raise CheckpointFormatError(
            f"unknown dtype {dname!r}; known: {sorted(DTYPES)}", path=path, tensor=name
        )
    dtype = DTYPES[dname]
    gshape = _ints(raw.get("global_shape"), path, f"{where} global_shape")
    offsets = _ints(raw.get("offsets"), path, f"{where} offsets")
    shape = _ints(raw.get("shape"), path, f"{where} shape")
    if not len(gshape) == len(offsets) == len(shape) or any(
        o + s > g for o, s, g in zip(offsets, shape, gshape, strict=True)
    ):
        raise CheckpointFormatError(
            f"piece at offsets {offsets} with shape {shape} does not fit global shape {gshape}",
            path=path,
            tensor=name,
        )
    size = itemsize(dtype)
    # Codec 2 exists from format 1.1 on, for elements of 2+ bytes; its frame holds one
    # 4-byte size per plane and at least one byte per plane (FORMAT.md §3.2).
    codecs = (
        (CODEC_RAW, CODEC_SHUFFLE_ZSTD, CODEC_PLANES)
        if minor >= 1 and size > 1
        else (
            CODEC_RAW,
            CODEC_SHUFFLE_ZSTD,
        )
    )
    chunks, starts, total = [], [], 0
    for c in _get(raw, "chunks", list, path, where):
        if not (isinstance(c, list) and len(c) == 5 and all(type(v) is int for v in c)):
            raise CheckpointFormatError(
                "chunk entry must be a list of 5 ints", path=path, tensor=name
            )
        ch = Chunk(*c)
        bad = (
            ch.codec not in codecs
            or (ch.codec == CODEC_PLANES and ch.stored_size < 5 * size)
            or not 0 < ch.raw_size <= MAX_CHUNK_BYTES
            or ch.raw_size % size
            or not 0 < ch.stored_size <= ch.raw_size
            or (ch.codec == CODEC_RAW and ch.stored_size != ch.raw_size)
            or ch.raw_size > ch.stored_size * MAX_ZSTD_RATIO
            or not 0 <= ch.crc32 < 1 << 32
            or ch.offset < DATA_HEADER.size
            or ch.offset + ch.stored_size > rf.data_size
        )
        if bad:
            raise CheckpointFormatError(
                f"chunk {c} is out of range (codec, sizes, checksum or position in a "
                f"{rf.data_size}-byte data file)",
                path=path,
                tensor=name,
                offset=ch.offset,
            )
        chunks.append(ch)
        starts.append(total)
        total += ch.raw_size
    numel = 1
    for s in shape:
        numel *= s
    if total != numel * size:
        raise CheckpointFormatError(
            f"chunks hold {total} bytes, the piece shape {shape} of {dtype} needs {numel * size}",
            path=path,
            tensor=name,
        )
    piece = Piece(rf.rank, offsets, shape, tuple(chunks), tuple(starts))
    return name, dtype, gshape, piece
