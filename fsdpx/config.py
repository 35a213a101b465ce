"""Training configuration: frozen dataclasses, the only place defaults live.

`Config.from_dict` / `Config.from_file` are strict: an unknown key is an error with a
did-you-mean, a value of the wrong type or outside its allowed set is an error that names
the key, the value and what is allowed. A silently ignored option is a bug.

Example::

    cfg = Config.from_dict({"zero": {"stage": 2}, "precision": {"param_dtype": "bf16"}})
    cfg = Config.from_file("train.json")          # JSON or TOML
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

DType = Literal["fp32", "bf16", "fp16"]


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"config key '{key}' must be {allowed}; got {value!r}")


@dataclass(frozen=True)
class MeshConfig:
    """Sizes of the device-mesh axes; their product must equal the world size."""

    dp_replicate: int = 1
    """Data-parallel replicas (HSDP / MiCS: shard inside a group, replicate across groups)."""
    dp_shard: int = -1
    """Data-parallel shard group size; -1 infers it from the world size and the other axes."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp"):
            v = getattr(self, name)
            _check(v >= 1, f"mesh.{name}", v, "an integer >= 1")
        _check(
            self.dp_shard == -1 or self.dp_shard >= 1,
            "mesh.dp_shard",
            self.dp_shard,
            "an integer >= 1, or -1 to infer it from the world size",
        )


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO stage and sharding layout (see DESIGN.md section 3 for the FSDP2 mapping)."""

    stage: Literal[0, 1, 2, 3] = 3
    """0: DDP; 1: optimizer state sharded; 2: + gradients sharded; 3: + parameters sharded."""
    hpz_partition_size: int = 1
    """ZeRO++ hpZ: after forward, keep parameters gathered within groups of this many ranks
    (secondary partition) instead of resharding fully. 1 disables it. Stage 3 only."""
    block_classes: tuple[str, ...] = ()
    """Class names of the blocks to shard one by one. Empty: every nn.ModuleList /
    nn.Sequential whose children all share one class is taken as the block list."""

    def __post_init__(self) -> None:
        _check(
            self.hpz_partition_size >= 1,
            "zero.hpz_partition_size",
            self.hpz_partition_size,
            "an integer >= 1",
        )
        if self.hpz_partition_size > 1 and self.stage != 3:
            raise ValueError(
                f"config key 'zero.hpz_partition_size' ({self.hpz_partition_size}) needs "
                f"zero.stage 3; got stage {self.stage}. Set stage 3 or drop hpz_partition_size."
            )


@dataclass(frozen=True)
class PrecisionConfig:
    """Mixed precision: parameters are kept in fp32 and cast for compute and reduction."""

    param_dtype: DType = "fp32"
    """Dtype of the gathered parameters used in forward/backward."""
    reduce_dtype: DType = "fp32"
    """Dtype gradients are reduced in."""


@dataclass(frozen=True)
class LossScaleConfig:
    """fp16 loss scaling, DeepSpeed semantics. Used only when param_dtype is fp16."""

    static_scale: float = 0.0
    """A fixed loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    window: int = 1000
    """Double the scale after this many consecutive steps without overflow."""
    hysteresis: int = 2
    """Overflows tolerated (skipping the step each time) before the scale is halved."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every clean step, not only on scale-up."""
    min_scale: float = 1.0
    """The scale never drops below this."""

    def __post_init__(self) -> None:
        _check(self.static_scale >= 0, "fp16.static_scale", self.static_scale, ">= 0")
        _check(self.window >= 1, "fp16.window", self.window, "an integer >= 1")
        _check(self.hysteresis >= 1, "fp16.hysteresis", self.hysteresis, "an integer >= 1")
        _check(self.min_scale > 0, "fp16.min_scale", self.min_scale, "> 0")
        _check(
            0 <= self.initial_scale_power <= 64,
            "fp16.initial_scale_power",
            self.initial_scale_power,
            "an integer in [0, 64]",
        )


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer built when `fsdpx.shard` is called with optimizer=None."""

    type: Literal["adamw", "adam", "sgd"] = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    """adamw: decoupled weight decay; adam/sgd: L2 penalty added to the gradient."""
    momentum: float = 0.0
    """sgd only."""

    def __post_init__(self) -> None:
        _check(self.lr >= 0, "optimizer.lr", self.lr, ">= 0")
        _check(
            all(0 <= b < 1 for b in self.betas),
            "optimizer.betas",
            self.betas,
            "two numbers in [0, 1)",
        )
        _check(self.eps >= 0, "optimizer.eps", self.eps, ">= 0")
        _check(self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay, ">= 0")


@dataclass(frozen=True)
class SchedulerConfig:
    """Learning-rate schedule, DeepSpeed's schedulers with DeepSpeed's parameter names.

    Stepped once per optimizer step. `warmup_max_lr`/`cycle_max_lr` default to optimizer.lr.
    """

    type: Literal["none", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle"] = "none"
    warmup_min_lr: float = 0.0
    warmup_max_lr: float | None = None
    warmup_num_steps: int = 1000
    warmup_type: Literal["log", "linear"] = "log"
    total_num_steps: int | None = None
    """WarmupDecayLR / WarmupCosineLR: the step at which the decay reaches its end."""
    warmup_min_ratio: float = 0.0
    """WarmupCosineLR: lr at step 0 as a fraction of the optimizer lr."""
    cos_min_ratio: float = 0.0001
    """WarmupCosineLR: lr at total_num_steps as a fraction of the optimizer lr."""
    cycle_min_lr: float = 0.0
    cycle_max_lr: float | None = None
    decay_lr_rate: float = 0.0
    cycle_first_step_size: int = 2000
    cycle_second_step_size: int | None = None
    cycle_first_stair_count: int = 0
    cycle_second_stair_count: int | None = None
    decay_step_size: int = 0

    def __post_init__(self) -> None:
        if self.type in ("WarmupDecayLR", "WarmupCosineLR"):
            if self.total_num_steps is None:
                raise ValueError(
                    f"config key 'scheduler.total_num_steps' is required for {self.type}; "
                    "set it to the number of optimizer steps of the run"
                )
            _check(
                self.total_num_steps > self.warmup_num_steps - (self.type == "WarmupCosineLR"),
                "scheduler.total_num_steps",
                self.total_num_steps,
                f"greater than scheduler.warmup_num_steps ({self.warmup_num_steps})",
            )
        _check(
            self.warmup_num_steps >= 0,
            "scheduler.warmup_num_steps",
            self.warmup_num_steps,
            "an integer >= 0",
        )
        _check(
            self.cycle_first_step_size >= 1,
            "scheduler.cycle_first_step_size",
            self.cycle_first_step_size,
            "an integer >= 1",
        )


@dataclass(frozen=True)
class ActivationCheckpointConfig:
    """Activation checkpointing, applied to blocks before sharding."""

    mode: Literal["none", "full", "every_n", "selective"] = "none"
    """full: every block; every_n: every n-th block; selective: every block, but the outputs
    of matmuls are saved and only cheap ops are recomputed."""
    every_n: int = 2
    """With mode every_n: checkpoint blocks 0, n, 2n, ..."""

    def __post_init__(self) -> None:
        _check(
            self.every_n >= 1, "activation_checkpointing.every_n", self.every_n, "an integer >= 1"
        )


@dataclass(frozen=True)
class Config:
    """Everything `fsdpx.shard` needs. Build it directly, or with from_dict/from_file."""

    train_micro_batch_size_per_gpu: int = 1
    """Samples per rank per micro-step (informational for the engine; used by the
    DeepSpeed batch-size rule and by examples)."""
    gradient_accumulation_steps: int = 1
    """Micro-steps per optimizer step; engine.backward divides the loss by this."""
    gradient_clipping: float = 0.0
    """Clip the global gradient 2-norm to this value; 0 disables clipping."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    fp16: LossScaleConfig = field(default_factory=LossScaleConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    activation_checkpointing: ActivationCheckpointConfig = field(
        default_factory=ActivationCheckpointConfig
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when available, else CPU."""
    seed: int = 0
    """Seeds torch's RNGs on every rank before the model is materialised."""
    timeout_s: float = 600.0
    """Process-group timeout: a collective waiting longer than this fails the job."""
    compile: bool = False
    """torch.compile each block before sharding."""

    def __post_init__(self) -> None:
        _check(
            self.train_micro_batch_size_per_gpu >= 1,
            "train_micro_batch_size_per_gpu",
            self.train_micro_batch_size_per_gpu,
            "an integer >= 1",
        )
        _check(
            self.gradient_accumulation_steps >= 1,
            "gradient_accumulation_steps",
            self.gradient_accumulation_steps,
            "an integer >= 1",
        )
        _check(
            self.gradient_clipping >= 0,
            "gradient_clipping",
            self.gradient_clipping,
            ">= 0 (0 disables clipping)",
        )
        _check(self.timeout_s > 0, "timeout_s", self.timeout_s, "> 0 seconds")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Build a Config from plain data, rejecting unknown keys and bad values."""
        return _parse_dataclass(cls, data, "")

    @classmethod
    def from_file(cls, path: str | Path) -> Config:
        """Load a JSON (.json) or TOML (.toml) file with the same keys as from_dict."""
        path = Path(path)
        text = path.read_text()
        if path.suffix == ".toml":
            import tomllib

            try:
                data = tomllib.loads(text)
            except tomllib.TOMLDecodeError as e:
                raise ValueError(f"{path}: not valid TOML: {e}") from None
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON: {e}") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)


# --- strict parsing -------------------------------------------------------------------


def _parse_dataclass(cls: type, data: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "config"
    if not isinstance(data, dict):
        raise ValueError(f"config key '{where}' must be a table/object; got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = (
                f"; did you mean '{prefix}{close[0]}'?"
                if close
                else (f"; known keys here: {', '.join(names)}")
            )
            raise ValueError(f"unknown config key '{prefix}{key}'{hint}")
        kwargs[key] = _parse_value(hints[key], value, f"{prefix}{key}")
    return cls(**kwargs)


def _parse_value(tp: Any, value: Any, key: str) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _parse_dataclass(tp, value, key + ".")
    if origin is Literal:
        allowed = get_args(tp)
        # bool is an int subclass: True must not pass as stage 1.
        if value in allowed and type(value) is type(allowed[allowed.index(value)]):
            return value
        raise ValueError(
            f"config key '{key}' must be one of {', '.join(map(repr, allowed))}; got {value!r}"
        )
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _parse_value(args[0], value, key)
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"config key '{key}' must be a list; got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_parse_value(args[0], v, key) for v in value)
        if len(value) != len(args):
            raise ValueError(f"config key '{key}' must have {len(args)} items; got {value!r}")
        return tuple(_parse_value(a, v, key) for a, v in zip(args, value, strict=True))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"config key '{key}' must be true or false; got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"config key '{key}' must be an integer; got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"config key '{key}' must be a number; got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"config key '{key}' must be a string; got {value!r}")
    raise AssertionError(f"unhandled config type {tp!r} for '{key}'")
