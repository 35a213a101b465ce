"""1-bit Lamb (Li et al., 2021, "1-bit LAMB: Communication Efficient Large-Scale Large-Batch
Training with LAMB's Convergence Speed"; DeepSpeed's OnebitLamb): Lamb whose data-parallel
exchange, after `freeze_step` full-precision steps, is the error-compensated 1-bit all-reduce
of the momentum (fsdpx.comm.onebit), with the trust ratio frozen and rescaled.

[Note: 1-bit Lamb's two phases] Steps 1..freeze_step are Lamb on the averaged gradient (the
FSDP2 all-reduce hook in backward, or `step` itself without `attach`): m and v updated, the
update ``u = m / (sqrt(v) + eps) + weight_decay * p`` scaled by the trust ratio
``clamp(||p|| / ||u||, min_coeff, max_coeff)`` (1 when a norm is 0), and an exponential
average of the trust ratios kept (`coeff_beta`; `lamb_coeff_freeze`). At freeze_step v is
frozen and a copy `exp_avg_sq_fresh` keeps being updated. After it, each rank folds its local
gradient into m; the momenta of all parameters, each multiplied by a scaling coefficient that
evens out their magnitudes (the mean RMS of all momenta over its own, fixed at the first
compressed step), are averaged in one compressed all-reduce. The gradient is reconstructed
from the new and the previous momentum and updates `exp_avg_sq_fresh`; the trust ratio is
`lamb_coeff_freeze * factor`, where factor = max(frozen denominator / fresh denominator)
(blended towards 1 by the weight-decay share of the update), clamped to
[factor_min, factor_max] and to within factor_threshold of the previous factor.

As DeepSpeed's OnebitLamb (0.14-0.16; 0.19.8 no longer ships it) the update has no bias
correction (its `bias_correction` argument is never read). Differences, each deliberate: step
1 is the first update (DeepSpeed's first `step()` only set up buffers); momentum elements
whose frozen variance is exactly 0 are zeroed after each exchange ([Note: zero-variance mask]
in fsdpx/onebit_adam.py; DeepSpeed asked for `exp_avg_mask`); a parameter whose momentum is
all zero at the freeze gets scaling coefficient 1 (DeepSpeed divided by zero); the error
buffers are per rank, not in the state dict: engine checkpoints keep each rank's own
([Note: per-rank optimizer state] in fsdpx/checkpoint/state.py), so a resume at the same
world size continues exactly; at another world size (with a warning on rank 0: [Note:
per-rank optimizer state at another world size] there) and after `load_state_dict` they
restart at zero (as DeepSpeed's did on every load).
"""

from __future__ import annotations

import math
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


class OneBitLamb(torch.optim.Optimizer):
    """1-bit Lamb ([Note: 1-bit Lamb's two phases]); every rank holds a full replica.

    Args:
        params: parameters or parameter groups (fp32 replicas).
        lr, betas, eps, weight_decay, max_coeff, min_coeff: as in fsdpx.lamb.Lamb.
        freeze_step: full-precision warmup steps.
        coeff_beta: the averaging factor of the warmup trust ratios.
        factor_max, factor_min, factor_threshold: the clamps of the compressed-stage factor.
        group: the data-parallel process group of the replicas (default: the world).
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
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        freeze_step: int = 100000,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"OneBitLamb: lr must be >= 0, got {lr}")
        if not eps > 0.0:
            raise ValueError(f"OneBitLamb: eps must be > 0 (it divides), got {eps}")
        if not all(0.0 <= b < 1.0 for b in (*betas, coeff_beta)):
            raise ValueError(
                f"OneBitLamb: betas and coeff_beta must be in [0, 1), got {betas}, {coeff_beta}"
            )
        if not weight_decay >= 0.0:
            raise ValueError(f"OneBitLamb: weight_decay must be >= 0, got {weight_decay}")
        if freeze_step < 1:
            raise ValueError(
                f"OneBitLamb: freeze_step must be >= 1 (the warmup steps that estimate the "
                f"variance and the trust ratio), got {freeze_step}"
            )
        if not (0 < min_coeff <= max_coeff and 0 < factor_min <= factor_max):
            raise ValueError(
                f"OneBitLamb: need 0 < min_coeff <= max_coeff and 0 < factor_min <= factor_max; "
                f"got {min_coeff}, {max_coeff}, {factor_min}, {factor_max}"
            )
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.freeze_step = freeze_step
        self.coeff_beta = coeff_beta
        self.factor_max = factor_max
        self.factor_min = factor_min
        self.factor_threshold = factor_threshold
        self.group = group
        self.lamb_coeffs: list[float] = []
        self._attached = False
        self._error: OneBitState | None = None

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    @property
    def compressing(self) -> bool:
        """Whether the next step exchanges compressed momentum (warmup is over)."""
        for state in self.state.values():
            if "step" in state:
                return int(state["step"]) >= self.freeze_step
        return False

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios of the last step (DeepSpeed's)."""
        return list(self.lamb_coeffs)

    def attach(self, model: nn.Module) -> None:
        """Take over the gradient exchange of an FSDP2 model built by fsdpx.shard at ZeRO
        stage 0 (as fsdpx.onebit_adam.OneBitAdam.attach)."""
        take_over_gradient_exchange(
            model, self._warmup_hook, owner="OneBitLamb", optimizer_type="onebit_lamb"
        )
        self._attached = True

    def _warmup_hook(self, reduce_output: torch.Tensor) -> None:
        if self.world_size > 1 and not self.compressing:
            counted.all_reduce(reduce_output, self.group)
            reduce_output.div_(self.world_size)

    def _stepped(self) -> list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]]:
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                local = to_local(p)
                if local.dtype != torch.float32:
                    raise TypeError(
                        f"OneBitLamb keeps fp32 parameters (the compressed exchange is fp32); "
                        f"got {local.dtype}. Use precision.param_dtype fp32 with a "
                        "mixed-precision compute dtype instead"
                    )
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["lamb_coeff_freeze"] = 0.0
                    state["last_factor"] = 1.0
                    # Like the parameter (a DTensor replica under fsdpx.shard), so
                    # checkpoints save and load the state with the parameter's layout.
                    for key in ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh"):
                        state[key] = torch.zeros_like(p)
                out.append((group, p, local))
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step ([Note: 1-bit Lamb's two phases]). Returns the closure's loss, or None."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressing = self.compressing
        items = self._stepped()
        self.lamb_coeffs = []
        if not compressing:
            if not self._attached and self.world_size > 1 and items:
                _average([_grad(p) for _, p, _ in items], self.world_size, self.group)
            for group, p, local in items:
                self._warmup_step(group, self.state[p], _grad(p).float(), local)
            return loss
        self._compressed_step(items)
        return loss

    def _warmup_step(
        self, group: dict[str, Any], state: dict[str, Any], g: torch.Tensor, p: torch.Tensor
    ) -> None:
        beta1, beta2 = group["betas"]
        m, v = to_local(state["exp_avg"]), to_local(state["exp_avg_sq"])
        state["step"] += 1
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if state["step"] == self.freeze_step:
            to_local(state["exp_avg_sq_fresh"]).copy_(v)
        update = m / (v.sqrt() + group["eps"])
        if group["weight_decay"] > 0:
            update.add_(p, alpha=group["weight_decay"])
        w_norm, u_norm = float(p.norm()), float(update.norm())
        coeff = 1.0
        if w_norm != 0 and u_norm != 0:
            coeff = min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"])
        if coeff != 1.0:  # DeepSpeed's rule: a trust ratio of exactly 1 is not averaged in
            b = self.coeff_beta
            state["lamb_coeff_freeze"] = b * state["lamb_coeff_freeze"] + (1 - b) * coeff
        self.lamb_coeffs.append(coeff)
        p.add_(update, alpha=-group["lr"] * coeff)

    def _compressed_step(
        self, items: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]]
    ) -> None:
        states = [self.state[p] for _, p, _ in items]
        moms = [to_local(s["exp_avg"]) for s in states]
        if states and "scaling_coeff" not in states[0]:
            rms = [float(m.norm()) / math.sqrt(m.numel()) for m in moms]
            united = sum(rms) / len(rms)
            for s, r in zip(states, rms, strict=True):
                s["scaling_coeff"] = united / r if r > 0 else 1.0
        last = [m.clone() for m in moms]
        for (group, p, _), s, m in zip(items, states, moms, strict=True):
            beta1 = group["betas"][0]
            s["step"] += 1
            m.mul_(beta1).add_(_grad(p).float(), alpha=1 - beta1)
            m.mul_(s["scaling_coeff"])
        if self.world_size > 1 and states:
            flat = torch.cat([m.reshape(-1) for m in moms])
            if self._error is None:
                self._error = OneBitState.zeros(flat.numel(), self.world_size, flat.device)
            compressed_all_reduce(flat, self._error, self.group)
            offset = 0
            for m in moms:
                m.copy_(flat[offset : offset + m.numel()].view_as(m))
                offset += m.numel()
        for (group, _, p), s, m, m_last in zip(items, states, moms, last, strict=True):
            beta1, beta2 = group["betas"]
            v, fresh = to_local(s["exp_avg_sq"]), to_local(s["exp_avg_sq_fresh"])
            m.div_(s["scaling_coeff"])
            m.masked_fill_(v == 0, 0.0)  # [Note: zero-variance mask] in fsdpx/onebit_adam.py
            grad = (m - m_last * beta1) / (1 - beta1)
            fresh.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = v.sqrt().add_(group["eps"])
            prelim = m / denom
            update = prelim + group["weight_decay"] * p if group["weight_decay"] > 0 else prelim
            u_norm = float(update.norm())
            factor = float((denom / fresh.sqrt().add_(group["eps"])).max())
            if group["weight_decay"] > 0:
                ratio = min(1.0, float(prelim.norm()) / u_norm) if u_norm > 0 else 1.0
                factor = factor * ratio + (1.0 - ratio)
            factor = min(max(factor, self.factor_min), self.factor_max)
            last_factor = s["last_factor"]
            factor = min(factor, last_factor * (1.0 + self.factor_threshold))
            factor = max(factor, last_factor * (1.0 - self.factor_threshold))
            s["last_factor"] = factor
            coeff = s["lamb_coeff_freeze"] * factor
            self.lamb_coeffs.append(coeff)
            p.add_(update, alpha=-group["lr"] * coeff)

    def rank_local_state(self) -> dict[str, torch.Tensor]:
        """This rank's error-feedback buffers ([Note: per-rank optimizer state] in
        fsdpx/checkpoint/state.py)."""
        return {} if self._error is None else self._error.as_dict()

    def load_rank_local_state(self, found: dict[str, torch.Tensor]) -> None:
        """Restore what rank_local_state returned; empty: the feedback restarts at zero."""
        device = to_local(self.param_groups[0]["params"][0]).device
        self._error = OneBitState.from_dict(found, "", device)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._error = None  # per-rank error feedback restarts at zero (module docstring)


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None  # only parameters with a gradient are stepped
    return to_local(p.grad)


def _average(grads: list[torch.Tensor], world: int, group: dist.ProcessGroup | None) -> None:
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    counted.all_reduce(flat, group)
    flat.div_(world)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
