"""Streaming safetensors writer: the header is computed from shapes and dtypes up front,
then each tensor's bytes are appended block by block, so memory stays at one block.

Same file layout and naming as `fsdpx.export` (single `model.safetensors`, or
`model-0000i-of-0000N.safetensors` plus `model.safetensors.index.json`, Hugging Face's
greedy split rule). It is a separate module because fsdpx.export gathers DTensors and so
imports the runtime, which the offline tools must not load.

A safetensors file: 8-byte little-endian header length N, N bytes of JSON (name -> dtype,
shape, data_offsets relative to the end of the header; "__metadata__" of str -> str),
then the raw little-endian C-order tensor bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoint_tools.format.root import fsync_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
for _attr, _name in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _attr):
        ST_DTYPES[getattr(torch, _attr)] = _name


@dataclass(frozen=True)
class Entry:
    """One output tensor: its key in the file, shape, output dtype, size in bytes."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def plan_files(entries: list[Entry], max_bytes: int | None) -> list[tuple[str, list[Entry]]]:
    """Split entries (in order) into files: a new file starts when the next tensor would
    push the current one past max_bytes. None or a total that fits gives one file."""
    groups: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if max_bytes is not None and groups[-1] and size + e.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += e.nbytes
    if len(groups) == 1:
        return [(SINGLE_FILE, groups[0])]
    n = len(groups)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


def header(entries: list[Entry], metadata: dict[str, str] | None = None) -> bytes:
    meta: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for e in entries:
        meta[e.key] = {
            "dtype": ST_DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the spec allows trailing spaces; keeps data aligned
    return len(text).to_bytes(8, "little") + text


def write_file(
    path: Path,
    entries: list[Entry],
    blocks: Iterable[tuple[Entry, Iterator[torch.Tensor]]],
) -> None:
    """Write one safetensors file atomically (`<path>.tmp`, fsync, rename).

    Writing happens in a background thread so the next block decodes meanwhile (the
    write into the page cache is the largest single cost; measured ~65% of consolidation
    time). At most two writes are in flight, so a block must stay valid until two more
    blocks have been produced (CheckpointReader.iter_blocks(..., buffers=3)).

    Args:
        path: destination file.
        entries: the tensors of this file, in order (defines the header).
        blocks: for each entry in the same order, an iterator of flat contiguous tensors
            of the output dtype whose concatenation is the tensor in C order.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f, ThreadPoolExecutor(1, thread_name_prefix="st-write") as pool:
            f.write(header(entries))
            pending: deque[Future[int]] = deque()
            for entry, parts in blocks:
                written = 0
                for part in parts:
                    data = part.view(torch.uint8).numpy()
                    if len(pending) >= 2:
                        pending.popleft().result()
                    pending.append(pool.submit(f.write, data.data))
                    written += len(data)
                if written != entry.nbytes:  # internal invariant: plan and stream agree
                    raise AssertionError(f"{entry.key}: wrote {written} of {entry.nbytes} bytes")
            while pending:
                pending.popleft().result()
            fsync_file(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_index(out: Path, files: list[tuple[str, list[Entry]]]) -> Path:
    """Write model.safetensors.index.json (weight_map + total_size) atomically."""
    index = {
        "metadata": {"total_size": sum(e.nbytes for _, g in files for e in g)},
        "weight_map": {e.key: name for name, g in files for e in g},
    }
    path = out / INDEX_FILE
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
        fsync_file(f)
    os.replace(tmp, path)
    return path


def remove_stale(out: Path, keep: set[str]) -> None:
    """Remove safetensors files of an earlier export with another sharding (a stale index
    or shard next to a new single file would make loaders pick the wrong weights)."""
    for p in out.iterdir():
        if (
            p.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.fullmatch(p.name)
        ) and p.name not in keep:
            p.unlink(missing_ok=True)
