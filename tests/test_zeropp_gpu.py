"""ZeRO++'s comm slot on CUDA (one device, NCCL, one rank): the quantized all-gather and
reduce-scatter run the CUDA quant kernels (int8 / fp8 / int4, and the fused
dequantize-accumulate) on the device, and give the same bits as the CPU references.

With one rank the collectives move nothing, so what is checked is the device side: the
payload layout, the kernels and the fp32 accumulation, bitwise against the CPU.

Run with `pytest -m gpu tests/test_zeropp_gpu.py` on a machine with a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fsdpx.comm.fsdp_slot import QuantizedAllGather, QuantizedReduceScatter
from fsdpx.ops.quant import (
    dequantize_fp8_reference,
    dequantize_int8_reference,
    quantize_fp8_reference,
    quantize_int8_reference,
)
from fsdpx.ops.quant_int4 import dequantize_int4_reference, quantize_int4_reference

pytestmark = pytest.mark.gpu


@pytest.fixture
def nccl(tmp_path: Path) -> Iterator[dist.ProcessGroup]:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(
        "nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    try:
        assert dist.group.WORLD is not None
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qwz_gather_on_cuda_matches_cpu_reference(
    nccl: dist.ProcessGroup, fmt: str, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(10_003, generator=g) * 3).to(dtype)
    out = torch.empty(10_003, dtype=dtype, device="cuda")
    QuantizedAllGather(fmt, 256)(out, x.cuda(), nccl)  # type: ignore[arg-type]
    quant = quantize_int8_reference if fmt == "int8" else quantize_fp8_reference
    dequant = dequantize_int8_reference if fmt == "int8" else dequantize_fp8_reference
    q, s = quant(x, block_size=256)
    expected = dequant(q, s, block_size=256, dtype=dtype)
    assert torch.equal(_bits(out), _bits(expected))


@pytest.mark.parametrize("bits", [8, 4])
def test_qgz_reduce_scatter_on_cuda_matches_cpu(nccl: dist.ProcessGroup, bits: int) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20_001, generator=g) * torch.exp2(
        torch.randint(-8, 8, (20_001,), generator=g).float()
    )
    out = torch.empty(20_001, device="cuda")
    QuantizedReduceScatter(bits, 128)(out, x.cuda(), nccl, dist.ReduceOp.AVG)  # type: ignore[arg-type]
    if bits == 8:
        q, s = quantize_int8_reference(x, block_size=128)
        expected = dequantize_int8_reference(q, s, block_size=128)
    else:
        p, s = quantize_int4_reference(x, block_size=128)
        expected = dequantize_int4_reference(p, s, numel=x.numel(), block_size=128)
    assert torch.equal(_bits(out), _bits(expected))
