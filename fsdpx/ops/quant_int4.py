"""Blockwise symmetric int4 quantization, two values per byte (qgZ's 4-bit gradients).

Same contract as the int8 format of ``fsdpx/ops/quant.py`` with ``qmax = 7``: the flattened
tensor is cut into blocks of ``block_size`` elements (the last partial), each block gets one
float32 ``scale = absmax / 7`` and ``q = clamp(round(x / scale), -7, 7)`` (round half to
even), dequantized as ``q * scale``; zero blocks have scale 0, blocks with inf/nan get a nan
scale and all-zero ``q`` (the block dequantizes to nan). All arithmetic is float32.

Packing: element ``2i`` is the low nibble and ``2i + 1`` the high nibble of byte ``i``, each
stored as ``q + 8`` (1..15; 8 is zero); an odd element count leaves a zero high nibble in
the last byte. ``block_size`` must be even so a block never shares a byte with the next
(each rank's piece of a qgZ all-to-all is quantized on its own, and each kernel thread owns
whole bytes).

Error bound (normal scale, i.e. ``absmax >= 7 * 2**-126``), as for int8 with 7 for 127::

    |x - dequantize_int4(quantize_int4(x))| <= scale / 2 + 2**-22 * absmax

[Note: int4 kernels] ``quantize_int4`` / ``dequantize_int4`` / ``dequantize_accumulate_int4``
run the native CPU (``csrc/quant.cpp``) and CUDA (``csrc/cuda/quant.cu``) kernels, built
and dispatched like the int8 ones (``fsdpx/ops/_loader.py``; fake implementations in
``fsdpx/ops/quant.py``), and are bitwise equal to the ``*_reference`` functions below, the
specification; where the native library cannot be built (or ``FSDPX_OPS_DISABLE=1``) the
references run instead, on any device. The packing is done in the quantize kernel itself
(one pass over the input, no int8 intermediate), and ``dequantize_accumulate_int4`` is
qgZ's fused ``acc += dequantize_int4(...)`` into its float32 sum (one rounding for the
product, one for the sum, as unfused; no temporary).

Example:
    >>> packed, scales = quantize_int4(torch.tensor([7.0, -3.5, 1.0]), block_size=2)
    >>> packed.tolist(), scales.tolist()
    ([79, 143], [1.0, 0.1428571492433548])
    >>> dequantize_int4(packed, scales, numel=3, block_size=2).tolist()
    [7.0, -4.0, 1.0]
"""

from __future__ import annotations

import torch
from torch import Tensor

from fsdpx.ops.quant import _blocks, _check_accumulator, _check_input, _native, _scales

__all__ = [
    "INT4_MAX",
    "dequantize_accumulate_int4",
    "dequantize_accumulate_int4_reference",
    "dequantize_int4",
    "dequantize_int4_reference",
    "packed_int4_bytes",
    "quantize_int4",
    "quantize_int4_reference",
]

INT4_MAX = 7.0
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_even(block_size: int) -> None:
    if block_size % 2:
        raise ValueError(
            f"int4 block_size must be even (two values share a byte), got {block_size}"
        )


def packed_int4_bytes(numel: int) -> int:
    """Bytes of the packed payload for ``numel`` values."""
    return (numel + 1) // 2


def _check_payload(packed: Tensor, scales: Tensor, numel: int, block_size: int) -> None:
    _check_even(block_size)
    if packed.dtype != torch.uint8 or packed.shape != (packed_int4_bytes(numel),):
        raise ValueError(
            f"expected a uint8 payload of shape ({packed_int4_bytes(numel)},) for {numel} "
            f"values, got {packed.dtype} {tuple(packed.shape)}"
        )
    n_blocks = (numel + block_size - 1) // block_size
    if scales.dtype != torch.float32 or scales.shape != (n_blocks,):
        raise ValueError(
            f"expected float32 scales of shape ({n_blocks},) for {numel} values in blocks of "
            f"{block_size}, got {scales.dtype} {tuple(scales.shape)}"
        )


def quantize_int4_reference(x: Tensor, *, block_size: int) -> tuple[Tensor, Tensor]:
    """Pure-PyTorch int4 quantization and packing; the specification of :func:`quantize_int4`."""
    _check_input(x, block_size)
    _check_even(block_size)
    n = x.numel()
    blocks = _blocks(x, block_size)
    scale, divisor, bad = _scales(blocks, INT4_MAX)
    q = torch.round(blocks / divisor[:, None]).clamp_(-INT4_MAX, INT4_MAX)
    q = q.masked_fill_(bad[:, None], 0).reshape(-1)[:n]
    nib = (q + 8).to(torch.uint8)
    if n % 2:
        nib = torch.cat([nib, nib.new_full((1,), 8)])
    pairs = nib.view(-1, 2)
    packed = pairs[:, 0] | (pairs[:, 1] << 4)
    return packed, scale


def _dequantize_reference(
    packed: Tensor, scales: Tensor, numel: int, block_size: int, dtype: torch.dtype
) -> Tensor:
    lo = (packed & 0xF).to(torch.float32) - 8
    hi = (packed >> 4).to(torch.float32) - 8
    q = torch.stack([lo, hi], dim=1).reshape(-1)[:numel]
    out = _blocks(q, block_size) * scales[:, None]
    return out.reshape(-1)[:numel].to(dtype)


def dequantize_int4_reference(
    packed: Tensor,
    scales: Tensor,
    *,
    numel: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Pure-PyTorch inverse of :func:`quantize_int4_reference`; the specification of
    :func:`dequantize_int4`."""
    _check_payload(packed, scales, numel, block_size)
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    return _dequantize_reference(packed, scales, numel, block_size, dtype)


def dequantize_accumulate_int4_reference(
    acc: Tensor, packed: Tensor, scales: Tensor, *, block_size: int
) -> None:
    """Pure-PyTorch :func:`dequantize_accumulate_int4`: ``acc += dequantize_int4(...)``."""
    _check_accumulator(acc, acc.numel())
    _check_payload(packed, scales, acc.numel(), block_size)
    acc += _dequantize_reference(packed, scales, acc.numel(), block_size, torch.float32).view(
        acc.shape
    )


def quantize_int4(x: Tensor, *, block_size: int) -> tuple[Tensor, Tensor]:
    """Quantize ``x.reshape(-1)`` to packed int4 with one float32 scale per block.

    Uses the native CPU/CUDA kernel when it is built, else the bitwise-equal reference.

    Args:
        x: float32, bfloat16 or float16 tensor, any shape.
        block_size: elements per scale, even; the last block may be partial.

    Returns:
        ``(packed, scales)``: uint8 ``packed`` of shape ``(ceil(numel / 2),)`` and float32
        ``scales`` of shape ``(ceil(numel / block_size),)``.
    """
    _check_input(x, block_size)
    _check_even(block_size)
    if _native(x.device.type):
        packed, scales = torch.ops.fsdpx.quantize_int4(x, block_size)
        return packed, scales
    return quantize_int4_reference(x, block_size=block_size)


def dequantize_int4(
    packed: Tensor,
    scales: Tensor,
    *,
    numel: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Inverse of :func:`quantize_int4`: the first ``numel`` values, 1-D, in ``dtype``.

    Args:
        packed: uint8 payload from :func:`quantize_int4`.
        scales: its float32 scales.
        numel: how many values it holds.
        block_size: the block size used to quantize.
        dtype: output dtype (float32, bfloat16 or float16).
    """
    _check_payload(packed, scales, numel, block_size)
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    if _native(packed.device.type):
        out: Tensor = torch.ops.fsdpx.dequantize_int4(packed, scales, numel, block_size, dtype)
        return out
    return _dequantize_reference(packed, scales, numel, block_size, dtype)


def dequantize_accumulate_int4(
    acc: Tensor, packed: Tensor, scales: Tensor, *, block_size: int
) -> None:
    """``acc += dequantize_int4(packed, scales, numel=acc.numel(), ...)`` in one pass, in place.

    Args:
        acc: contiguous float32 tensor; its element count is the number of packed values.
        packed: uint8 payload from :func:`quantize_int4`.
        scales: its float32 scales.
        block_size: the block size used to quantize.

    Example:
        >>> acc = torch.ones(3)
        >>> packed, scales = quantize_int4(torch.tensor([7.0, -3.5, 1.0]), block_size=2)
        >>> dequantize_accumulate_int4(acc, packed, scales, block_size=2)
        >>> acc.tolist()
        [8.0, -3.0, 2.0]
    """
    _check_accumulator(acc, acc.numel())
    _check_payload(packed, scales, acc.numel(), block_size)
    if _native(packed.device.type):
        torch.ops.fsdpx.dequantize_accumulate_int4(acc, packed, scales, block_size)
        return
    dequantize_accumulate_int4_reference(acc, packed, scales, block_size=block_size)
