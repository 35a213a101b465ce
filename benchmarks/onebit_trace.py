"""Per-step trace of benchmarks/onebit.py (``--trace PATH``): for each optimizer step of each
run, rank 0 appends one JSON line with

- ``loss``: the training loss averaged over the ranks (the same batches in every run, so
  two runs' losses can be compared step by step);
- ``lr`` and ``phase``: Adam's steps are ``fp32``; 1-bit Adam / 1-bit Lamb: ``fp32``
  (warmup) then ``compressed``; 0/1 Adam: ``variance`` (fp32-averaged gradient, m and v
  updated), ``compressed`` (1-bit gradient, m only), then ``sync`` / ``local`` after the
  freeze ([Note: 0/1 Adam's schedule] in fsdpx/zero_one_adam.py);
- ``var_updates``: how many steps so far updated the variance;
- ``sqrt_v_hat``: the mean over all elements of sqrt(v_hat), the bias-corrected variance
  each optimizer divides by (rank 0's; equal on every rank), i.e. the inverse of the
  per-element step size (after the freeze it is frozen);
- ``v_zero``: the fraction of elements whose v is exactly 0 (never had a gradient in a
  variance update: the zero-variance mask freezes them after the freeze);
- ``update_max``: the largest |parameter change| / lr on rank 0, ``update_max_at`` the
  parameter it is in and ``update_max_sqrt_v_hat`` that element's sqrt(v_hat);
- ``update_median``: the median |parameter change| / lr on rank 0, ``update_wild`` the
  fraction of elements whose |change| / lr is over 10 (Adam's steps stay below about 2);
- after a run's last step, one more line: ``sqrt_v_hat_by_tensor``, the mean sqrt(v_hat)
  of each parameter then (the frozen variance of 1-bit and 0/1 Adam);
- ``update_rms``: the RMS over all elements of rank 0's parameter change, divided by lr;
- ``grad_ms``: the mean square over all elements of rank 0's gradient as the optimizer got
  it (Adam: averaged over the ranks; the compressed steps: rank 0's own).

[Note: why the trace logs sqrt(v_hat)] The three Adams differ after the freeze only in the
variance they froze and in the momentum exchange; a v frozen larger than Adam's makes every
later step smaller by the ratio of the sqrt(v_hat)s, which the loss shows only slowly. The
trace makes that ratio visible at the freeze instead of inferring it from the final loss.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fsdpx.dtensor import to_local
from fsdpx.zero_one_adam import ZeroOneAdam


def phase(opt: torch.optim.Optimizer) -> str:
    """What the coming step does ([Note: 0/1 Adam's schedule]; 1-bit Adam's freeze_step)."""
    if isinstance(opt, ZeroOneAdam):
        t = opt.schedule["step"] + 1
        if opt.variance_step(t):
            return "variance"
        if t <= opt.var_freeze_step:
            return "compressed"
        return "sync" if t % opt.schedule["local_interval"] == 0 else "local"
    freeze = getattr(opt, "freeze_step", None)
    if freeze is not None:
        return "fp32" if _step(opt) + 1 <= freeze else "compressed"
    return "fp32"


def _step(opt: torch.optim.Optimizer) -> int:
    for state in opt.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def variance_updates(opt: torch.optim.Optimizer) -> int:
    """The number of variance updates so far (each optimizer's own count)."""
    if isinstance(opt, ZeroOneAdam):
        return opt.variance_updates()
    freeze = getattr(opt, "freeze_step", None)
    return _step(opt) if freeze is None else min(_step(opt), freeze)


def v_zero_fraction(opt: torch.optim.Optimizer) -> float:
    """The fraction of all elements whose exp_avg_sq is exactly 0 (NaN: none has one)."""
    zeros, count = 0, 0
    for v in (s.get("exp_avg_sq") for s in opt.state.values()):
        if v is not None:
            zeros += int((to_local(v) == 0).sum())
            count += v.numel()
    return zeros / count if count else math.nan


def sqrt_v_hat_flat(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> torch.Tensor:
    """sqrt(v / (1 - beta2^k)) of every element of `params`, flat in their order, with
    k = variance_updates(opt): the correction each of these optimizers applies by default
    (torch's Adam; fsdpx's OneBitAdam and ZeroOneAdam with bias_correction). NaN for a
    parameter without exp_avg_sq (Lamb's trust ratio makes the number meaningless there),
    everywhere before the first variance update or without the correction."""
    k = variance_updates(opt)
    group_of = {p: g for g in opt.param_groups for p in g["params"]}
    out = []
    for p in params:
        v = opt.state.get(p, {}).get("exp_avg_sq")
        group = group_of.get(p)
        if v is None or group is None or k == 0 or not group.get("bias_correction", True):
            out.append(torch.full((p.numel(),), math.nan))
            continue
        out.append(to_local(v).detach().reshape(-1).float().div(1 - group["betas"][1] ** k).sqrt())
    return torch.cat(out)


class StepTrace:
    """Collects the per-step records of one run (module docstring) and writes them on rank 0."""

    def __init__(
        self, run: str, opt: torch.optim.Optimizer, named: Sequence[tuple[str, torch.Tensor]]
    ) -> None:
        self.run, self.opt = run, opt
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        # Where each parameter starts in the flat vector (to name the largest update's).
        self.offsets = [0]
        for p in self.params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.records: list[dict[str, Any]] = []
        self._before: torch.Tensor | None = None
        self._phase = ""
        self._grad_ms = math.nan

    def _flat(self) -> torch.Tensor:
        return torch.cat([to_local(p).detach().reshape(-1).float() for p in self.params])

    def before_step(self) -> None:
        self._phase = phase(self.opt)
        self._before = self._flat()
        grads = [to_local(p.grad).float() for p in self.params if p.grad is not None]
        if grads:
            self._grad_ms = sum(float(g.square().sum()) for g in grads) / sum(
                g.numel() for g in grads
            )

    def after_step(self, loss: torch.Tensor) -> None:
        assert self._before is not None, "before_step() first"
        mean_loss = loss.detach().float().reshape(1).clone()
        world = 1
        if dist.is_initialized():
            # A plain (uncounted) all-reduce: the byte log stays the optimizers' own.
            dist.all_reduce(mean_loss)
            world = dist.get_world_size()
        lr = float(self.opt.param_groups[0]["lr"])
        delta = (self._flat() - self._before).abs_()
        sqrt_v = sqrt_v_hat_flat(self.opt, self.params)
        at = int(delta.argmax())
        which = next(i for i in range(len(self.params)) if at < self.offsets[i + 1])
        self.records.append(
            {
                "run": self.run,
                "step": len(self.records) + 1,
                "loss": float(mean_loss) / world,
                "lr": lr,
                "phase": self._phase,
                "var_updates": variance_updates(self.opt),
                "sqrt_v_hat": float(sqrt_v.mean()),
                "grad_ms": self._grad_ms,
                "v_zero": v_zero_fraction(self.opt),
                "update_max": float(delta[at]) / lr if lr > 0 else math.nan,
                "update_max_at": self.names[which],
                "update_max_sqrt_v_hat": float(sqrt_v[at]),
                "update_median": float(delta.median()) / lr if lr > 0 else math.nan,
                "update_wild": float((delta > 10 * lr).float().mean()),
                "update_rms": float(delta.norm()) / math.sqrt(delta.numel()) / lr
                if lr > 0
                else math.nan,
            }
        )
        self._before = None

    def by_tensor(self) -> dict[str, Any]:
        """The run's last record: mean sqrt(v_hat) of each parameter now (after the freeze,
        the frozen variance), to compare optimizers tensor by tensor."""
        flat = sqrt_v_hat_flat(self.opt, self.params)
        means = {
            name: float(flat[self.offsets[i] : self.offsets[i + 1]].mean())
            for i, name in enumerate(self.names)
        }
        return {"run": self.run, "sqrt_v_hat_by_tensor": means}

    def write(self, path: str) -> None:
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        with open(path, "a") as f:
            for record in [*self.records, self.by_tensor()]:
                f.write(json.dumps(record) + "\n")
