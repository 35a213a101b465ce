"""Blockwise symmetric quantization for compressed collectives (qwZ / qgZ).

A tensor is flattened and cut into blocks of ``block_size`` consecutive elements (the last
block holds the remainder). Each block gets one float32 scale and its elements are stored in
one byte each:

* **int8**: ``scale = absmax / 127``, ``q = clamp(round(x / scale), -127, 127)`` (round half
  to even, like ``torch.round``); dequantized as ``q * scale``.
* **fp8 e4m3fn**: ``scale = absmax / 448``, ``q = clamp(x / scale, -448, 448).to(float8_e4m3fn)``
  (round to nearest even); dequantized as ``q.float() * scale``.

All arithmetic is float32 (bfloat16/float16 inputs are widened first); divisions are true
IEEE divisions, so the native kernels (``fsdpx/ops/csrc/quant.cpp``, ``csrc/cuda/quant.cu``)
are **bitwise equal** to the ``*_reference`` functions below, which are the specification.

Special cases (identical in every implementation):

* A block of zeros has ``scale = 0`` and quantizes to zeros; so does a block whose ``absmax``
  is so small (< ~1.8e-43 for int8) that ``absmax / 127`` underflows to zero.
* A block containing ``inf`` or ``nan`` gets ``scale = nan`` and all-zero ``q``: the whole
  block dequantizes to ``nan``. Overflow is poisoned rather than clipped so that an inf/nan
  check after the collective (fp16 loss scaling) still sees it.

Error bound (float32 output, every block whose ``scale`` is a normal float, i.e.
``absmax >= 127 * 2**-126`` for int8 and ``>= 448 * 2**-126`` for fp8)::

    int8: |x - dequantize(quantize(x))| <= scale / 2 + 2**-22 * absmax
    fp8:  |x - dequantize(quantize(x))| <= 2**-4 * |x| + 2**-10 * scale + 2**-22 * absmax

``scale / 2`` (int8) and ``2**-4 * |x|`` / ``2**-10 * scale`` (fp8: half an ulp of a normal
e4m3 value, or of the smallest subnormal step 2**-9) are the rounding to the 8-bit grid; the
``2**-22 * absmax`` term covers the two float32 roundings (the division and the product, each
at most 2**-24 relative, on values up to absmax). bfloat16/float16 outputs add their own
rounding of the result. For a subnormal scale (absmax below the thresholds above) the scale
itself is rounded coarsely and only ``|dequantize(quantize(x))| <= absmax + qmax * 2**-149``
holds (``qmax`` = 127 or 448; ``2**-149`` is the smallest subnormal float32).

Gloo has no float8 collectives: send fp8 payloads as ``q.view(torch.uint8)`` and view them
back with ``.view(torch.float8_e4m3fn)`` (a free reinterpretation, no copy).

``dequantize_accumulate_int8(acc, q, scales)`` is the fused ``acc += dequantize_int8(q,
scales)`` into a float32 buffer (the product rounded to float32, then the sum: the same
two roundings, so the same bits, as the unfused pair, without the temporary).

Callers: ZeRO++ in FSDP's comm slot (``fsdpx/comm/fsdp_slot.py``): qwZ quantizes each
module's all-gather input with ``quantize_int8`` / ``quantize_fp8`` and dequantizes every
rank's piece on arrival; qgZ's int8 path quantizes each reduce-scatter piece and sums what
it receives into a float32 buffer with ``dequantize_accumulate_int8``. The int4 format of
qgZ lives in ``fsdpx/ops/quant_int4.py``. ``benchmarks/ops_aio.py`` times these kernels.

Example:
    >>> x = torch.randn(10_000)
    >>> q, scales = quantize_int8(x, block_size=2048)
    >>> q.dtype, scales.shape
    (torch.int8, torch.Size([5]))
    >>> y = dequantize_int8(q, scales, block_size=2048)
    >>> bool(((x - y).abs() <= scales.max() / 2 * (1 + 2**-20)).all())
    True
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from fsdpx.ops._loader import load_cuda_ops, load_ops

__all__ = [
    "dequantize_accumulate_int8",
    "dequantize_accumulate_int8_reference",
    "dequantize_fp8",
    "dequantize_fp8_reference",
    "dequantize_int8",
    "dequantize_int8_reference",
    "quantize_fp8",
    "quantize_fp8_reference",
    "quantize_int8",
    "quantize_int8_reference",
]

INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def _check_input(x: Tensor, block_size: int) -> None:
    _check_block_size(block_size)
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(
            f"quantize expects a float32, bfloat16 or float16 tensor, got {x.dtype}; "
            "convert it first (x.float())"
        )


def _check_dequant(
    q: Tensor, scales: Tensor, block_size: int, q_dtype: torch.dtype, dtype: torch.dtype
) -> None:
    _check_block_size(block_size)
    if q.dtype != q_dtype:
        raise ValueError(f"expected q of dtype {q_dtype}, got {q.dtype}")
    if dtype not in _INPUT_DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    n_blocks = (q.numel() + block_size - 1) // block_size
    if scales.dtype != torch.float32 or scales.shape != (n_blocks,):
        raise ValueError(
            f"expected float32 scales of shape ({n_blocks},) for {q.numel()} elements in blocks "
            f"of {block_size}, got {scales.dtype} {tuple(scales.shape)}; pass the block_size "
            "used to quantize"
        )


def _blocks(x: Tensor, block_size: int) -> Tensor:
    """Flatten ``x`` to float32 and zero-pad it to whole blocks, shape (n_blocks, block_size)."""
    flat = x.reshape(-1).float()
    n_blocks = (flat.numel() + block_size - 1) // block_size
    pad = n_blocks * block_size - flat.numel()
    return torch.nn.functional.pad(flat, (0, pad)).view(n_blocks, block_size)


def _scales(blocks: Tensor, qmax: float) -> tuple[Tensor, Tensor, Tensor]:
    """Per-block (scale, divisor, non-finite mask); zero padding never changes an absmax."""
    absmax = blocks.abs().amax(dim=1)  # propagates nan
    bad = ~torch.isfinite(absmax)
    # Tensor / tensor: CUDA turns a division by a Python scalar into a multiplication by its
    # reciprocal, which can differ in the last bit from the kernels' true division.
    scale = absmax / torch.full_like(absmax, qmax)
    divisor = torch.where((scale == 0) | bad, torch.ones_like(scale), scale)
    return torch.where(bad, torch.full_like(scale, float("nan")), scale), divisor, bad


def quantize_int8_reference(x: Tensor, *, block_size: int) -> tuple[Tensor, Tensor]:
    """Pure-PyTorch int8 blockwise quantization; the specification of :func:`quantize_int8`."""
    _check_input(x, block_size)
    blocks = _blocks(x, block_size)
    scale, divisor, bad = _scales(blocks, INT8_MAX)
    q = torch.round(blocks / divisor[:, None]).clamp_(-INT8_MAX, INT8_MAX)
    q = q.masked_fill_(bad[:, None], 0).to(torch.int8)
    return q.reshape(-1)[: x.numel()].reshape(x.shape), scale


def quantize_fp8_reference(x: Tensor, *, block_size: int) -> tuple[Tensor, Tensor]:
    """Pure-PyTorch fp8 e4m3fn blockwise quantization; the specification of :func:`quantize_fp8`."""
    _check_input(x, block_size)
    blocks = _blocks(x, block_size)
    scale, divisor, bad = _scales(blocks, FP8_MAX)
    q = (blocks / divisor[:, None]).clamp_(-FP8_MAX, FP8_MAX).masked_fill_(bad[:, None], 0)
    q = q.to(torch.float8_e4m3fn)
    return q.reshape(-1)[: x.numel()].reshape(x.shape), scale


def _dequantize_reference(q: Tensor, scales: Tensor, block_size: int, dtype: torch.dtype) -> Tensor:
    flat = _blocks(q.float(), block_size) * scales[:, None]
    return flat.reshape(-1)[: q.numel()].reshape(q.shape).to(dtype)


def dequantize_int8_reference(
    q: Tensor, scales: Tensor, *, block_size: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Pure-PyTorch inverse of :func:`quantize_int8_reference`: ``(q * scale).to(dtype)``."""
    _check_dequant(q, scales, block_size, torch.int8, dtype)
    return _dequantize_reference(q, scales, block_size, dtype)


def dequantize_fp8_reference(
    q: Tensor, scales: Tensor, *, block_size: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Pure-PyTorch inverse of :func:`quantize_fp8_reference`: ``(q.float() * scale).to(dtype)``."""
    _check_dequant(q, scales, block_size, torch.float8_e4m3fn, dtype)
    return _dequantize_reference(q, scales, block_size, dtype)


@functools.cache
def _native(device_type: str) -> bool:
    """Load the native ops for ``device_type`` once per process; False means use the reference.

    The fake (meta) implementations can only be registered once the C++ library has defined
    the schemas, hence here rather than at import.
    """
    if device_type == "cpu":
        ok = load_ops().available
    elif device_type == "cuda":
        ok = load_ops().available and load_cuda_ops().available
    else:
        return False
    if ok:
        _register_fakes()
    return ok


@functools.cache
def _register_fakes() -> None:
    def fake_quantize(x: Tensor, block_size: int, q_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        n_blocks = (x.numel() + block_size - 1) // block_size
        return x.new_empty(x.shape, dtype=q_dtype), x.new_empty((n_blocks,), dtype=torch.float32)

    @torch.library.register_fake("fsdpx::quantize_int8")
    def _(x: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
        return fake_quantize(x, block_size, torch.int8)

    @torch.library.register_fake("fsdpx::quantize_fp8")
    def _(x: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
        return fake_quantize(x, block_size, torch.float8_e4m3fn)

    @torch.library.register_fake("fsdpx::dequantize_int8")
    def _(q: Tensor, scales: Tensor, block_size: int, dtype: torch.dtype) -> Tensor:
        return q.new_empty(q.shape, dtype=dtype)

    @torch.library.register_fake("fsdpx::dequantize_fp8")
    def _(q: Tensor, scales: Tensor, block_size: int, dtype: torch.dtype) -> Tensor:
        return q.new_empty(q.shape, dtype=dtype)

    @torch.library.register_fake("fsdpx::quantize_int4")
    def _(x: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
        n_blocks = (x.numel() + block_size - 1) // block_size
        packed = x.new_empty(((x.numel() + 1) // 2,), dtype=torch.uint8)
        return packed, x.new_empty((n_blocks,), dtype=torch.float32)

    @torch.library.register_fake("fsdpx::dequantize_int4")
    def _(
        packed: Tensor, scales: Tensor, numel: int, block_size: int, dtype: torch.dtype
    ) -> Tensor:
        return packed.new_empty((numel,), dtype=dtype)

    @torch.library.register_fake("fsdpx::dequantize_accumulate_int8")
    def _(acc: Tensor, q: Tensor, scales: Tensor, block_size: int) -> None:
        return None

    @torch.library.register_fake("fsdpx::dequantize_accumulate_int4")
    def _(acc: Tensor, packed: Tensor, scales: Tensor, block_size: int) -> None:
        return None


def quantize_int8(x: Tensor, *, block_size: int) -> tuple[Tensor, Tensor]:
    """Quantize ``x`` to int8 with one float32 scale per block (see the module docstring).

    Uses the native CPU/CUDA kernel when it is built, else the bitwise-equal reference.

    Args:
        x: float32, bfloat16 or float16 tensor, any shape (blocks run over ``x.reshape(-1)``).
        block_size: elements per scale; the last block may be partial.

    Returns:
        ``(q, scales)``: int8 ``q`` of ``x.shape`` and float32 ``scales`` of shape
        ``(ceil(x.numel() / block_size),)``.

    Example:
        >>> q, s = quantize_int8(torch.tensor([1.0, -2.0, 0.5]), block_size=2)
        >>> q.tolist(), s.tolist()
        ([64, -127, 127], [0.015748031437397003, 0.003937007859349251])
    """
    _check_input(x, block_size)
    if _native(x.device.type):
        q, scales = torch.ops.fsdpx.quantize_int8(x, block_size)
        return q, scales
    return quantize_int8_reference(x, block_size=block_size)


def dequantize_int8(
    q: Tensor, scales: Tensor, *, block_size: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Inverse of :func:`quantize_int8`: ``(q * scale).to(dtype)`` blockwise.

    Args:
        q: int8 tensor from :func:`quantize_int8`.
        scales: its float32 scales.
        block_size: the block size used to quantize.
        dtype: output dtype (float32, bfloat16 or float16).

    Returns:
        Tensor of ``q.shape`` and ``dtype``.

    Example:
        >>> q, s = quantize_int8(torch.tensor([1.0, -2.0]), block_size=2)
        >>> dequantize_int8(q, s, block_size=2).tolist()
        [1.0078740119934082, -2.0]
    """
    _check_dequant(q, scales, block_size, torch.int8, dtype)
    if _native(q.device.type):
        out: Tensor = torch.ops.fsdpx.dequantize_int8(q, scales, block_size, dtype)
        return out
    return _dequantize_reference(q, scales, block_size, dtype)


def quantize_fp8(x: Tensor, *, block_size: int) -> tuple[Tensor, Tensor]:
    """Quantize ``x`` to float8_e4m3fn with one float32 scale per block.

    Args:
        x: float32, bfloat16 or float16 tensor, any shape.
        block_size: elements per scale; the last block may be partial.

    Returns:
        ``(q, scales)``: float8_e4m3fn ``q`` of ``x.shape`` (send it through gloo as
        ``q.view(torch.uint8)``) and float32 ``scales`` of shape ``(ceil(numel / block_size),)``.

    Example:
        >>> q, s = quantize_fp8(torch.tensor([448.0, -1.0]), block_size=2)
        >>> q.float().tolist(), s.tolist()
        ([448.0, -1.0], [1.0])
    """
    _check_input(x, block_size)
    if _native(x.device.type):
        q, scales = torch.ops.fsdpx.quantize_fp8(x, block_size)
        return q, scales
    return quantize_fp8_reference(x, block_size=block_size)


def dequantize_fp8(
    q: Tensor, scales: Tensor, *, block_size: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Inverse of :func:`quantize_fp8`: ``(q.float() * scale).to(dtype)`` blockwise.

    Args:
        q: float8_e4m3fn tensor from :func:`quantize_fp8` (``.view(torch.float8_e4m3fn)`` a
            uint8 payload received from gloo first).
        scales: its float32 scales.
        block_size: the block size used to quantize.
        dtype: output dtype (float32, bfloat16 or float16).

    Returns:
        Tensor of ``q.shape`` and ``dtype``.

    Example:
        >>> q, s = quantize_fp8(torch.tensor([448.0, -1.0]), block_size=2)
        >>> dequantize_fp8(q, s, block_size=2).tolist()
        [448.0, -1.0]
    """
    _check_dequant(q, scales, block_size, torch.float8_e4m3fn, dtype)
    if _native(q.device.type):
        out: Tensor = torch.ops.fsdpx.dequantize_fp8(q, scales, block_size, dtype)
        return out
    return _dequantize_reference(q, scales, block_size, dtype)


def _check_accumulator(acc: Tensor, numel: int) -> None:
    """``acc`` must be a contiguous float32 tensor of ``numel`` elements (what it sums into)."""
    if acc.dtype != torch.float32 or not acc.is_contiguous() or acc.numel() != numel:
        raise ValueError(
            f"expected a contiguous float32 accumulator of {numel} elements, got a "
            f"{'contiguous' if acc.is_contiguous() else 'non-contiguous'} {acc.dtype} tensor "
            f"of {acc.numel()}; sum into a torch.zeros(numel) buffer"
        )


def dequantize_accumulate_int8_reference(
    acc: Tensor, q: Tensor, scales: Tensor, *, block_size: int
) -> None:
    """Pure-PyTorch :func:`dequantize_accumulate_int8`: ``acc += dequantize_int8(q, scales)``."""
    _check_dequant(q, scales, block_size, torch.int8, torch.float32)
    _check_accumulator(acc, q.numel())
    acc += _dequantize_reference(q, scales, block_size, torch.float32).view(acc.shape)


def dequantize_accumulate_int8(acc: Tensor, q: Tensor, scales: Tensor, *, block_size: int) -> None:
    """``acc += dequantize_int8(q, scales, block_size=block_size)`` in one pass, in place.

    Bitwise equal to the unfused pair (module docstring); qgZ sums what every rank sent
    with it.

    Args:
        acc: contiguous float32 tensor with ``q.numel()`` elements (any shape; the sum runs
            over the flattened elements).
        q: int8 tensor from :func:`quantize_int8`.
        scales: its float32 scales.
        block_size: the block size used to quantize.

    Example:
        >>> acc = torch.ones(2)
        >>> q, s = quantize_int8(torch.tensor([1.0, -2.0]), block_size=2)
        >>> dequantize_accumulate_int8(acc, q, s, block_size=2)
        >>> acc.tolist()
        [2.007874011993408, -1.0]
    """
    _check_dequant(q, scales, block_size, torch.int8, torch.float32)
    _check_accumulator(acc, q.numel())
    if _native(q.device.type):
        torch.ops.fsdpx.dequantize_accumulate_int8(acc, q, scales, block_size)
        return
    dequantize_accumulate_int8_reference(acc, q, scales, block_size=block_size)
