"""Constants and byte-level containers shared by the writer and the reader (FORMAT.md §2-4).

An index file and the MANIFEST use one container:

    0   8  magic (b"FSDPXIDX" or b"FSDPXMAN")
    8   2  format major version, u16 little-endian
    10  2  format minor version, u16 little-endian
    12  4  flags, u32 little-endian (0 in version 1)
    16  8  body length N, u64 little-endian
    24  N  body: one msgpack object
    24+N 4 CRC-32 (zlib polynomial) of bytes [0, 24+N), u32 little-endian

A data file starts with a 32-byte header (magic b"FSDPXDAT", versions, flags, a 16-byte
file id that its index repeats) followed by independent chunk frames.
"""

from __future__ import annotations

import re
import struct
import zlib
from pathlib import Path
from typing import Any

import msgpack
import torch

from checkpoint_tools.format.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointVersionError,
)

FORMAT_MAJOR = 1
FORMAT_MINOR = 2
# The oldest minor version still written: files that use no newer feature (codec 2 in
# data and index files, 1.1; the tensor table in MANIFEST, 1.2) are written as 1.0
# (FORMAT.md §7: writers write the lowest version that describes them).
BASE_MINOR = 0
# The newest minor version of data and index files (1.1, codec 2); 1.2 changed only MANIFEST.
DATA_MINOR = 1

DATA_MAGIC = b"FSDPXDAT"
INDEX_MAGIC = b"FSDPXIDX"
MANIFEST_MAGIC = b"FSDPXMAN"
MANIFEST_NAME = "MANIFEST"

CONTAINER_HEADER = struct.Struct("<8sHHIQ")  # magic, major, minor, flags, body length
DATA_HEADER = struct.Struct("<8sHHI16s")  # magic, major, minor, flags, file id
CRC = struct.Struct("<I")

# Codecs of one chunk (FORMAT.md §3). A chunk that zstd does not shrink is stored raw.
CODEC_RAW = 0
CODEC_SHUFFLE_ZSTD = 1
CODEC_PLANES = 2  # format 1.1: byte planes, each raw or zstd ([Note: byte-plane coding])

# Upper bounds a reader enforces before allocating (FORMAT.md §6).
MAX_CHUNK_BYTES = 256 << 20
MAX_INDEX_BYTES = 1 << 30
MAX_MANIFEST_BYTES = 256 << 20
MAX_NDIM = 64
MAX_NAME_BYTES = 4096

_RANK_FILE_RE = re.compile(r"rank-(\d{5,7})\.(data|index)")

# Format dtype name (the safetensors names) <-> torch dtype. Element sizes come from torch.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def data_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.data"


def index_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.index"


def is_rank_file_name(name: str, kind: str) -> bool:
    """True when `name` is a plain file name `rank-NNNNN.<kind>`: no directory part, no
    `..`, nothing a path join could move outside the checkpoint directory."""
    m = _RANK_FILE_RE.fullmatch(name)
    return m is not None and m.group(2) == kind


def check_tensor_name(name: object) -> str | None:
    """Return why `name` is not a valid tensor name, or None when it is (FORMAT.md §5).

    Names are `/`-separated namespaces (`model/<fqn>`, `optim/<fqn>/<key>`); they are
    never used as paths, but tools may use them as keys elsewhere, so components that a
    path join would interpret (`.`, `..`, empty, leading `/`, backslashes, NUL) are refused.
    """
    if not isinstance(name, str):
        return f"expected a string, found {type(name).__name__}"
    if not name or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return f"expected 1 to {MAX_NAME_BYTES} bytes"
    if any(ord(c) < 0x20 or c == "\x7f" for c in name) or "\\" in name:
        return "control characters and backslashes are not allowed"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "empty, '.' and '..' components (and leading/trailing '/') are not allowed"
    return None


def pack_container(magic: bytes, body: bytes, minor: int = DATA_MINOR) -> bytes:
    head = CONTAINER_HEADER.pack(magic, FORMAT_MAJOR, minor, 0, len(body))
    crc = zlib.crc32(body, zlib.crc32(head))
    return head + body + CRC.pack(crc)


def check_version(path: Path, major: int, minor: int) -> None:
    if major > FORMAT_MAJOR:
        raise CheckpointVersionError(
            f"written with checkpoint format {major}.{minor}; this reader supports format "
            f"{FORMAT_MAJOR}.x only. Upgrade fsdpx to read it",
            path=path,
            offset=8,
        )
    if major < 1:
        raise CheckpointFormatError(f"format major version {major} is not valid", path=path)


def unpack_container(path: Path, raw: bytes, magic: bytes, max_body: int) -> Any:
    """Validate a container read whole from `path` and return its decoded msgpack body."""
    if len(raw) < CONTAINER_HEADER.size + CRC.size:
        raise CheckpointCorruptError(
            f"file is {len(raw)} bytes, shorter than the {CONTAINER_HEADER.size + CRC.size}"
            "-byte container header and checksum (truncated?)",
            path=path,
            offset=len(raw),
        )
    found, major, minor, flags, body_len = CONTAINER_HEADER.unpack_from(raw)
    if found != magic:
        raise CheckpointFormatError(
            f"expected magic {magic!r}, found {found!r}: not a fsdpx checkpoint file of this kind",
            path=path,
            offset=0,
        )
    check_version(path, major, minor)
    expected = CONTAINER_HEADER.size + body_len + CRC.size
    if body_len > max_body or expected != len(raw):
        raise CheckpointCorruptError(
            f"header declares a {body_len}-byte body ({expected} bytes in all), the file has "
            f"{len(raw)} bytes (limit {max_body})",
            path=path,
            offset=16,
        )
    end = CONTAINER_HEADER.size + body_len
    (stored_crc,) = CRC.unpack_from(raw, end)
    if zlib.crc32(memoryview(raw)[:end]) != stored_crc:
        raise CheckpointCorruptError(
            "container checksum mismatch: the file was modified or damaged", path=path, offset=end
        )
    if flags != 0:
        raise CheckpointFormatError(f"flags must be 0 in format 1.x, found {flags}", path=path)
    return unpack_msgpack(path, memoryview(raw)[CONTAINER_HEADER.size : end])


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def unpack_msgpack(path: Path, body: memoryview) -> Any:
    """Decode one msgpack object with every declared length bounded by the body size, no
    extension types and no code hooks; any failure becomes CheckpointFormatError."""
    n = len(body)
    try:
        return msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=False,
            ext_hook=_no_ext,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n // 2,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises ValueError, TypeError, StackError, ...
        raise CheckpointFormatError(
            f"msgpack body does not decode ({type(exc).__name__}: {exc})",
            path=path,
            offset=CONTAINER_HEADER.size,
        ) from None
