"""Blockwise symmetric int4 quantization, two values per byte (qgZ's 4-bit gradients).

Same contract as the int8 format of ``fsdpx/ops/quant.py`` with ``qmax = 7``: the flattened
tensor is cut into blocks of ``block_size`` elements (the last partial), each block gets one
float32 ``scale = absmax / 7`` and ``q = clamp(round(x / scale), -7, 7)`` (round half to
even), dequantized as ``q * scale``; zero blocks have scale 0, blocks with inf/nan get a nan
scale and all-zero ``q`` (the block dequantizes to nan). All arithmetic is float32.

Packing: element ``2i`` is the low nibble and ``2i + 1`` the high nibble of byte ``i``, each
stored as ``q + 8`` (1..15; 8 is zero); an odd element count leaves a zero high nibble in
the last byte. ``block_size`` must be even so a block never shares a byte with the next
(each rank's piece of a qgZ all-to-all is quantized on its own).

Error bound (normal scale, i.e. ``absmax >= 7 * 2**-126``), as for int8 with 7 for 127::

    |x - dequantize_int4(quantize_int4(x))| <= scale / 2 + 2**-22 * absmax

[Note: int4 has no native kernel] These are the pure-PyTorch functions and run on any
device through ATen (CPU and CUDA alike); there is no fused C++/CUDA int4 kernel yet, so
there is no ``*_reference`` twin to be bitwise equal to. The int8 path of qgZ uses the
native kernels.

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

from fsdpx.ops.quant import _blocks, _check_input, _scales

__all__ = ["INT4_MAX", "dequantize_int4", "packed_int4_bytes", "quantize_int4"]

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


def quantize_int4(x: Tensor, *, block_size: int) -> tuple[Tensor, Tensor]:
    """Quantize ``x.reshape(-1)`` to packed int4 with one float32 scale per block.

    Returns:
        ``(packed, scales)``: uint8 ``packed`` of shape ``(ceil(numel / 2),)`` and float32
        ``scales`` of shape ``(ceil(numel / block_size),)``.
    """
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


def dequantize_int4(
    packed: Tensor,
    scales: Tensor,
    *,
    numel: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Inverse of :func:`quantize_int4`: the first ``numel`` values, 1-D, in ``dtype``."""
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
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    lo = (packed & 0xF).to(torch.float32) - 8
    hi = (packed >> 4).to(torch.float32) - 8
    q = torch.stack([lo, hi], dim=1).reshape(-1)[:numel]
    out = _blocks(q, block_size) * scales[:, None]
    return out.reshape(-1)[:numel].to(dtype)
