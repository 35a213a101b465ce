"""Config sections for the optimizer and the learning-rate scheduler (DeepSpeed's names)."""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from fsdpx.config_sections.checks import check, check_unused
from fsdpx.optimizers import OPTIMIZER_KEYS


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer built when `fsdpx.shard` is called with optimizer=None."""

    type: Literal["adamw", "adam", "sgd", "onebit_adam", "lamb", "zero_one_adam", "onebit_lamb"] = (
        "adamw"
    )
    """Which optimizer to build: a row of fsdpx.optimizers.OPTIMIZERS (the keys it reads);
    onebit_adam is fsdpx.onebit_adam.OneBitAdam (1-bit compressed exchange, ZeRO stage 0);
    lamb is fsdpx.lamb.Lamb (DeepSpeed's Lamb: Adam with a per-tensor trust ratio);
    zero_one_adam is fsdpx.zero_one_adam.ZeroOneAdam (0/1 Adam, ZeRO stage 0); onebit_lamb is
    fsdpx.onebit_lamb.OneBitLamb (1-bit Lamb, ZeRO stage 0)."""
    lr: float = 1e-3
    """Learning rate (the peak lr of a schedule whose max lr is left unset)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """adam/adamw only: decay rates of the first and second moment estimates."""
    eps: float = 1e-8
    """adam/adamw only: added to the denominator for numerical stability."""
    weight_decay: float = 0.0
    """adamw: decoupled weight decay; adam/sgd: L2 penalty added to the gradient."""
    momentum: float = 0.0
    """sgd only."""
    freeze_step: int = 100000
    """onebit_adam only: full-precision warmup steps before the compressed exchange starts
    (DeepSpeed's default)."""
    bias_correction: bool = True
    """adam/adamw: false drops Adam's bias correction (DeepSpeed's FusedAdam
    ``bias_correction=False``: step size lr, denominator sqrt(v) + eps). torch.optim has no
    such option, so fsdpx.optim.AdamW (the fused adam_step) is built instead. onebit_adam,
    zero_one_adam: false uses m and the frozen v as they are (what DeepSpeed's OnebitAdam and
    ZeroOneAdam did whatever their flag said); onebit_lamb must say false (uncorrected, as
    DeepSpeed's OnebitLamb)."""
    max_coeff: float = 10.0
    """lamb only: upper clamp of the trust ratio ||p|| / ||update|| (DeepSpeed's default)."""
    min_coeff: float = 0.01
    """lamb only: lower clamp of the trust ratio (DeepSpeed's default)."""
    eps_inside_sqrt: bool = False
    """lamb only: add eps under the square root, sqrt(v + eps) (DeepSpeed's eps_inside_sqrt)."""
    var_freeze_step: int = 100000
    """zero_one_adam only: the last step that may update the variance (DeepSpeed's default)."""
    var_update_scaler: int = 16
    """zero_one_adam only: variance steps between doublings of the variance interval."""
    local_step_scaler: int = 32678
    """zero_one_adam only: steps between doublings of the local-step interval (DeepSpeed's
    default)."""
    local_step_clipper: int = 16
    """zero_one_adam only: the largest local-step interval."""
    coeff_beta: float = 0.9
    """onebit_lamb only: averaging factor of the warmup trust ratios."""
    factor_max: float = 4.0
    """onebit_lamb only: upper clamp of the compressed-stage trust-ratio factor."""
    factor_min: float = 0.5
    """onebit_lamb only: lower clamp of that factor."""
    factor_threshold: float = 0.1
    """onebit_lamb only: the most the factor may change from one step to the next (relative)."""

    def __post_init__(self) -> None:
        check_unused(self, "optimizer", "type", OPTIMIZER_KEYS[self.type])
        check(self.lr >= 0, "optimizer.lr", self.lr, ">= 0")
        check(
            all(0 <= b < 1 for b in self.betas),
            "optimizer.betas",
            self.betas,
            "two numbers in [0, 1)",
        )
        check(self.eps >= 0, "optimizer.eps", self.eps, ">= 0")
        check(self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay, ">= 0")
        check(self.momentum >= 0, "optimizer.momentum", self.momentum, ">= 0")
        check(
            0 < self.min_coeff <= self.max_coeff,
            "optimizer.min_coeff/max_coeff",
            (self.min_coeff, self.max_coeff),
            "0 < min_coeff <= max_coeff",
        )


SCHEDULER_KEYS: Mapping[str, frozenset[str]] = types.MappingProxyType(
    {
        "none": frozenset(),
        "WarmupLR": frozenset(
            {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"}
        ),
        "WarmupDecayLR": frozenset(
            {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"}
            | {"total_num_steps"}
        ),
        "WarmupCosineLR": frozenset(
            {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "warmup_type"}
            | {"cos_min_ratio"}
        ),
        "OneCycle": frozenset(
            {"cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "decay_step_size"}
            | {"cycle_first_step_size", "cycle_second_step_size"}
            | {"cycle_first_stair_count", "cycle_second_stair_count"}
        ),
    }
)
"""The SchedulerConfig fields each scheduler type reads; any other field set away from its
default is an error. fsdpx.schedulers takes its key lists from here."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Learning-rate schedule, DeepSpeed's schedulers with DeepSpeed's parameter names.

    Stepped once per optimizer step. `warmup_max_lr`/`cycle_max_lr` default to optimizer.lr.
    """

    type: Literal["none", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle"] = "none"
    """Which schedule; each reads only the keys listed for it in SCHEDULER_KEYS."""
    warmup_min_lr: float = 0.0
    """WarmupLR / WarmupDecayLR: lr at the start of warmup (and at the end of the decay)."""
    warmup_max_lr: float | None = None
    """WarmupLR / WarmupDecayLR: lr at the end of warmup; None: each group's initial lr."""
    warmup_num_steps: int = 1000
    """Warmup length in optimizer steps; 1 acts as 2, as in DeepSpeed."""
    warmup_type: Literal["log", "linear"] = "log"
    """Shape of the warmup ramp."""
    total_num_steps: int | None = None
    """WarmupDecayLR / WarmupCosineLR: the step at which the decay reaches its end."""
    warmup_min_ratio: float = 0.0
    """WarmupCosineLR: lr at step 0 as a fraction of the optimizer lr."""
    cos_min_ratio: float = 0.0001
    """WarmupCosineLR: lr at total_num_steps as a fraction of the optimizer lr."""
    cycle_min_lr: float = 0.0
    """OneCycle: lr at the start and end of the cycle."""
    cycle_max_lr: float | None = None
    """OneCycle: lr at the peak of the cycle; None: each group's initial lr."""
    decay_lr_rate: float = 0.0
    """OneCycle: after the cycle, lr = cycle_min_lr / (1 + decay_lr_rate * n / decay_step_size)."""
    cycle_first_step_size: int = 2000
    """OneCycle: steps from cycle_min_lr up to the peak."""
    cycle_second_step_size: int | None = None
    """OneCycle: steps from the peak back down; None: cycle_first_step_size."""
    cycle_first_stair_count: int = 0
    """OneCycle: split the rise into this many flat stairs; 0: a straight ramp."""
    cycle_second_stair_count: int | None = None
    """OneCycle: stairs of the fall; None: cycle_first_stair_count."""
    decay_step_size: int = 0
    """OneCycle: steps per decay interval after the cycle; 0: no decay."""

    def __post_init__(self) -> None:
        check_unused(self, "scheduler", "type", SCHEDULER_KEYS[self.type])
        # Unread keys hold their (valid) defaults by now, so every range check below
        # concerns a key the chosen schedule reads.
        check(
            self.warmup_num_steps >= 1,
            "scheduler.warmup_num_steps",
            self.warmup_num_steps,
            "an integer >= 1 (1 acts as 2, as in DeepSpeed)",
        )
        if self.type in ("WarmupDecayLR", "WarmupCosineLR"):
            if self.total_num_steps is None:
                raise ValueError(
                    f"config key 'scheduler.total_num_steps' is required for {self.type}; "
                    "set it to the number of optimizer steps of the run"
                )
            check(
                self.total_num_steps > self.warmup_num_steps - (self.type == "WarmupCosineLR"),
                "scheduler.total_num_steps",
                self.total_num_steps,
                f"greater than scheduler.warmup_num_steps ({self.warmup_num_steps})"
                + (" or equal to it" if self.type == "WarmupCosineLR" else ""),
            )
        for name in ("warmup_min_lr", "warmup_min_ratio", "cos_min_ratio", "cycle_min_lr"):
            v = getattr(self, name)
            check(v >= 0, f"scheduler.{name}", v, ">= 0")
        for name in ("warmup_max_lr", "cycle_max_lr"):
            v = getattr(self, name)
            check(v is None or v >= 0, f"scheduler.{name}", v, ">= 0, or null for the optimizer lr")
        check(
            self.cycle_first_step_size >= 1,
            "scheduler.cycle_first_step_size",
            self.cycle_first_step_size,
            "an integer >= 1",
        )
        check(
            self.cycle_second_step_size is None or self.cycle_second_step_size >= 1,
            "scheduler.cycle_second_step_size",
            self.cycle_second_step_size,
            "an integer >= 1, or null to reuse cycle_first_step_size",
        )
        check(
            self.cycle_first_stair_count >= 0,
            "scheduler.cycle_first_stair_count",
            self.cycle_first_stair_count,
            "an integer >= 0 (0: no stairs)",
        )
        check(
            self.cycle_second_stair_count is None or self.cycle_second_stair_count >= 0,
            "scheduler.cycle_second_stair_count",
            self.cycle_second_stair_count,
            "an integer >= 0, or null to reuse cycle_first_stair_count",
        )
        check(self.decay_lr_rate >= 0, "scheduler.decay_lr_rate", self.decay_lr_rate, ">= 0")
        check(
            self.decay_step_size >= 0,
            "scheduler.decay_step_size",
            self.decay_step_size,
            "an integer >= 0 (0: no decay)",
        )
