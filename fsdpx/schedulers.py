"""DeepSpeed's learning-rate schedules as ``torch.optim.lr_scheduler.LRScheduler`` subclasses.

``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR`` and ``OneCycle`` follow the formulas
of DeepSpeed's ``deepspeed/runtime/lr_schedules.py`` and read their parameters, under
DeepSpeed's names, from :class:`fsdpx.config.SchedulerConfig`. As real ``LRScheduler``
subclasses they work with ``get_last_lr``, ``state_dict``/``load_state_dict`` and the
rest of torch's machinery.

Example::

    sched = build_scheduler(opt, SchedulerConfig(type="WarmupLR", warmup_num_steps=100))
    for batch in data:
        loss(batch).backward()
        opt.step()
        sched.step()          # once per optimizer step, never per micro-batch

Step indexing (matches the DeepSpeed engine step for step)
----------------------------------------------------------
DeepSpeed's ``last_batch_iteration`` ``i`` is -1 at construction; each ``step()`` does
``i += 1`` and then sets ``lr = f(i)``. Its engine calls ``step()`` after every optimizer
step it takes (a step skipped on fp16 overflow does not count). Torch's ``LRScheduler``
takes one step in its constructor, so here ``last_epoch`` counts ``step()`` calls (0 after
construction) and the lr is ``f(last_epoch - 1)``. After construction and after every
``step()``, the lr therefore equals DeepSpeed's at the same point, and the n-th
optimizer step (counting from 1) runs at ``f(n - 2)``.

``f(-1)``, the lr at construction and so for the first optimizer step, is DeepSpeed's
pre-start value: ``warmup_min_lr`` for WarmupLR/WarmupDecayLR, **0.0** for
WarmupCosineLR (``warmup_min_ratio`` applies from ``f(0)``), ``cycle_min_lr`` for
OneCycle. ``last_epoch=k`` resumes like DeepSpeed's ``last_batch_iteration=k``; as with
any torch scheduler, build it before calling ``optimizer.load_state_dict``.

Where fsdpx departs from DeepSpeed
----------------------------------
* ``warmup_max_lr``/``cycle_max_lr`` None means each param group's ``initial_lr``.
  DeepSpeed uses group 0's *current* lr: the same for one group on a fresh start, but
  different on resume.
* OneCycle cycles only the lr. DeepSpeed also cycles momentum (beta1/momentum) when
  ``cycle_momentum`` is set. SchedulerConfig has no ``cycle_momentum``/``cycle_*_mom``
  keys, so that is not implemented and the optimizer's momentum is left alone.
* OneCycle picks a half-cycle's stair count by its exact integer position. DeepSpeed
  uses a float test, which with unequal stair counts can put the peak on the wrong stair.
* Keys that ``cfg.type`` does not read, set away from their defaults, are a ValueError
  from ``SchedulerConfig`` itself (DeepSpeed raises a TypeError). A schedule class built
  directly from a config of another type still warns about keys it does not read.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import ClassVar

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from fsdpx.config import SCHEDULER_KEYS, SchedulerConfig

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "build_scheduler"]


def _warmup_fraction(iteration: int, num_steps: int, warmup_type: str) -> float:
    """Fraction of the warmup done at ``iteration`` (0 <= iteration < num_steps)."""
    if warmup_type == "linear":
        return iteration / num_steps
    if warmup_type == "log":
        # 1 already at iteration num_steps - 1: the log ramp peaks one step before the
        # linear one, as in DeepSpeed.
        return math.log(iteration + 1) / math.log(num_steps)
    raise ValueError(
        f"config key 'scheduler.warmup_type' must be 'log' or 'linear'; got {warmup_type!r}"
    )


def _total_num_steps(cfg: SchedulerConfig, name: str) -> int:
    # SchedulerConfig only demands it when cfg.type names a decaying schedule; a class
    # built directly from another config must still fail loudly.
    if cfg.total_num_steps is None:
        raise ValueError(
            f"config key 'scheduler.total_num_steps' is required for {name}; "
            "set it to the number of optimizer steps of the run"
        )
    return cfg.total_num_steps


class _DeepSpeedSchedule(LRScheduler):
    """Maps torch's ``last_epoch`` onto DeepSpeed's ``last_batch_iteration`` (module doc).

    Every schedule is built as ``Cls(optimizer, cfg, *, last_epoch=-1)``; pass
    ``last_epoch=k`` only to resume (DeepSpeed's ``last_batch_iteration=k``). Subclasses
    set their fields *before* ``super().__init__``: torch's constructor takes the first
    step, which already needs them.
    """

    # SchedulerConfig fields this schedule reads (listed once, in fsdpx.config); any other
    # field set away from its default is reported, because a silently ignored option is a bug.
    _CFG_KEYS: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, optimizer: Optimizer, cfg: SchedulerConfig, *, last_epoch: int = -1) -> None:
        _warn_unused_keys(cfg, type(self).__name__, self._CFG_KEYS | {"type"})
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float | Tensor]:
        # Closed form in the step count, so it is also correct when called outside step().
        return list(self._lrs_at(self.last_epoch - 1))

    def _lrs_at(self, iteration: int) -> list[float]:
        """The lr of each param group at DeepSpeed's ``last_batch_iteration == iteration``."""
        raise NotImplementedError

    def _peak_lrs(self, configured: float | None) -> list[float]:
        # base_lrs holds each group's 'initial_lr': the lr the user gave the optimizer,
        # restored from the optimizer's state dict on resume, never the scheduled lr.
        if configured is not None:
            return [configured] * len(self.base_lrs)
        return [float(base) for base in self.base_lrs]


class WarmupLR(_DeepSpeedSchedule):
    """Ramp from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.

    Reads warmup_min_lr, warmup_max_lr (None: each group's initial lr), warmup_num_steps
    (below 2 acts as 2, as in DeepSpeed) and warmup_type.
    """

    _CFG_KEYS = SCHEDULER_KEYS["WarmupLR"]

    def __init__(self, optimizer: Optimizer, cfg: SchedulerConfig, *, last_epoch: int = -1) -> None:
        self.warmup_min_lr = cfg.warmup_min_lr
        self.warmup_max_lr = cfg.warmup_max_lr
        # DeepSpeed clamps to 2 because the log ramp divides by log(warmup_num_steps).
        self.warmup_num_steps = max(2, cfg.warmup_num_steps)
        self.warmup_type = cfg.warmup_type
        super().__init__(optimizer, cfg, last_epoch=last_epoch)

    def _gamma(self, iteration: int) -> float:
        """Position between min (0) and max (1) lr."""
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def _lrs_at(self, iteration: int) -> list[float]:
        lo = self.warmup_min_lr
        if iteration < 0:
            return [lo] * len(self.base_lrs)
        gamma = self._gamma(iteration)
        return [lo + (hi - lo) * gamma for hi in self._peak_lrs(self.warmup_max_lr)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay that reaches ``warmup_min_lr`` at ``total_num_steps``.

    Reads WarmupLR's keys plus total_num_steps (required).
    """

    _CFG_KEYS = SCHEDULER_KEYS["WarmupDecayLR"]

    def __init__(self, optimizer: Optimizer, cfg: SchedulerConfig, *, last_epoch: int = -1) -> None:
        self.total_num_steps = _total_num_steps(cfg, "WarmupDecayLR")
        super().__init__(optimizer, cfg, last_epoch=last_epoch)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return super()._gamma(iteration)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - iteration) / decay_steps)


class WarmupCosineLR(_DeepSpeedSchedule):
    """Warm up from ``warmup_min_ratio`` to 1, then cosine-decay to ``cos_min_ratio``.

    Ratios multiply each param group's initial lr; the floor is reached after
    ``total_num_steps`` steps and held. Reads total_num_steps (required),
    warmup_min_ratio, warmup_num_steps (below 2 acts as 2), warmup_type, cos_min_ratio.
    """

    _CFG_KEYS = SCHEDULER_KEYS["WarmupCosineLR"]

    def __init__(self, optimizer: Optimizer, cfg: SchedulerConfig, *, last_epoch: int = -1) -> None:
        self.total_num_steps = _total_num_steps(cfg, "WarmupCosineLR")
        self.warmup_min_ratio = cfg.warmup_min_ratio
        self.warmup_num_steps = max(2, cfg.warmup_num_steps)
        self.warmup_type = cfg.warmup_type
        self.cos_min_ratio = cfg.cos_min_ratio
        super().__init__(optimizer, cfg, last_epoch=last_epoch)

    def _ratio(self, iteration: int) -> float:
        if iteration < 0:
            return 0.0  # DeepSpeed's pre-start value; warmup_min_ratio does not apply yet
        if iteration < self.warmup_num_steps:
            frac = _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * frac
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        # Clamped so that the lr rests at the floor past the end instead of rising again.
        progress = min(1.0, (iteration - self.warmup_num_steps + 1) / decay_steps)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def _lrs_at(self, iteration: int) -> list[float]:
        ratio = self._ratio(iteration)
        return [base * ratio for base in self._peak_lrs(None)]


class OneCycle(_DeepSpeedSchedule):
    """One triangular cycle ``cycle_min_lr -> cycle_max_lr -> cycle_min_lr``, then decay.

    The rise takes ``cycle_first_step_size`` steps and the fall ``cycle_second_step_size``
    (default: the same). A stair count above 0 turns that half into that many flat
    stairs. Once the cycle ends, the lr is ``cycle_min_lr / (1 + decay_lr_rate * n /
    decay_step_size)`` after n more steps, or stays at ``cycle_min_lr`` when either of
    those two keys is 0. cycle_max_lr None means each group's initial lr. Only the lr
    is cycled; see the module docstring on momentum.
    """

    _CFG_KEYS = SCHEDULER_KEYS["OneCycle"]

    def __init__(self, optimizer: Optimizer, cfg: SchedulerConfig, *, last_epoch: int = -1) -> None:
        second = cfg.cycle_second_step_size
        if second is not None and second < 1:
            raise ValueError(
                f"config key 'scheduler.cycle_second_step_size' must be an integer >= 1, or "
                f"null to reuse cycle_first_step_size; got {second!r}"
            )
        self.cycle_min_lr = cfg.cycle_min_lr
        self.cycle_max_lr = cfg.cycle_max_lr
        self.first_step_size = cfg.cycle_first_step_size
        self.second_step_size = self.first_step_size if second is None else second
        self.first_stair_count = cfg.cycle_first_stair_count
        self.second_stair_count = (
            self.first_stair_count
            if cfg.cycle_second_stair_count is None
            else cfg.cycle_second_stair_count
        )
        self.decay_lr_rate = cfg.decay_lr_rate
        self.decay_step_size = cfg.decay_step_size
        super().__init__(optimizer, cfg, last_epoch=last_epoch)

    def _cycle_scale(self, position: int) -> float:
        """Height in [0, 1] at ``position`` steps into the cycle (0..cycle length)."""
        total = self.first_step_size + self.second_step_size
        position %= total  # the end of the cycle is its start: height 0
        if position <= self.first_step_size:
            rise, span, stairs = position, self.first_step_size, self.first_stair_count
        else:
            rise, span, stairs = total - position, self.second_step_size, self.second_stair_count
        if stairs > 0:
            # Quantise the exact integer position, not the float height, so that a
            # stair edge never falls one ulp short and loses a whole stair.
            return math.floor(rise * stairs / span) / stairs
        return rise / span

    def _lrs_at(self, iteration: int) -> list[float]:
        lo = self.cycle_min_lr
        total = self.first_step_size + self.second_step_size
        if iteration < total:
            # DeepSpeed evaluates the cycle one step ahead (at iteration + 1), so that
            # f(-1) is the cycle's start and the peak comes after first_step_size steps.
            scale = self._cycle_scale(iteration + 1)
            return [lo + (hi - lo) * scale for hi in self._peak_lrs(self.cycle_max_lr)]
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return [lo] * len(self.base_lrs)
        decay_intervals = (iteration - total + 1) / self.decay_step_size
        return [lo / (1.0 + self.decay_lr_rate * decay_intervals)] * len(self.base_lrs)


_SCHEDULERS: dict[str, type[_DeepSpeedSchedule]] = {
    cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle)
}


def build_scheduler(optimizer: Optimizer, cfg: SchedulerConfig) -> LRScheduler | None:
    """Build the schedule named by ``cfg.type``, or return None when it is "none".

    Args:
        optimizer: The optimizer to schedule. Its param groups' current lrs become their
            ``initial_lr``, the peak whenever ``warmup_max_lr``/``cycle_max_lr`` is None.
        cfg: The scheduler section of the config.

    Returns:
        A fresh scheduler (already at step 0, i.e. DeepSpeed's lr at construction), or None.

    Example::

        sched = build_scheduler(opt, SchedulerConfig(type="WarmupCosineLR", total_num_steps=1000))
    """
    if cfg.type == "none":
        return None
    return _SCHEDULERS[cfg.type](optimizer, cfg)


def _warn_unused_keys(cfg: SchedulerConfig, name: str, used: frozenset[str]) -> None:
    # The defaults come from the dataclass itself, so they still live only in config.py.
    unused = [
        f.name
        for f in dataclasses.fields(cfg)
        if f.name not in used and getattr(cfg, f.name) != f.default
    ]
    if unused:
        keys = ", ".join(f"scheduler.{k}" for k in unused)
        warnings.warn(
            f"{keys} set but not used by the {name} schedule; they are ignored. "
            f"{name} reads: {', '.join(sorted(used - {'type'}))}. Remove the unused keys.",
            UserWarning,
            stacklevel=3,
        )
