"""Native ops for fsdpx, each with a pure-PyTorch reference it is bitwise equal to.

- `fsdpx.ops.adam`: `adam_step`, fused Adam/AdamW with unscale, inf/nan check and a bf16/fp16
  copy-out in the same memory pass (CPU; CUDA where a GPU is present).
- `fsdpx.ops.lamb`: `lamb_step`, DeepSpeed's Lamb in two passes (`lamb_moments`,
  `lamb_apply`; CPU), the trust ratio's norms summed over a sharded tensor's shards between.
- `fsdpx.ops.aio`: asynchronous file reads/writes into host tensors.
- `fsdpx.ops.quant`: blockwise int8 / fp8 quantization, and qgZ's fused dequantize-accumulate
  (`dequantize_accumulate_int8`).
- `fsdpx.ops.shuffle`: byte shuffle / unshuffle fused with CRC-32 for checkpoint chunks
  (`checkpoint_kernels()` is what the checkpoint runtime injects into the format).
- `fsdpx.ops.quant_int4`: blockwise int4, two values per byte, and its dequantize-accumulate
  (native CPU / CUDA kernels: [Note: int4 kernels]).

Schemas live in csrc/schemas.cpp (`TORCH_LIBRARY(fsdpx, m)`), kernels in csrc/*.cpp (CPU) and
csrc/cuda/ (CUDA). The library is built on first use into a per-user cache (see
`fsdpx.ops._loader`), or prebuilt with `FSDPX_BUILD_OPS=1 pip install --no-build-isolation .`.
Check what is in use with `load_ops()` / `load_cuda_ops()`.

Example::

    from fsdpx.ops import adam_step, load_ops
    print(load_ops())           # OpsStatus(available=True, ..., build_seconds=21.3)
    adam_step([p], [p.grad], [m], [v], lr=1e-3, step=1)
"""

from fsdpx.ops._loader import OpsStatus, load_cuda_ops, load_ops
from fsdpx.ops.adam import adam_step, adam_step_reference
from fsdpx.ops.aio import AioError, AioHandle, AioPool, aligned_empty
from fsdpx.ops.lamb import lamb_step
from fsdpx.ops.quant import (
    dequantize_accumulate_int8,
    dequantize_fp8,
    dequantize_int8,
    quantize_fp8,
    quantize_int8,
)
from fsdpx.ops.quant_int4 import dequantize_accumulate_int4, dequantize_int4, quantize_int4

__all__ = [
    "AioError",
    "AioHandle",
    "AioPool",
    "OpsStatus",
    "adam_step",
    "adam_step_reference",
    "aligned_empty",
    "dequantize_accumulate_int4",
    "dequantize_accumulate_int8",
    "dequantize_fp8",
    "dequantize_int4",
    "dequantize_int8",
    "lamb_step",
    "load_cuda_ops",
    "load_ops",
    "quantize_fp8",
    "quantize_int4",
    "quantize_int8",
]
