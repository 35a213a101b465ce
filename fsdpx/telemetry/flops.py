"""Model FLOPs and collective bytes per optimizer step, measured once.

`StepMeter.arm(module)` adds a forward pre-hook to the root module. The first forward
in training mode with grad enabled enters `torch.utils.flop_counter.FlopCounterMode`
and a dispatch mode counting collective payloads; `finish()` (the publisher calls it at
the optimizer-step boundary) leaves them, so everything the first optimizer step runs
(all accumulation micro-steps, forward and backward) is counted once. Eval forwards
before training (no_grad or eval mode) are not counted.

Numerics are untouched: both modes run every op unchanged and only count. The first
step runs slower (ops go through Python dispatch); later steps are not affected. FLOPs
are *model* FLOPs as torch's counter defines them (matmuls, convolutions, attention);
activation-checkpoint recomputation is counted too, so MFU is slightly optimistic
under full checkpointing. Not measured under torch.compile (the counter would force
graph breaks or recompiles): flops stay None.

Example::

    meter = StepMeter()
    meter.arm(model)
    loss = model(x).sum(); loss.backward(); opt.step()
    meter.finish()
    meter.flops_per_step, meter.comm_bytes_per_step
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

# Collective ops as the c10d dispatcher sees them (what FSDP2, DTensor and dist.* call).
_C10D_COLLECTIVES = frozenset(
    name
    for name in (
        "allreduce_",
        "allreduce_coalesced_",
        "allgather_",
        "_allgather_base_",
        "allgather_coalesced_",
        "allgather_into_tensor_coalesced_",
        "reduce_scatter_",
        "_reduce_scatter_base_",
        "reduce_scatter_tensor_coalesced_",
        "reduce_",
        "broadcast_",
        "gather_",
        "scatter_",
        "alltoall_",
        "alltoall_base_",
    )
)

# Dense bf16/fp16 tensor-core peak, TFLOP/s per device (vendor datasheets, no sparsity).
# Matched in order against torch.cuda.get_device_name(); unknown devices give MFU None.
PEAK_TFLOPS_16BIT: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),  # SXM
    ("H200", 989.4),
    ("GH200", 989.4),
    ("A100", 312.0),
)


def device_peak_tflops(device: torch.device, param_dtype: str) -> float | None:
    """Dense 16-bit peak of `device` in TFLOP/s, or None (CPU, unknown GPU, fp32 params:
    an fp32 run measured against a 16-bit peak would mislead).

    Example::

        device_peak_tflops(torch.device("cuda", 0), "bf16")   # 989.4 on an H100 SXM
    """
    if device.type != "cuda" or param_dtype not in ("bf16", "fp16"):
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS_16BIT if key in name), None)


def _nbytes(tree: Any) -> int:
    return sum(
        t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)
    )


class _CommBytesMode(TorchDispatchMode):
    """Sums the full (unsharded) payload of each c10d collective: the larger of its
    first two tensor arguments (output and input, in whichever order the op takes)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func.namespace == "c10d" and func._opname in _C10D_COLLECTIVES:
            sizes = [_nbytes(a) for a in args[:2]]
            self.bytes += max(sizes, default=0)
        return func(*args, **(kwargs or {}))


class StepMeter:
    """Measures FLOPs and collective bytes of one optimizer step (module docstring)."""

    def __init__(self) -> None:
        self.flops_per_step: int | None = None
        self.comm_bytes_per_step: int | None = None
        self._modes: list[Any] = []
        self._hook: Any = None

    @property
    def measuring(self) -> bool:
        return bool(self._modes)

    def arm(self, module: nn.Module) -> None:
        """Start measuring at `module`'s next training forward."""
        self._hook = module.register_forward_pre_hook(self._on_forward)

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        if self._modes or not (module.training and torch.is_grad_enabled()):
            return
        self._remove_hook()
        flop_mode = FlopCounterMode(display=False)
        comm_mode = _CommBytesMode()
        flop_mode.__enter__()
        comm_mode.__enter__()
        self._modes = [flop_mode, comm_mode]

    def finish(self) -> None:
        """Leave the modes and keep the totals (no-op when not measuring)."""
        if not self._modes:
            return
        flop_mode, comm_mode = self._modes
        self._modes = []
        # Inner mode first: dispatch modes form a stack.
        comm_mode.__exit__(None, None, None)
        flop_mode.__exit__(None, None, None)
        self.flops_per_step = int(flop_mode.get_total_flops())
        self.comm_bytes_per_step = int(comm_mode.bytes)

    def abort(self) -> None:
        """Leave the modes without results (an exception interrupted the step)."""
        if self._modes:
            flop_mode, comm_mode = self._modes
            self._modes = []
            comm_mode.__exit__(None, None, None)
            flop_mode.__exit__(None, None, None)
        self._remove_hook()

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
