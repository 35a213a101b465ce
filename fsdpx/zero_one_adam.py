"""0/1 Adam (Lu et al., 2022, "Maximizing Communication Efficiency for Large-scale Training
via 0/1 Adam"; DeepSpeed's ZeroOneAdam): Adam whose variance is refreshed on an
exponentially thinning schedule and whose momentum, after the variance freezes, is
synchronised only every few *local* steps, each exchange the error-compensated 1-bit
all-reduce of fsdpx.comm.onebit.

[Note: 0/1 Adam's schedule] Step t (from 1), with DeepSpeed's parameters:

- t <= var_freeze_step, t a multiple of var_interval (a *variance step*): the gradient was
  averaged in fp32 (the FSDP2 all-reduce hook in backward, or `step` itself without
  `attach`); m and v are updated with it. After var_update_scaler variance steps the interval
  doubles (1, 2, 4, ...).
- t <= var_freeze_step, other steps: the local gradients are averaged by the compressed
  all-reduce and only m is updated.
- t > var_freeze_step (v frozen): each rank folds its local gradient into m and steps alone
  (no communication), summing the learning rates. Every local_step_interval steps the
  ranks synchronise ([Note: 0/1 Adam's synchronisation]). local_step_interval doubles
  every local_step_scaler steps, up to local_step_clipper.

Every step applies ``p -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)``.

[Note: 0/1 Adam's bias correction] DeepSpeed's ZeroOneAdam accepted `bias_correction` but
never read it: m_hat = m, v_hat = v. v is an average that starts at 0 and, frozen after
k variance updates, stays at (1 - beta2^k) of the gradients' mean square: with the
doubling interval k is small (40 for var_freeze_step 80 and var_update_scaler 16), so
the uncorrected step is 1 / sqrt(1 - 0.999^40) = 5x Adam's for the rest of training.
That is harmless when var_freeze_step is in the tens of thousands, as in DeepSpeed's
configs, and is what left 0/1 Adam at 1.27x Adam's validation loss after 400 steps
with var_freeze_step 80 (benchmarks/onebit.py). fsdpx corrects by default, as Adam and
fsdpx.onebit_adam do: m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^k) with k the
variance updates so far (`variance_updates()`, from the schedule); ``bias_correction=False``
gives DeepSpeed's update.

[Note: 0/1 Adam's synchronisation] At the freeze each rank copies its parameters to
`synced_param` (equal on every rank: every step so far applied the same update). A
synchronisation sends ``(p - synced_param) * (sqrt(v_hat) + eps)``, this rank's
lr-weighted momentum since the last one, through the compressed all-reduce, sets
``m = -average / sum(lr)`` (times 1 - beta1^t when corrected, since the steps applied
m_hat) and ``p = synced_param + average / (sqrt(v_hat) + eps)``, then synced_param = p.
DeepSpeed accumulated the change in `momentum_accumulator` instead and undid it with
``p -= u``, which leaves each rank with its own rounding of the common point, so the
replicas drift apart by a few ulps per synchronisation; from synced_param every rank
computes the same bits (the average and v are equal everywhere), at the same memory.

Deliberate differences from DeepSpeed 0.14-0.16 (the last to ship it; 0.19.8 does not),
besides the two notes above (the rest, compared line by line with its zoadam.py, is its
algorithm: the README's Measured section has what that costs in a 400-step run): its first `step()` only initialised its communication
buffers and left the parameters untouched, so its schedule counts one step more than the
updates (here step 1 is the first update); and momentum elements whose variance is exactly
0 are zeroed after each exchange and in each local step, as in fsdpx.onebit_adam
([Note: zero-variance mask] there), where DeepSpeed needed a user `exp_avg_mask` (and
applied it after exchanges only, so such elements took steps of size lr * m / eps between
them). Between synchronisations the replicas differ (the local steps). The error buffers
restart at zero when the variance freezes (DeepSpeed does the same: they then compensate
a different quantity). Engine checkpoints keep each rank's error buffers ([Note: per-rank
optimizer state] in fsdpx/checkpoint/state.py), so a resume at the same world size
continues exactly when saved at a synchronisation (between two, the checkpoint holds one
rank's replica, as DeepSpeed's did); torch's `load_state_dict`, and a load at another world
size (with a warning on rank 0: [Note: per-rank optimizer state at another world size] in
fsdpx/checkpoint/state.py), restart them at zero.
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


class ZeroOneAdam(torch.optim.Optimizer):
    """0/1 Adam ([Note: 0/1 Adam's schedule]); every rank holds a full replica.

    Args:
        params: parameters or parameter groups (fp32; plain tensors or DTensors on a one-rank
            mesh, i.e. replicas).
        lr, betas, eps: as in Adam.
        weight_decay: added to the update (DeepSpeed's ZeroOneAdam).
        bias_correction: False uses m and v uncorrected (DeepSpeed's update; [Note: 0/1
            Adam's bias correction]).
        var_freeze_step: the last step that may update the variance.
        var_update_scaler: variance steps between doublings of the variance interval.
        local_step_scaler: steps between doublings of the local-step interval.
        local_step_clipper: the largest local-step interval.
        group: the data-parallel process group of the replicas (default: the world).

    Example::

        opt = ZeroOneAdam(model.parameters(), lr=1e-3, var_freeze_step=1000)
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
        bias_correction: bool = True,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"ZeroOneAdam: lr must be >= 0, got {lr}")
        if not eps > 0.0:
            raise ValueError(f"ZeroOneAdam: eps must be > 0 (it divides), got {eps}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"ZeroOneAdam: betas must each be in [0, 1), got {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"ZeroOneAdam: weight_decay must be >= 0, got {weight_decay}")
        for name, value in (
            ("var_freeze_step", var_freeze_step),
            ("var_update_scaler", var_update_scaler),
            ("local_step_scaler", local_step_scaler),
            ("local_step_clipper", local_step_clipper),
        ):
            if value < 1:
                raise ValueError(f"ZeroOneAdam: {name} must be an integer >= 1, got {value}")
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction
        )
        super().__init__(params, defaults)
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.group = group
        self._attached = False
        self._errors: dict[torch.Tensor, OneBitState] = {}
        # The schedule, the same for every parameter; each step also writes it into every
        # stepped parameter's state (as DeepSpeed keeps it), so checkpoints carry it.
        self.schedule = _fresh_schedule()
        self._stepped: list[dict[str, Any]] = []

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def variance_step(self, t: int) -> bool:
        """Whether step `t` averages the gradient in fp32 and updates the variance."""
        return t <= self.var_freeze_step and t % self.schedule["var_interval"] == 0

    def variance_updates(self) -> int:
        """How many steps so far updated the variance: var_update_scaler per doubling of
        the interval, plus the count since the last doubling."""
        interval = self.schedule["var_interval"]
        return self.var_update_scaler * (interval.bit_length() - 1) + self.schedule["var_counter"]

    def attach(self, model: nn.Module) -> None:
        """Take over the gradient exchange of an FSDP2 model built by fsdpx.shard at ZeRO
        stage 0 (as fsdpx.onebit_adam.OneBitAdam.attach: FSDP itself issues no gradient
        collective; this hook all-reduces before variance steps only)."""
        take_over_gradient_exchange(
            model, self._backward_hook, owner="ZeroOneAdam", optimizer_type="zero_one_adam"
        )
        self._attached = True

    def _backward_hook(self, reduce_output: torch.Tensor) -> None:
        # self.schedule is current: step() and both loads re-read it from the state.
        if self.world_size > 1 and self.variance_step(self.schedule["step"] + 1):
            counted.all_reduce(reduce_output, self.group)
            reduce_output.div_(self.world_size)

    def _exchange(self, p: torch.Tensor, x: torch.Tensor, v: torch.Tensor) -> None:
        if self.world_size > 1:
            if p not in self._errors:
                self._errors[p] = OneBitState.zeros(x.numel(), self.world_size, x.device)
            compressed_all_reduce(x, self._errors[p], self.group)
        x.masked_fill_(v == 0, 0.0)  # [Note: zero-variance mask] in fsdpx/onebit_adam.py

    def _average_grads(self, grads: list[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        counted.all_reduce(flat, self.group)
        flat.div_(self.world_size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step over every parameter that has a gradient ([Note: 0/1 Adam's schedule]).
        Returns the closure's loss, or None."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._restore_schedule()
        sched = self.schedule
        t = sched["step"] + 1
        frozen = t > self.var_freeze_step
        variance = self.variance_step(t)
        if frozen and t == self.var_freeze_step + 1:
            self._errors.clear()  # they compensated gradients; now they compensate momenta
        sync = frozen and t % sched["local_interval"] == 0
        var_updates = self.variance_updates() + (1 if variance else 0)
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if variance and not self._attached and self.world_size > 1 and params:
            self._average_grads([to_local(p.grad) for p in params])  # type: ignore[arg-type]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            # [Note: 0/1 Adam's bias correction]
            m_scale, v_scale = 1.0, 1.0
            if group["bias_correction"]:
                m_scale = 1 - beta1**t
                v_scale = math.sqrt(1 - beta2**var_updates)
            for p in group["params"]:
                if p.grad is None:
                    continue
                local, grad = to_local(p), to_local(p.grad)
                if local.dtype != torch.float32:
                    raise TypeError(
                        f"ZeroOneAdam keeps fp32 parameters (the compressed exchange is fp32); "
                        f"got {local.dtype}. Use precision.param_dtype fp32 with a "
                        "mixed-precision compute dtype instead"
                    )
                state = self.state[p]
                if not state:
                    # Like the parameter (a DTensor replica under fsdpx.shard), so
                    # checkpoints save and load the state with the parameter's layout.
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                    state["synced_param"] = torch.zeros_like(p)
                    state["lrs"] = 0.0
                self._stepped.append(state)
                m, v, synced = (
                    to_local(state[k]) for k in ("exp_avg", "exp_avg_sq", "synced_param")
                )
                g = grad.float()
                if variance:
                    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                elif not frozen:
                    g = g.clone()
                    self._exchange(p, g, v)
                if frozen and t == self.var_freeze_step + 1:
                    synced.copy_(local)  # the point the first local steps start from
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                if frozen:  # a local step: the same mask as after each exchange
                    m.masked_fill_(v == 0, 0.0)
                denom = v.sqrt().div_(v_scale).add_(eps)
                update = m.div(m_scale).div_(denom)
                if wd > 0:
                    update.add_(local, alpha=wd)
                local.add_(update, alpha=-lr)
                if frozen:
                    state["lrs"] += lr
                if sync:
                    # [Note: 0/1 Adam's synchronisation]
                    u = (local - synced).mul_(denom)
                    self._exchange(p, u, v)
                    if state["lrs"] > 0:  # all-zero lrs (lr 0 throughout) keep m as it is
                        m.copy_(u).div_(-state["lrs"]).mul_(m_scale)
                    local.copy_(synced).add_(u.div_(denom))
                    synced.copy_(local)
                    state["lrs"] = 0.0
        sched["step"] = t
        if variance:
            sched["var_counter"] += 1
            if sched["var_counter"] == self.var_update_scaler:
                sched["var_counter"] = 0
                sched["var_interval"] *= 2
        if frozen:
            sched["local_counter"] += 1
            if sched["local_counter"] == self.local_step_scaler:
                sched["local_counter"] = 0
                sched["local_interval"] = min(self.local_step_clipper, 2 * sched["local_interval"])
        for state in self._stepped:
            state.update(sched)
        self._stepped = []
        return loss

    def _restore_schedule(self) -> None:
        """Read the schedule back from the parameters' state, where each step writes it (as
        DeepSpeed keeps it per parameter): a load, through load_state_dict or an engine
        checkpoint (which sets the state directly), brings it back."""
        latest: dict[str, Any] | None = None
        for state in self.state.values():
            if "step" in state and (latest is None or state["step"] > latest["step"]):
                latest = state
        self.schedule = (
            _fresh_schedule() if latest is None else {k: int(latest[k]) for k in _SCHEDULE_KEYS}
        )

    def rank_local_state(self) -> dict[str, torch.Tensor]:
        """This rank's error-feedback buffers, by parameter index ([Note: per-rank optimizer
        state] in fsdpx/checkpoint/state.py)."""
        out: dict[str, torch.Tensor] = {}
        for i, p in enumerate(_params(self)):
            if p in self._errors:
                out.update(self._errors[p].as_dict(f"{i}/"))
        return out

    def load_rank_local_state(self, found: dict[str, torch.Tensor]) -> None:
        """Restore what rank_local_state returned; empty: the feedback restarts at zero.
        The engine's loader calls it after setting the state, so the schedule is re-read."""
        self._restore_schedule()
        self._errors.clear()
        for i, p in enumerate(_params(self)):
            state = OneBitState.from_dict(found, f"{i}/", to_local(p).device)
            if state is not None:
                self._errors[p] = state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._restore_schedule()
        self._errors.clear()  # per-rank error feedback restarts at zero (module docstring)


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


_SCHEDULE_KEYS = ("step", "var_interval", "var_counter", "local_interval", "local_counter")


def _fresh_schedule() -> dict[str, int]:
    return dict(step=0, var_interval=1, var_counter=0, local_interval=1, local_counter=0)
