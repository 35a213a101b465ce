"""1-bit Adam: Adam whose data-parallel exchange, after a warmup of full-precision steps,
is the error-compensated 1-bit all-reduce of the momentum (fsdpx.comm.onebit).

[Note: 1-bit Adam's two phases] For steps 1..freeze_step the optimizer is Adam on the
averaged gradient (an fp32 all-reduce, counted by fsdpx.comm). Then the variance
``exp_avg_sq`` is frozen, each rank folds its *local* gradient into its momentum and the
ranks average the momentum with `compressed_all_reduce` (sign + scale, error feedback on
the worker and the server side); all ranks get the same momentum, so replicas stay equal.
The update is ``m_hat / (sqrt(v_hat) + eps) + weight_decay * p``, scaled by lr, with
``m_hat = m / (1 - beta1^t)`` and ``v_hat = v / (1 - beta2^min(t, freeze_step))`` (the
frozen variance keeps the correction of the step it froze at). DeepSpeed's OnebitAdam
(up to 0.16; 0.19.8 no longer ships it) accepted ``bias_correction`` but never applied it,
which is why its configs need freeze_step in the thousands; fsdpx corrects by default, as
Adam does, so a short warmup works (``bias_correction=False`` gives DeepSpeed's update).

[Note: who owns the gradient exchange] Under fsdpx.shard at ZeRO stage 0 FSDP2 would
all-reduce every gradient in backward (its replicate axis), and FSDP2 (torch 2.13) has no
way to keep the *unreduced* gradient as the sharded `.grad`: `set_requires_all_reduce(False)`
parks it in a private accumulator until the next reducing backward, and
`set_requires_gradient_sync(False)` keeps it on the unsharded parameter. So with
``optimizer.type = "onebit_adam"`` (or "zero_one_adam", fsdpx/zero_one_adam.py)
fsdpx.zero.apply_zero shards over the one-rank shard axis only (a full replica, no FSDP
gradient collective), and `attach` installs FSDP2's
all-reduce hook, which averages the gradients in backward during warmup (so clipping and
the loss scaler see averaged gradients, as with Adam) and does nothing afterwards, when the
exchange moves into `step`. Without `attach` (plain tensors, one replica per rank) `step`
averages the warmup gradients itself.

[Note: zero-variance mask] A sign cannot say zero: after the compressed exchange every
element of the momentum is +-scale, including those whose gradient was exactly zero all
through warmup (an embedding row of a token not yet seen). Their frozen variance is 0, so
the update would be scale / eps: an explosion. DeepSpeed asked users for an
``exp_avg_mask``; fsdpx derives it: momentum elements whose frozen variance is exactly 0
are zeroed after each exchange (every rank has the same variance, so the same mask).

The error buffers are per rank and are not in the state dict: engine checkpoints keep each
rank's own ([Note: per-rank optimizer state] in fsdpx/checkpoint/state.py), so a resume at the
same world size continues exactly; at another world size (where they cannot be resharded:
rank 0 logs a warning, [Note: per-rank optimizer state at another world size] in
fsdpx/checkpoint/state.py) and after torch's `load_state_dict`, they restart at zero (as
DeepSpeed's OnebitAdam reset them on every load), which costs one step of compensation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from fsdpx.comm import (
    OneBitState,
    compressed_all_reduce,
    counted,
    take_over_gradient_exchange,
)
from fsdpx.dtensor import to_local


class OneBitAdam(torch.optim.Optimizer):
    """Adam with 1-bit compressed momentum exchange after `freeze_step` steps
    ([Note: 1-bit Adam's two phases]); every rank holds a full replica of its parameters.

    Args:
        params: parameters or parameter groups (fp32; plain tensors or DTensors on a
            one-rank mesh, i.e. replicas).
        lr, betas, eps: as in Adam.
        weight_decay: decoupled (added to the update, as DeepSpeed's OnebitAdam does).
        freeze_step: number of full-precision warmup steps (DeepSpeed's ``freeze_step``).
        bias_correction: False uses m and v uncorrected (DeepSpeed's OnebitAdam behaviour).
        group: the data-parallel process group the replicas live on (default: the world;
            a single process with no process group trains as plain Adam).

    Example::

        opt = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=100)
        loss.backward(); opt.step(); opt.zero_grad()
    """

    exchanges_gradients: ClassVar[bool] = True
    """fsdpx.shard `attach`es an optimizer with this set to the sharded model: it exchanges
    the gradients itself, in place of the data-parallel all-reduce."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"OneBitAdam: lr must be >= 0, got {lr}")
        if not eps >= 0.0:
            raise ValueError(f"OneBitAdam: eps must be >= 0, got {eps}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"OneBitAdam: betas must each be in [0, 1), got {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"OneBitAdam: weight_decay must be >= 0, got {weight_decay}")
        if freeze_step < 1:
            # The variance is estimated only during warmup: with none, the update is m / eps.
            raise ValueError(
                f"OneBitAdam: freeze_step must be >= 1 (the number of full-precision warmup "
                f"steps, which estimate the variance that is then frozen), got {freeze_step}"
            )
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction
        )
        super().__init__(params, defaults)
        self.freeze_step = freeze_step
        self.group = group
        self._attached = False
        self._errors: dict[torch.Tensor, OneBitState] = {}

    @property
    def world_size(self) -> int:
        if not dist.is_initialized():
            return 1
        return dist.get_world_size(self.group)

    @property
    def compressing(self) -> bool:
        """Whether the next step exchanges compressed momentum (warmup is over)."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state:
                    return int(state["step"]) >= self.freeze_step
        return False

    def attach(self, model: nn.Module) -> None:
        """Take over the gradient exchange of an FSDP2 model built by fsdpx.shard with
        ``optimizer.type = "onebit_adam"`` ([Note: who owns the gradient exchange]).

        Raises:
            ValueError: a parameter is sharded or replicated by FSDP itself (its mesh has
                more than one rank): FSDP would all-reduce the gradients too.
        """
        take_over_gradient_exchange(
            model, self._warmup_hook, owner="OneBitAdam", optimizer_type="onebit_adam"
        )
        self._attached = True

    def _warmup_hook(self, reduce_output: torch.Tensor) -> None:
        # FSDP2 calls this in backward with the flat gradient of one module's parameters.
        if self.world_size > 1 and not self.compressing:
            counted.all_reduce(reduce_output, self.group)
            reduce_output.div_(self.world_size)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step over every parameter that has a gradient ([Note: 1-bit Adam's two
        phases]). Returns the closure's loss, or None."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressing = self.compressing
        w = self.world_size
        grads = [
            to_local(p.grad) for g in self.param_groups for p in g["params"] if p.grad is not None
        ]
        if not compressing and not self._attached and w > 1 and grads:
            flat = torch.cat([g.reshape(-1).float() for g in grads])
            counted.all_reduce(flat, self.group)
            flat.div_(w)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = to_local(p.grad)
                local = to_local(p)
                if local.dtype != torch.float32:
                    raise TypeError(
                        f"OneBitAdam keeps fp32 parameters (the compressed exchange is fp32); "
                        f"got {local.dtype}. Use precision.param_dtype fp32 with a "
                        "mixed-precision compute dtype instead"
                    )
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                m, v = to_local(state["exp_avg"]), to_local(state["exp_avg_sq"])
                state["step"] += 1
                t = int(state["step"])
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                if not compressing:
                    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                elif w > 1:
                    if p not in self._errors:
                        self._errors[p] = OneBitState.zeros(m.numel(), w, m.device)
                    compressed_all_reduce(m, self._errors[p], self.group)
                    # [Note: zero-variance mask]
                    m.masked_fill_(v == 0, 0.0)
                m_hat_scale, v_hat = 1.0, v
                if group["bias_correction"]:
                    m_hat_scale = 1 / (1 - beta1**t)
                    v_hat = v / (1 - beta2 ** min(t, self.freeze_step))
                update = (m * m_hat_scale) / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"] > 0:
                    update.add_(local, alpha=group["weight_decay"])
                local.add_(update, alpha=-group["lr"])
        return loss

    def rank_local_state(self) -> dict[str, torch.Tensor]:
        """This rank's error-feedback buffers, by parameter index ([Note: per-rank optimizer
        state] in fsdpx/checkpoint/state.py)."""
        out: dict[str, torch.Tensor] = {}
        for i, p in enumerate(p for g in self.param_groups for p in g["params"]):
            if p in self._errors:
                out.update(self._errors[p].as_dict(f"{i}/"))
        return out

    def load_rank_local_state(self, found: dict[str, torch.Tensor]) -> None:
        """Restore what rank_local_state returned; empty: the feedback restarts at zero."""
        self._errors.clear()
        for i, p in enumerate(p for g in self.param_groups for p in g["params"]):
            state = OneBitState.from_dict(found, f"{i}/", to_local(p).device)
            if state is not None:
                self._errors[p] = state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._errors.clear()  # per-rank error feedback restarts at zero (module docstring)
