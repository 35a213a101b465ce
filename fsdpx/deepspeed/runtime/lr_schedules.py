"""`deepspeed.runtime.lr_schedules`: DeepSpeed's schedule classes with DeepSpeed's
constructor arguments, built on fsdpx's implementations (fsdpx/schedulers.py, whose
docstring states the step indexing and where it departs from DeepSpeed).

They are torch `LRScheduler`s: pass one to `initialize(lr_scheduler=...)` built on the
optimizer you also pass, or build one from the optimizer `initialize` returns.
"""

from torch.optim import Optimizer as _Optimizer

from fsdpx import schedulers as _schedulers
from fsdpx.config import SchedulerConfig as _SchedulerConfig


class WarmupLR(_schedulers.WarmupLR):
    def __init__(
        self,
        optimizer: _Optimizer,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        cfg = _SchedulerConfig(
            type="WarmupLR",
            warmup_min_lr=warmup_min_lr,
            warmup_max_lr=warmup_max_lr,
            warmup_num_steps=warmup_num_steps,
            warmup_type=warmup_type,  # type: ignore[arg-type]  # validated by the config
        )
        super().__init__(optimizer, cfg, last_epoch=last_batch_iteration)


class WarmupDecayLR(_schedulers.WarmupDecayLR):
    def __init__(
        self,
        optimizer: _Optimizer,
        total_num_steps: int,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        cfg = _SchedulerConfig(
            type="WarmupDecayLR",
            total_num_steps=total_num_steps,
            warmup_min_lr=warmup_min_lr,
            warmup_max_lr=warmup_max_lr,
            warmup_num_steps=warmup_num_steps,
            warmup_type=warmup_type,  # type: ignore[arg-type]
        )
        super().__init__(optimizer, cfg, last_epoch=last_batch_iteration)


class WarmupCosineLR(_schedulers.WarmupCosineLR):
    def __init__(
        self,
        optimizer: _Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        cfg = _SchedulerConfig(
            type="WarmupCosineLR",
            total_num_steps=total_num_steps,
            warmup_min_ratio=warmup_min_ratio,
            warmup_num_steps=warmup_num_steps,
            cos_min_ratio=cos_min_ratio,
            warmup_type=warmup_type,  # type: ignore[arg-type]
        )
        super().__init__(optimizer, cfg, last_epoch=last_batch_iteration)


class OneCycle(_schedulers.OneCycle):
    """DeepSpeed's OneCycle for the learning rate. Momentum cycling (DeepSpeed's default
    cycle_momentum=True) is not implemented: pass cycle_momentum=False."""

    def __init__(
        self,
        optimizer: _Optimizer,
        cycle_min_lr: float,
        cycle_max_lr: float,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        if cycle_momentum:
            raise NotImplementedError(
                "OneCycle with cycle_momentum=True (DeepSpeed's default) also cycles the "
                "optimizer's momentum, which fsdpx does not implement; pass "
                "cycle_momentum=False to cycle the learning rate only"
            )
        cfg = _SchedulerConfig(
            type="OneCycle",
            cycle_min_lr=cycle_min_lr,
            cycle_max_lr=cycle_max_lr,
            decay_lr_rate=decay_lr_rate,
            cycle_first_step_size=cycle_first_step_size,
            cycle_second_step_size=cycle_second_step_size,
            cycle_first_stair_count=cycle_first_stair_count,
            cycle_second_stair_count=cycle_second_stair_count,
            decay_step_size=decay_step_size,
        )
        super().__init__(optimizer, cfg, last_epoch=last_batch_iteration)


__all__ = ["OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
