"""What `grouped="auto"` runs for Linear -> activation -> Linear experts: "fused" or "grouped_mm".

`choose_grouped(device_type, dtype, hidden, ffn, grouped_mm_kernel=...)` is the rule, a pure
function of the device type, the experts' shapes and dtype and whether torch._grouped_mm has
its one-kernel path (`grouped_mm_kernel(device)`); fsdpx.moe.Experts asks it on the first
forward on each device and dtype (fsdpx/moe/experts.py).

[Note: auto grouped choice] Measured on one H100 (bf16, torch 2.11, 8 experts, top-2,
forward + backward, benchmarks/moe_grouped.py --device cuda; README, Measured), as speedups
over a per-expert module loop:

    hidden -> ffn (d * ffn per expert), rows        fused   torch._grouped_mm
    256 -> 512      (131,072), 8,192                 1.19x        2.51x
    4096 -> 14336   (58,720,256), 16,384             1.11x        0.91x

Small experts leave the GPU idle between a loop's kernel launches, and one grouped kernel
per Linear fills it; Mixtral-sized GEMMs fill it either way, and torch._grouped_mm (its bias
and gather are separate kernels, and its CUTLASS tiles lose to cuBLAS there) is slower than
the fused node's per-expert cuBLAS calls. So "auto" picks "grouped_mm" when the expert's
weight is small and "fused" otherwise. The two measurements bracket the crossover; where
between them it lies was not measured, so the threshold is their geometric mean (a factor of
21 from each): d * ffn <= 2,774,271 (e.g. Qwen3-30B-A3B's 2048 x 768 and OLMoE's
2048 x 1024 are below it; DeepSeek-V3's 7168 x 2048, GPT-OSS's 2880 x 2880 and Mixtral
above). An expert near it may be faster the other way: measure it with
benchmarks/moe_grouped.py --device cuda and pass `grouped=` explicitly.

The rule uses the weight's shape, not the rows of a step: the rows per expert change every
step with the router's load, and a choice that followed them would flip between two
summation orders (torch._grouped_mm rounds differently from the loop's kernels) from step to
step; the two measurements differ 448x in d * ffn and only 2x in rows, so they say nothing
about a row threshold anyway.

"grouped_mm" is chosen only where torch._grouped_mm has its one-kernel path, which is what
was measured: a CUDA (not ROCm) build on a device of compute capability 9.x or 10.x, with
bf16 rows and weights. Anywhere else (another GPU, fp32 or fp16, mixed dtypes under autocast)
torch 2.11's torch._grouped_mm is a per-group loop of matmuls after a device-to-host copy of
the offsets, which cannot beat the fused node. The kernel also wants 16-byte-aligned rows
(hidden and ffn multiples of 8 in bf16). On CPU "auto" is "fused" as before (torch's CPU
torch._grouped_mm is a per-group loop too; benchmarks/moe_grouped.py).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

SMALL_MEASURED = 256 * 512
"""d * ffn of the expert where torch._grouped_mm measured 2.51x the loop (fused 1.19x)."""
LARGE_MEASURED = 4096 * 14336
"""d * ffn of the expert (Mixtral's) where torch._grouped_mm measured 0.91x (fused 1.11x)."""
GROUPED_MM_MAX_WEIGHT = math.isqrt(SMALL_MEASURED * LARGE_MEASURED)
"""The largest d * ffn for which "auto" picks "grouped_mm" ([Note: auto grouped choice])."""

AutoMode = Literal["fused", "grouped_mm"]


def grouped_mm_kernel(device: torch.device) -> bool:
    """Whether torch._grouped_mm runs as one CUTLASS kernel on `device` (given bf16): a CUDA
    build that has it, not ROCm, a device of compute capability 9.x or 10.x."""
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm") or torch.version.hip:
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major in (9, 10)


def choose_grouped(
    device_type: str,
    dtype: torch.dtype | None,
    hidden: int,
    ffn: int,
    *,
    grouped_mm_kernel: bool,
) -> AutoMode:
    """The expert compute "auto" runs for a Linear(hidden, ffn) -> act -> Linear(ffn, hidden)
    expert ([Note: auto grouped choice]).

    Args:
        device_type: the rows' device type ("cpu", "cuda", ...).
        dtype: the dtype shared by the rows and the expert weights, None if they differ.
        hidden, ffn: the expert's input / output width and its hidden width.
        grouped_mm_kernel: torch._grouped_mm has its one-kernel path on this device
            (`grouped_mm_kernel(device)`).
    """
    if device_type != "cuda" or not grouped_mm_kernel or dtype != torch.bfloat16:
        return "fused"
    if hidden % 8 or ffn % 8:  # 16-byte-aligned bf16 rows
        return "fused"
    return "grouped_mm" if hidden * ffn <= GROUPED_MM_MAX_WEIGHT else "fused"
