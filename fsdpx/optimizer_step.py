"""How the engine runs the optimizer at an accumulation boundary: a strategy handed to it
by fsdpx.shard, so the engine knows nothing about where optimizer state lives.

[Note: step strategies] `PlainStep` unscales the gradients, clips them and calls
`optimizer.step()`: any torch optimizer. An optimizer whose state is elsewhere brings its
own (fsdpx.offload.step.OffloadedStep folds unscaling and clipping into one factor that its
fused step applies, and arms gradient streaming before each backward).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from fsdpx.clip import clip_grad_norm_
from fsdpx.precision import unscale_grads_


class OptimizerStep(Protocol):
    """The engine's optimizer step ([Note: step strategies])."""

    owns_resources: bool
    """close() releases something (swap files, hooks): the engine then calls it, after
    any checkpoint in flight is committed."""

    def prepare_backward(self, is_boundary: bool) -> None:
        """Called before each backward; `is_boundary`: it ends an accumulation window."""

    def step(self, inv_scale: float, max_norm: float) -> float | None:
        """Step with gradients times `inv_scale` (1 / loss scale), clipped to `max_norm`
        (0: no clipping). Returns the unscaled gradient norm when clipping, else None."""

    def close(self) -> None:
        """Release what the optimizer holds beyond training steps (idempotent)."""


class PlainStep:
    """Unscale, clip, `optimizer.step()` (the step of any torch optimizer).

    Args:
        optimizer: the optimizer.
        params: the parameters with gradients (unscaled and clipped in place).
        pp_group: the pipeline group the gradient norm is summed over, or None.
        norm_once: copies of a parameter another stage also holds, left out of the norm
            ([Note: tied parameters across stages] in fsdpx/pipeline_tied.py).

    Example::

        norm = PlainStep(opt, params).step(inv_scale=1.0, max_norm=1.0)
    """

    owns_resources = False

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: list[torch.nn.Parameter],
        pp_group: torch.distributed.ProcessGroup | None = None,
        norm_once: Sequence[torch.nn.Parameter] = (),
    ) -> None:
        self._optimizer = optimizer
        self._params = params
        self._pp_group = pp_group
        self._replicas = list(norm_once)

    def prepare_backward(self, is_boundary: bool) -> None:
        pass  # gradients stay where backward put them

    def step(self, inv_scale: float, max_norm: float) -> float | None:
        if inv_scale != 1.0:
            unscale_grads_(self._params, inv_scale)
        norm = None
        if max_norm > 0:
            norm = float(
                clip_grad_norm_(
                    self._params, max_norm, pp_group=self._pp_group, replicas=self._replicas
                )
            )
        self._optimizer.step()
        return norm

    def close(self) -> None:
        pass  # nothing held
