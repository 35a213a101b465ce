"""Training configuration: frozen dataclasses, the only place defaults live.

`Config.from_dict` / `Config.from_file` are strict: an unknown key is an error with a
did-you-mean, a value of the wrong type or outside its allowed set is an error that names
the key, the value and what is allowed. A silently ignored option is a bug, so a key that
the chosen variant does not read, set away from its default, is an error too (variants:
scheduler.type, optimizer.type, activation_checkpointing.mode). All are ValueErrors.

Example::

    cfg = Config.from_dict({"zero": {"stage": 2}, "precision": {"param_dtype": "bf16"}})
    cfg = Config.from_file("train.json")          # JSON or TOML
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fsdpx.config_sections.checks import DType, check
from fsdpx.config_sections.optim import SCHEDULER_KEYS, OptimizerConfig, SchedulerConfig
from fsdpx.config_sections.outputs import CheckpointConfig, TelemetryConfig
from fsdpx.config_sections.parallel import (
    PIPELINE_SCHEDULES,
    TP_STYLES,
    ActivationCheckpointConfig,
    ContextParallelConfig,
    MoEConfig,
    MoEPlanEntry,
    PipelineConfig,
    TensorParallelConfig,
)
from fsdpx.config_sections.training import (
    LossScaleConfig,
    MeshConfig,
    OffloadConfig,
    PrecisionConfig,
    ZeroConfig,
)
from fsdpx.optimizers import EXCHANGING_OPTIMIZERS
from fsdpx.strict_parse import parse_dataclass

__all__ = [
    "PIPELINE_SCHEDULES",
    "SCHEDULER_KEYS",
    "TP_STYLES",
    "ActivationCheckpointConfig",
    "CheckpointConfig",
    "Config",
    "ContextParallelConfig",
    "DType",
    "LossScaleConfig",
    "MeshConfig",
    "MoEConfig",
    "MoEPlanEntry",
    "OffloadConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "PrecisionConfig",
    "SchedulerConfig",
    "TelemetryConfig",
    "TensorParallelConfig",
    "ZeroConfig",
]


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
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    context_parallel: ContextParallelConfig = field(default_factory=ContextParallelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when available, else CPU."""
    seed: int = 0
    """Seeds torch's RNGs on every rank before the model is materialised."""
    timeout_s: float = 600.0
    """Process-group timeout: a collective waiting longer than this fails the job."""
    compile: bool = False
    """torch.compile each block before sharding."""

    def __post_init__(self) -> None:
        check(
            self.train_micro_batch_size_per_gpu >= 1,
            "train_micro_batch_size_per_gpu",
            self.train_micro_batch_size_per_gpu,
            "an integer >= 1",
        )
        check(
            self.gradient_accumulation_steps >= 1,
            "gradient_accumulation_steps",
            self.gradient_accumulation_steps,
            "an integer >= 1",
        )
        check(
            self.gradient_clipping >= 0,
            "gradient_clipping",
            self.gradient_clipping,
            ">= 0 (0 disables clipping)",
        )
        check(self.timeout_s > 0, "timeout_s", self.timeout_s, "> 0 seconds")
        if self.optimizer.type in EXCHANGING_OPTIMIZERS:
            _check_onebit(self)
        if self.precision.master_dtype != "fp32":
            _check_bf16_masters(self)
        if self.precision.autocast != "none":
            for key, value, needed in (
                ("precision.param_dtype", self.precision.param_dtype, "fp32"),
                ("mesh.pp", self.mesh.pp, 1),
            ):
                if value != needed:
                    raise ValueError(
                        f"config key 'precision.autocast' = {self.precision.autocast!r} needs "
                        f"{key} = {needed!r} (autocast casts per op: the parameters stay fp32, "
                        f"and the pipeline schedule runs its stages outside the engine's "
                        f"forward); got {value!r}. Set {key} = {needed!r}, or use "
                        "precision.param_dtype 'bf16' instead of autocast"
                    )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Build a Config from plain data, rejecting unknown keys and bad values."""
        return parse_dataclass(cls, data, "")

    @classmethod
    def from_file(cls, path: str | Path) -> Config:
        """Load a JSON (.json) or TOML (.toml) file with the same keys as from_dict.

        Every error about the file's content is a ValueError that starts with the path.
        """
        path = Path(path)
        kind = path.suffix.lower()
        if kind not in (".json", ".toml"):
            raise ValueError(
                f"{path}: config files must end in .json or .toml; got suffix {path.suffix!r}. "
                "Rename the file, or parse it yourself and call Config.from_dict."
            )
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text: {e}") from None
        if kind == ".toml":
            import tomllib

            try:
                data = tomllib.loads(text)
            except (tomllib.TOMLDecodeError, ValueError) as e:
                raise ValueError(f"{path}: not valid TOML: {e}") from None
        else:
            try:
                data = json.loads(text)
            # JSONDecodeError, or a ValueError such as Python's limit on integer digits.
            except ValueError as e:
                raise ValueError(f"{path}: not valid JSON: {e}") from None
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def from_deepspeed(
        cls, path_or_dict: str | Path | Mapping[str, Any], *, world_size: int | None = None
    ) -> Config:
        """Translate a DeepSpeed config (file with hjson comments/trailing commas, or dict).

        Args:
            path_or_dict: the ds_config file or its loaded dict.
            world_size: ranks in the job, for the batch-size rule and MiCS; None reads the
                WORLD_SIZE environment variable (torchrun sets it), else 1.
        Returns:
            The Config. Mapped and ignored keys are reported once, in one line on the
            "fsdpx" logger; keys fsdpx cannot honour, unknown keys and an inconsistent
            batch size raise ValueError. `fsdpx config explain FILE` prints the table.

        Example::

            cfg = Config.from_deepspeed("ds_config_zero2.json", world_size=8)
        """
        from fsdpx.deepspeed._config import from_deepspeed

        return from_deepspeed(path_or_dict, world_size=world_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)


def _check_bf16_masters(cfg: Config) -> None:
    """precision.master_dtype bf16: what it needs (PrecisionConfig.master_dtype)."""
    o = cfg.optimizer
    found = {
        "precision.param_dtype": (cfg.precision.param_dtype, "bf16", "'bf16'"),
        "zero.stage": (cfg.zero.stage, cfg.zero.stage if cfg.zero.stage else None, "1, 2 or 3"),
        "zero.offload_optimizer.device": (
            cfg.zero.offload_optimizer.device,
            "none",
            "'none' (offload keeps fp32 masters on the host)",
        ),
        "precision.autocast": (cfg.precision.autocast, "none", "'none'"),
        "optimizer.type": (
            o.type,
            o.type if o.type in ("adamw", "adam", "sgd") else None,
            "'adamw', 'adam' or 'sgd' (the others keep fp32 state)",
        ),
        "optimizer.bias_correction": (
            o.bias_correction,
            True,
            "true (the fused Adam without bias correction steps fp32 tensors only)",
        ),
    }
    for key, (value, ok, needed) in found.items():
        if value != ok:
            raise ValueError(
                f"config key 'precision.master_dtype' = 'bf16' (bf16 master weights, gradients "
                f"and optimizer states) needs {key} = {needed}; got {value!r}. Change {key}, "
                "or keep precision.master_dtype 'fp32'"
            )


def _check_onebit(cfg: Config) -> None:
    """1-bit Adam and 0/1 Adam need full replicas (DeepSpeed runs them at ZeRO stage 0
    only)."""
    o = cfg.optimizer
    check(
        o.freeze_step >= 1,
        "optimizer.freeze_step",
        o.freeze_step,
        "an integer >= 1 (full-precision warmup steps)",
    )
    for name in ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"):
        check(getattr(o, name) >= 1, f"optimizer.{name}", getattr(o, name), "an integer >= 1")
    if o.type == "onebit_lamb" and o.bias_correction:
        raise ValueError(
            f"optimizer.type {o.type!r} has no bias correction (DeepSpeed's OnebitLamb never "
            "applied it); set optimizer.bias_correction = false"
        )
    check(
        0 <= o.coeff_beta < 1 and 0 < o.factor_min <= o.factor_max and o.factor_threshold >= 0,
        "optimizer.coeff_beta/factor_min/factor_max/factor_threshold",
        (o.coeff_beta, o.factor_min, o.factor_max, o.factor_threshold),
        "0 <= coeff_beta < 1, 0 < factor_min <= factor_max, factor_threshold >= 0",
    )
    found = {
        "zero.stage": (cfg.zero.stage, 0),
        "mesh.tp": (cfg.mesh.tp, 1),
        "mesh.pp": (cfg.mesh.pp, 1),
        "zero.offload_optimizer.device": (cfg.zero.offload_optimizer.device, "none"),
    }
    for key, (value, needed) in found.items():
        if value != needed:
            raise ValueError(
                f"optimizer.type {o.type!r} exchanges compressed momentum between full "
                f"replicas (DeepSpeed runs the 1-bit optimizers at ZeRO stage 0 only), so it needs "
                f"{key} = {needed!r}; got {value!r}. Set {key} = {needed!r}, or use "
                "optimizer.type 'adamw'"
            )
