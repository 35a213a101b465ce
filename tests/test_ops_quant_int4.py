"""fsdpx.ops.quant_int4 and the fused dequantize-accumulate ops: native CPU kernels bitwise
equal to the pure-PyTorch references (packing, odd lengths, zero / inf / nan blocks),
opcheck on every new op, the fallback without the native library, and input validation;
the CUDA twins (gpu marker) bitwise against the CPU references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck

from fsdpx.ops import quant, quant_int4
from fsdpx.ops._loader import load_cuda_ops, load_ops
from fsdpx.ops.quant import (
    dequantize_accumulate_int8,
    dequantize_accumulate_int8_reference,
    quantize_int8,
)
from fsdpx.ops.quant_int4 import (
    dequantize_accumulate_int4,
    dequantize_accumulate_int4_reference,
    dequantize_int4,
    dequantize_int4_reference,
    quantize_int4,
    quantize_int4_reference,
)
from tests.test_ops_quant import DTYPES, _assert_same_values, _bits, _data


@pytest.fixture
def native() -> None:
    status = load_ops()
    if not status.available:
        pytest.skip(f"native fsdpx ops unavailable: {status.reason}")


def _check_native_case(
    x: torch.Tensor, block_size: int, out_dtype: torch.dtype, device: str = "cpu"
) -> None:
    """Native (on ``device``) vs the CPU references: quantize, dequantize, and both
    accumulate ops into the same non-trivial float32 buffer."""
    n = x.numel()
    p, s = quantize_int4(x.to(device), block_size=block_size)
    p2, s2 = quantize_int4_reference(x, block_size=block_size)
    assert p.shape == ((n + 1) // 2,) and p.dtype == torch.uint8
    assert torch.equal(p.cpu(), p2) and torch.equal(_bits(s.cpu()), _bits(s2))
    _assert_same_values(
        dequantize_int4(p, s, numel=n, block_size=block_size, dtype=out_dtype).cpu(),
        dequantize_int4_reference(p2, s2, numel=n, block_size=block_size, dtype=out_dtype),
    )
    start = torch.linspace(-3.0, 3.0, n)
    acc, acc2 = start.clone().to(device), start.clone()
    dequantize_accumulate_int4(acc, p, s, block_size=block_size)
    dequantize_accumulate_int4_reference(acc2, p2, s2, block_size=block_size)
    _assert_same_values(acc.cpu(), acc2)
    q8, s8 = quantize_int8(x, block_size=block_size)
    acc, acc2 = start.clone().to(device), start.clone()
    dequantize_accumulate_int8(acc, q8.to(device), s8.to(device), block_size=block_size)
    dequantize_accumulate_int8_reference(acc2, q8, s8, block_size=block_size)
    _assert_same_values(acc.cpu(), acc2)


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(0, 2000),
    half_block=st.integers(1, 300),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(DTYPES),
    out_dtype=st.sampled_from(DTYPES),
    specials=st.booleans(),
)
def test_native_bitwise_equals_reference(
    n: int, half_block: int, seed: int, dtype: torch.dtype, out_dtype: torch.dtype, specials: bool
) -> None:
    if not load_ops().available:
        pytest.skip("native fsdpx ops unavailable")
    x = _data(n, seed, specials=specials).to(dtype)
    _check_native_case(x.reshape(-1, 1) if n else x, 2 * half_block, out_dtype)


def test_zero_inf_nan_blocks_and_odd_tail(native: None) -> None:
    inf, nan = float("inf"), float("nan")
    # blocks of 4: zeros, one with inf, one with nan, then a partial block of 3 (odd tail).
    x = torch.tensor([0.0, -0.0, 0.0, 0.0, 1, inf, 2, 3, nan, 1, 1, 1, -7, 3.5, 1])
    for fn in (quantize_int4, quantize_int4_reference):
        p, s = fn(x, block_size=4)
        assert s[0].item() == 0.0 and bool(s[1:3].isnan().all()) and s[3].item() == 1.0
        assert p.tolist() == [0x88, 0x88, 0x88, 0x88, 0x88, 0x88, 0xC1, 0x89]
        y = dequantize_int4(p, s, numel=15, block_size=4)
        assert torch.equal(y[:4], torch.zeros(4)) and bool(y[4:12].isnan().all())
        assert y[12:].tolist() == [-7.0, 4.0, 1.0]  # 3.5 rounds half to even
        acc = torch.ones(15)
        dequantize_accumulate_int4(acc, p, s, block_size=4)
        assert bool(acc[4:12].isnan().all()) and acc[12:].tolist() == [-6.0, 5.0, 2.0]


def test_docstring_examples() -> None:
    p, s = quantize_int4(torch.tensor([7.0, -3.5, 1.0]), block_size=2)
    assert p.tolist() == [79, 143]
    assert dequantize_int4(p, s, numel=3, block_size=2).tolist() == [7.0, -4.0, 1.0]
    acc = torch.ones(3)
    dequantize_accumulate_int4(acc, p, s, block_size=2)
    assert acc.tolist() == [8.0, -3.0, 2.0]
    acc = torch.ones(2)
    q, s = quantize_int8(torch.tensor([1.0, -2.0]), block_size=2)
    dequantize_accumulate_int8(acc, q, s, block_size=2)
    assert acc.tolist() == [torch.tensor(1.0 + 128 / 127).item(), -1.0]


def test_falls_back_to_reference_without_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the native library (quant._native False: it could not be built, or
    FSDPX_OPS_DISABLE=1) every int4 / accumulate entry point runs its reference."""
    calls: list[str] = []
    real = torch.ops.fsdpx

    class Refuse:
        def __getattr__(self, name: str) -> object:
            calls.append(name)
            return getattr(real, name)

    monkeypatch.setattr(quant_int4, "_native", lambda device_type: False)
    monkeypatch.setattr(quant, "_native", lambda device_type: False)
    monkeypatch.setattr(torch, "ops", type("Ops", (), {"fsdpx": Refuse()})())
    x = _data(999, 3, specials=True)
    p, s = quantize_int4(x, block_size=100)
    p2, s2 = quantize_int4_reference(x, block_size=100)
    assert torch.equal(p, p2) and torch.equal(_bits(s), _bits(s2))
    y = dequantize_int4(p, s, numel=999, block_size=100)
    _assert_same_values(y, dequantize_int4_reference(p, s, numel=999, block_size=100))
    acc = torch.zeros(999)
    dequantize_accumulate_int4(acc, p, s, block_size=100)
    _assert_same_values(acc, y)
    q8, s8 = quant.quantize_int8_reference(x, block_size=100)
    acc = torch.zeros(999)
    dequantize_accumulate_int8(acc, q8, s8, block_size=100)
    _assert_same_values(acc, quant.dequantize_int8_reference(q8, s8, block_size=100))
    assert calls == []  # no native op was looked up


@pytest.mark.parametrize("n,block_size", [(105, 8), (0, 4)])
def test_opcheck(n: int, block_size: int, native: None) -> None:
    quant._native("cpu")  # registers the fake implementations
    x = torch.randn(n)
    ops = torch.ops.fsdpx
    opcheck(ops.quantize_int4.default, (x, block_size))
    opcheck(ops.quantize_int4.default, (x.to(torch.bfloat16), block_size))
    p, s = ops.quantize_int4(x, block_size)
    for dtype in (torch.float32, torch.bfloat16):
        opcheck(ops.dequantize_int4.default, (p, s, n, block_size, dtype))
    opcheck(ops.dequantize_accumulate_int4.default, (torch.randn(n), p, s, block_size))
    q, s8 = ops.quantize_int8(x, block_size)
    opcheck(ops.dequantize_accumulate_int8.default, (torch.randn(n), q, s8, block_size))


def test_bad_inputs_are_value_errors() -> None:
    x = torch.randn(10)
    with pytest.raises(ValueError, match="int4 block_size must be even"):
        quantize_int4(x, block_size=3)
    p, s = quantize_int4(x, block_size=4)
    with pytest.raises(ValueError, match=r"expected a uint8 payload of shape \(6,\) for 11"):
        dequantize_int4(p, s, numel=11, block_size=4)
    with pytest.raises(ValueError, match=r"expected float32 scales of shape \(5,\) for 10"):
        dequantize_int4(p, s, numel=10, block_size=2)
    with pytest.raises(
        ValueError,
        match="expected a contiguous float32 accumulator of 10 elements, got a "
        "contiguous torch.bfloat16 tensor of 10; sum into a torch.zeros",
    ):
        dequantize_accumulate_int4(torch.zeros(10, dtype=torch.bfloat16), p, s, block_size=4)
    with pytest.raises(ValueError, match="got a non-contiguous torch.float32 tensor of 10"):
        dequantize_accumulate_int4(torch.zeros(10, 2)[:, 0], p, s, block_size=4)
    q, s8 = quantize_int8(x, block_size=4)
    with pytest.raises(
        ValueError, match="accumulator of 10 elements, got a contiguous torch.float32 tensor of 9"
    ):
        dequantize_accumulate_int8(torch.zeros(9), q, s8, block_size=4)


def test_native_op_checks_its_inputs(native: None) -> None:
    """The C++ op called directly (bypassing the wrappers' checks) refuses bad payloads."""
    p, s = torch.ops.fsdpx.quantize_int4(torch.randn(10), 4)
    with pytest.raises(RuntimeError, match="expected a Byte payload of 4 elements for 7 values"):
        torch.ops.fsdpx.dequantize_accumulate_int4(torch.zeros(7), p, s, 4)
    with pytest.raises(RuntimeError, match="block_size must be even"):
        torch.ops.fsdpx.quantize_int4(torch.randn(10), 3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_bitwise_equals_cpu_reference(dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    status = load_cuda_ops()
    assert status.available, status.reason
    for n, block_size in [(1, 2), (1001, 128), (4097, 64), (1 << 20, 2048), (12345, 1000)]:
        x = _data(n, n, specials=True).to(dtype)
        for out_dtype in DTYPES:
            _check_native_case(x, block_size, out_dtype, device="cuda")
    quant._native("cuda")
    ops = torch.ops.fsdpx
    x = torch.randn(301, device="cuda")
    opcheck(ops.quantize_int4.default, (x, 64))
    p, s = ops.quantize_int4(x, 64)
    opcheck(ops.dequantize_int4.default, (p, s, 301, 64, torch.float32))
    opcheck(ops.dequantize_accumulate_int4.default, (torch.randn(301, device="cuda"), p, s, 64))
