"""The engine's boundary step with an offloaded optimizer: unscaling and clipping become
one factor that the fused CPU step applies while it reads each gradient, instead of two
extra passes over the device gradients. The engine gets it as an
fsdpx.optimizer_step.OptimizerStep strategy from fsdpx.shard."""

from __future__ import annotations

import torch

from fsdpx.clip import total_grad_norm
from fsdpx.offload.optimizer import OffloadedAdamW


def offloaded_step(
    optimizer: OffloadedAdamW,
    params: list[torch.nn.Parameter],
    inv_scale: float,
    max_norm: float,
    pp_group: torch.distributed.ProcessGroup | None = None,
) -> float | None:
    """Step `optimizer` with gradients multiplied by `inv_scale` (1 / loss scale) and
    clipped to `max_norm` (0: no clipping). Returns the unscaled gradient norm when
    clipping, else None.

    The clipping coefficient is torch's (`max_norm / (norm + 1e-6)`, at most 1, in fp32),
    so without loss scaling the gradients are scaled by the very fp32 number that
    torch.nn.utils.clip_grads_with_norm_ multiplies by: results match the non-offloaded
    engine bitwise.

    Example::

        norm = offloaded_step(opt, params, 1.0 / scaler.scale, 1.0)
    """
    factor = inv_scale
    norm_value = None
    if max_norm > 0:
        # The gradients are still loss-scaled here: a 16-bit norm of fp16 gradients times
        # 65536 overflows, so 16-bit gradients are normed in fp32.
        fp32_grads = all(p.grad is None or p.grad.dtype == torch.float32 for p in params)
        norm = total_grad_norm(params, pp_group=pp_group, in_fp32=not fp32_grads)
        if inv_scale != 1.0:
            norm = norm * inv_scale
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        norm_value = float(norm)
        factor = float(coef) * inv_scale
    optimizer.step(inv_grad_scale=factor)
    return norm_value


class OffloadedStep:
    """The OptimizerStep of an OffloadedAdamW (fsdpx.optimizer_step.OptimizerStep).

    Args:
        optimizer: the offloaded optimizer.
        params: the parameters it steps (for the gradient norm).

    Example::

        step = OffloadedStep(opt, params); norm = step.step(1.0, max_norm=1.0)
    """

    owns_resources = True

    def __init__(self, optimizer: OffloadedAdamW, params: list[torch.nn.Parameter]) -> None:
        self._optimizer = optimizer
        self._params = params

    def prepare_backward(self, is_boundary: bool) -> None:
        self._optimizer.prepare_backward(is_boundary)

    def step(self, inv_scale: float, max_norm: float) -> float | None:
        # Unscaling and clipping are folded into the offloaded step's one pass.
        return offloaded_step(self._optimizer, self._params, inv_scale, max_norm)

    def close(self) -> None:
        self._optimizer.close()
