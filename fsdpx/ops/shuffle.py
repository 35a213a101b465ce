"""Byte shuffle / unshuffle fused with CRC-32 for checkpoint chunks (csrc/shuffle.cpp).

The contract and the reference implementation are `checkpoint_tools.format.kernels`
(`NumpyKernels`: numpy strided copies, then zlib.crc32): the offline tools must work
without a compiler, so the format package owns the reference and takes kernels as an
argument ([Note: codec injection]). `NativeKernels` here produces the same bytes and CRCs
in one pass over the data ([Note: one pass] in csrc/shuffle.cpp), with a PCLMULQDQ CRC
where the CPU has it. The runtime passes `checkpoint_kernels()` to the writer and reader.

torch releases the GIL around custom op calls, so the checkpoint's worker threads run
these kernels in parallel (benchmarks/checkpoint.py measures it: `--gil-check`).

Example::

    from fsdpx.ops.shuffle import checkpoint_kernels
    k = checkpoint_kernels()          # NativeKernels, or NumpyKernels if not built
    crcs = k.shuffle_crc(src, 4, dst, [True] * 4)
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence

import numpy as np
import torch

from checkpoint_tools.format.kernels import (
    DEFAULT_KERNELS,
    Buffer,
    Kernels,
    crc32_combine,
)
from fsdpx.ops._loader import load_ops

__all__ = ["NativeKernels", "checkpoint_kernels"]

# Below this a Python-level call costs more than zlib's own loop; zlib is used directly.
_NATIVE_CRC_MIN = 1 << 14


def _tensor(data: Buffer) -> torch.Tensor | None:
    """A uint8 tensor sharing `data`'s memory, or None when it cannot share it writably
    (torch refuses read-only buffers such as `bytes`)."""
    arr = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    if not arr.flags.writeable or arr.dtype != np.uint8 or arr.ndim != 1:
        return None
    return torch.from_numpy(arr)


class NativeKernels:
    """`checkpoint_tools.format.kernels.Kernels` on the native fsdpx ops (CPU)."""

    name = "native"

    def shuffle_crc(
        self, src: np.ndarray, size: int, dst: np.ndarray, want: Sequence[bool]
    ) -> list[int]:
        out = torch.ops.fsdpx.shuffle_crc(
            torch.from_numpy(src), torch.from_numpy(dst), size, [bool(w) for w in want]
        )
        return [int(c) for c in out.tolist()]

    def unshuffle_crc(
        self, planes: Sequence[Buffer | None], dst: np.ndarray, crc: bool
    ) -> list[int]:
        tensors = [None if p is None else _tensor(p) for p in planes]
        if any(t is None and p is not None for t, p in zip(tensors, planes, strict=True)):
            return DEFAULT_KERNELS.unshuffle_crc(planes, dst, crc)  # read-only input
        out = torch.ops.fsdpx.unshuffle_crc(tensors, torch.from_numpy(dst), crc)
        return [int(c) for c in out.tolist()]

    def crc32(self, data: Buffer, value: int = 0) -> int:
        if len(data) >= _NATIVE_CRC_MIN:
            t = _tensor(data)
            if t is not None:
                return int(torch.ops.fsdpx.crc32(t, value))
        return zlib.crc32(data.data if isinstance(data, np.ndarray) else data, value)

    def crc32_combine(self, crc_a: int, crc_b: int, len_b: int) -> int:
        return crc32_combine(crc_a, crc_b, len_b)


@functools.cache
def _register_fakes() -> None:
    @torch.library.register_fake("fsdpx::shuffle_crc")
    def _(src: torch.Tensor, dst: torch.Tensor, size: int, want: list[bool]) -> torch.Tensor:
        return src.new_empty((size,), dtype=torch.int64)

    @torch.library.register_fake("fsdpx::unshuffle_crc")
    def _(planes: list[torch.Tensor | None], dst: torch.Tensor, crc: bool) -> torch.Tensor:
        return dst.new_empty((len(planes),), dtype=torch.int64)

    @torch.library.register_fake("fsdpx::crc32")
    def _(data: torch.Tensor, value: int) -> torch.Tensor:
        return data.new_empty((), dtype=torch.int64)


@functools.cache
def native_available() -> bool:
    """Load the native CPU ops once per process (a warning says why when they cannot be)."""
    ok = load_ops().available
    if ok:
        _register_fakes()
    return ok


def checkpoint_kernels() -> Kernels:
    """The kernels the runtime injects into checkpoint writers and readers: native when
    the fsdpx ops are built, else the numpy reference (same bytes either way)."""
    return NativeKernels() if native_available() else DEFAULT_KERNELS
