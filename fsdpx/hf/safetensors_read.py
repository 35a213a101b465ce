"""Reading parts of safetensors files: only the bytes a rank's shards cover.

[Note: byte-range loading] A safetensors file is an 8-byte little-endian header length N,
N bytes of JSON (name -> dtype, shape, data_offsets relative to the end of the header),
then the raw little-endian tensor bytes, row-major. A rank's shard of a tensor is a
rectangle of the global tensor (a set of index runs per dimension, see local_slices.py);
each maximal row-major run of it is one `os.pread` of exactly its bytes into the shard's
buffer. Nothing is memory-mapped (safetensors' own `safe_open` maps the file): mapped
pages count towards the RSS of every process that touches them and stay cached in it.
`bytes_read` counts every byte read, the header included, so tests can prove a rank read
only its share.

The header is checked before any tensor byte is read, and a lie is an error naming the
file and the tensor: a declared header length beyond the file or above 100 MB, a dtype
name safetensors does not have, a byte size that does not equal shape x item size,
offsets beyond the data the file holds (a truncated file), and overlapping tensors.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from fsdpx.errors import SafetensorsError

# SafetensorsError is defined in fsdpx.errors ([Note: one error tree]) and raised here.

__all__ = ["SafetensorsError", "SafetensorsFile", "TensorInfo"]

MAX_HEADER_BYTES = 100 * 2**20
"""safetensors' own limit on the JSON header (its Rust reader refuses larger ones)."""

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
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    """Absolute file offset of the first byte."""
    nbytes: int


class SafetensorsFile:
    """One open safetensors file: its validated header and positional reads.

    Example::

        with SafetensorsFile("model.safetensors") as f:
            out = torch.empty(2, 4096, dtype=f.tensors["lm_head.weight"].dtype)
            f.read_into("lm_head.weight", out, [(0, 2 * 4096)])  # its first two rows
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.bytes_read = 0
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self.tensors = self._read_header()
        except BaseException:
            os.close(self._fd)
            raise

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _fail(self, what: str) -> SafetensorsError:
        return SafetensorsError(f"{self.path}: {what}")

    def _pread(self, n: int, offset: int) -> bytes:
        data = os.pread(self._fd, n, offset)
        self.bytes_read += len(data)
        return data

    def _read_header(self) -> dict[str, TensorInfo]:
        size = os.fstat(self._fd).st_size
        if size < 8:
            raise self._fail(f"file is {size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(self._pread(8, 0), "little")
        if n > MAX_HEADER_BYTES:
            raise self._fail(
                f"header length {n} is above the {MAX_HEADER_BYTES}-byte limit: not a "
                "safetensors file, or a damaged one"
            )
        if 8 + n > size:
            raise self._fail(
                f"header length {n} runs past the end of the file ({size} bytes): truncated"
            )
        try:
            raw = json.loads(self._pread(n, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._fail(f"header is not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise self._fail("header is not a JSON object")
        data_start, data_size = 8 + n, size - 8 - n
        tensors: dict[str, TensorInfo] = {}
        for name, spec in raw.items():
            if name == "__metadata__":
                continue
            tensors[name] = self._tensor_info(name, spec, data_start, data_size)
        spans = sorted((t.begin, t.begin + t.nbytes, t.name) for t in tensors.values())
        for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:], strict=False):
            if begin_b < end_a:
                raise self._fail(f"tensors {a!r} and {b!r} overlap in the data section")
        return tensors

    def _tensor_info(self, name: str, spec: object, data_start: int, data_size: int) -> TensorInfo:
        if not isinstance(spec, dict) or {"dtype", "shape", "data_offsets"} - spec.keys():
            raise self._fail(f"tensor {name!r}: entry needs dtype, shape and data_offsets")
        dtype = DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
        if dtype is None:
            raise self._fail(
                f"tensor {name!r}: dtype {spec['dtype']!r} is not one of {', '.join(DTYPES)}"
            )
        shape, offsets = spec["shape"], spec["data_offsets"]
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise self._fail(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise self._fail(f"tensor {name!r}: data_offsets {offsets!r} are not [begin, end]")
        numel = 1
        for d in shape:
            numel *= d
        expected = numel * torch.empty((), dtype=dtype).element_size()
        if offsets[1] - offsets[0] != expected:
            raise self._fail(
                f"tensor {name!r}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, "
                f"but {spec['dtype']} {shape} needs {expected}"
            )
        if offsets[1] > data_size:
            raise self._fail(
                f"tensor {name!r}: ends at data byte {offsets[1]}, but the file holds only "
                f"{data_size} data bytes: truncated"
            )
        return TensorInfo(name, dtype, tuple(shape), data_start + offsets[0], expected)

    def read_into(self, name: str, out: torch.Tensor, runs: list[tuple[int, int]]) -> None:
        """Fill the contiguous CPU tensor `out` (the tensor's dtype) with the element runs
        `(start, count)` of tensor `name`, in order, back to back."""
        info = self.tensors[name]
        item = out.element_size()
        buf = memoryview(out.view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]
        pos = 0
        for start, count in runs:
            n = count * item
            if n == 0:
                continue
            got = os.preadv(self._fd, [buf[pos : pos + n]], info.begin + start * item)
            self.bytes_read += got
            if got != n:
                raise self._fail(
                    f"tensor {name!r}: read {got} of {n} bytes at offset "
                    f"{info.begin + start * item}: the file shrank while loading"
                )
            pos += n
