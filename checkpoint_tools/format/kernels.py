"""The byte-level kernels the codec runs over every chunk: byte shuffle / unshuffle fused
with CRC-32, plain CRC-32 and CRC-32 combination.

[Note: codec injection] `checkpoint_tools` runs where no compiler may exist, so it never
imports `fsdpx` (DESIGN.md clarification 6). The writer and reader take a `Kernels` object;
the default here is numpy + zlib (two passes over the data: shuffle, then CRC). The
training runtime injects `fsdpx.ops.shuffle.NativeKernels`, one C++ pass that shuffles
and checksums each plane while it is still in cache. Both produce the very same bytes and
checksums (tests/test_ckpt_planes.py compares them), so a checkpoint written with either
reads with either.

Contract of every implementation (`size` is the element size, `n = len(src) // size`):

* `shuffle_crc(src, size, dst, want)`: `dst[k * n + i] = src[i * size + k]`; returns the
  CRC-32 of each plane `dst[k * n : (k + 1) * n]` for which `want[k]` is true, else 0
  (planes that will be compressed need no CRC of their raw bytes).
* `unshuffle_crc(planes, dst, crc)`: `planes` has one entry per byte position k (so
  `size = len(planes)`), each an n-byte buffer or None; for each given plane,
  `dst[i * size + k] = planes[k][i]`; bytes of missing planes are left alone. Returns the
  CRC-32 of each given plane (0 for missing ones, and for all when `crc` is False).
* `crc32(data, value)`: zlib's `crc32`.
* `crc32_combine(crc_a, crc_b, len_b)`: CRC-32 of a + b from the CRCs of a and b (zlib).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np

Buffer = bytes | bytearray | memoryview | np.ndarray

_POLY = 0xEDB88320  # CRC-32 (ISO-HDLC), bit-reflected


class Kernels(Protocol):
    """What the codec needs; see the module docstring for the exact contract."""

    name: str

    def shuffle_crc(
        self, src: np.ndarray, size: int, dst: np.ndarray, want: Sequence[bool]
    ) -> list[int]: ...

    def unshuffle_crc(
        self, planes: Sequence[Buffer | None], dst: np.ndarray, crc: bool
    ) -> list[int]: ...

    def crc32(self, data: Buffer, value: int = 0) -> int: ...

    def crc32_combine(self, crc_a: int, crc_b: int, len_b: int) -> int: ...


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (both bit-reflected), as in zlib's crc32.c."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


@functools.cache
def _x2n_table() -> tuple[int, ...]:
    """x^(2^k) modulo the polynomial, k = 0..31."""
    p, table = 1 << 30, []  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return tuple(table)


@functools.lru_cache(maxsize=1024)
def _x8n(len_b: int) -> int:
    """x^(8 * len_b) modulo the polynomial. Cached: a writer's plane and part lengths
    repeat from chunk to chunk, so a combine is then one `_multmodp` (~10 us)."""
    table = _x2n_table()
    p, k, n = 1 << 31, 3, len_b  # x^0; k = 3 because len_b counts bytes (8 = 2^3 bits)
    while n:
        if n & 1:
            p = _multmodp(table[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """zlib's crc32_combine: CRC-32 of a + b = crc_a * x^(8 * len_b) + crc_b."""
    return _multmodp(_x8n(len_b), crc_a) ^ crc_b


class NumpyKernels:
    """The reference kernels: numpy strided copies and zlib.crc32 (both release the GIL on
    large buffers), two passes over the data."""

    name = "numpy"

    def shuffle_crc(
        self, src: np.ndarray, size: int, dst: np.ndarray, want: Sequence[bool]
    ) -> list[int]:
        n = len(src) // size
        if size == 1:
            dst[...] = src
        else:
            dst.reshape(size, n)[...] = src.reshape(n, size).T
        return [zlib.crc32(dst[k * n : (k + 1) * n].data) if w else 0 for k, w in enumerate(want)]

    def unshuffle_crc(
        self, planes: Sequence[Buffer | None], dst: np.ndarray, crc: bool
    ) -> list[int]:
        size = len(planes)
        out = []
        for k, plane in enumerate(planes):
            if plane is None:
                out.append(0)
                continue
            arr = np.frombuffer(plane, dtype=np.uint8)
            # One strided write per plane is ~3x faster than a transposed 2-D assignment.
            dst[k::size] = arr
            out.append(zlib.crc32(arr.data) if crc else 0)
        return out

    def crc32(self, data: Buffer, value: int = 0) -> int:
        return zlib.crc32(data.data if isinstance(data, np.ndarray) else data, value)

    def crc32_combine(self, crc_a: int, crc_b: int, len_b: int) -> int:
        return crc32_combine(crc_a, crc_b, len_b)


DEFAULT_KERNELS: Kernels = NumpyKernels()
