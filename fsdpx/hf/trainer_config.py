"""`fsdpx_config=` for `fsdpx.hf.Trainer`: which kind of config it is, and the DeepSpeed
JSON's "auto" values filled from `TrainingArguments`.

[Note: auto values] transformers' DeepSpeed integration (`HfTrainerDeepSpeedConfig`)
fills every "auto" value from `TrainingArguments` and refuses a value that is set and
differs, listing all of them at once; the same pairs are used here:

    train_micro_batch_size_per_gpu   per_device_train_batch_size
    gradient_accumulation_steps      gradient_accumulation_steps
    train_batch_size                 data-parallel world x the two above
    gradient_clipping                max_grad_norm
    optimizer.params.lr / betas / eps / weight_decay
                                     learning_rate / (adam_beta1, adam_beta2) / adam_epsilon / weight_decay
    scheduler.params.warmup_min_lr / warmup_max_lr
                                     0 / learning_rate
    scheduler.params.warmup_num_steps / total_num_steps
                                     get_warmup_steps(max_steps) / max_steps (known at train())
    fp16.enabled / bf16.enabled      fp16 / bf16

Absent batch keys (micro batch, accumulation) are the arguments' values. A native
config (an `fsdpx.Config`, a dict or file with fsdpx's own keys) has no "auto":
its batch size, accumulation and clipping must equal the TrainingArguments' (an error
naming both otherwise), since the Trainer's data loader and loss scaling follow the
arguments. A dict or file is DeepSpeed's when it has a top-level key only DeepSpeed has
(DESIGN.md clarification 8); when it has neither kind's keys, it is an error naming both
constructors.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

from fsdpx.config import Config
from fsdpx.deepspeed._json import load_deepspeed_config
from fsdpx.deepspeed._keys import DS_KEYS

__all__ = [
    "ConfigSource",
    "check_native",
    "deepspeed_dp_world",
    "default_config",
    "fill_deepspeed",
    "resolve_source",
]

_NATIVE_TOP = {f.name for f in dataclasses.fields(Config)}
_DS_TOP = {key.split(".", 1)[0] for key in DS_KEYS}
_DS_ONLY_TOP = _DS_TOP - _NATIVE_TOP


@dataclasses.dataclass
class ConfigSource:
    """The fsdpx_config as given, classified; `build(max_steps)` makes the Config."""

    native: Config | None
    deepspeed: dict[str, Any] | None
    name: str
    """Both None: no fsdpx_config (fsdpx defaults, the Trainer's optimizer and schedule)."""

    @property
    def has_optimizer(self) -> bool:
        """Whether the config names the optimizer (else the Trainer's args.optim is used)."""
        return self.native is not None or "optimizer" in (self.deepspeed or {})

    @property
    def has_scheduler(self) -> bool:
        """Whether the config has a schedule (else the Trainer's lr_scheduler_type)."""
        if self.native is not None:
            return self.native.scheduler.type != "none"
        return "scheduler" in (self.deepspeed or {})


def _is_deepspeed(data: dict[str, Any], name: str) -> bool:
    keys = set(data)
    for section in ("optimizer", "scheduler"):
        if isinstance(data.get(section), dict) and "params" in data[section]:
            return True
    if keys & _DS_ONLY_TOP:
        return True
    if keys <= _NATIVE_TOP:
        return False
    raise ValueError(
        f"{name}: cannot tell whether fsdpx_config is a DeepSpeed config or a native fsdpx "
        f"one: its keys {sorted(keys - _NATIVE_TOP)} are in neither. Load it yourself with "
        "fsdpx.Config.from_deepspeed(...) or fsdpx.Config.from_file(...) and pass the Config"
    )


def resolve_source(source: Any) -> ConfigSource:
    """Classify fsdpx_config (Config, dict, or path to a native / DeepSpeed file)."""
    if source is None:
        return ConfigSource(None, None, "<default>")
    if isinstance(source, Config):
        return ConfigSource(source, None, "<Config>")
    if isinstance(source, (str, Path)):
        data, name = load_deepspeed_config(source)
        if not _is_deepspeed(data, name):
            return ConfigSource(Config.from_file(source), None, name)
        return ConfigSource(None, data, name)
    if isinstance(source, dict):
        if _is_deepspeed(source, "<dict>"):
            return ConfigSource(None, copy.deepcopy(source), "<dict>")
        return ConfigSource(Config.from_dict(source), None, "<dict>")
    raise TypeError(
        f"fsdpx_config must be an fsdpx.Config, a dict or a path; got {type(source).__name__}"
    )


def _get(data: dict[str, Any], key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _put(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    *parents, last = key.split(".")
    for part in parents:
        node = node[part]
    node[last] = value


def deepspeed_dp_world(data: dict[str, Any], world_size: int) -> int:
    """The data-parallel ranks of a DeepSpeed JSON's job: the world divided by its
    tensor-parallel, sequence-parallel and pipeline sizes, as DeepSpeed's batch rule does
    (a size that does not divide the world is `Config.from_deepspeed`'s error)."""
    split = 1
    for key in ("tensor_parallel.autotp_size", "sequence_parallel_size", "pipeline.stages"):
        value = _get(data, key)
        if isinstance(value, int) and value > 0:
            split *= value
    return max(1, world_size // split)


def fill_deepspeed(
    data: dict[str, Any], args: Any, world_size: int, max_steps: int | None, name: str
) -> dict[str, Any]:
    """The DeepSpeed dict with "auto" filled from `args` ([Note: auto values]). Raises
    ValueError listing every set value that differs from the argument it pairs with.
    With max_steps None the scheduler's step counts stay as given."""
    out = copy.deepcopy(data)
    mbs, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    pairs: list[tuple[str, Any, str]] = [
        ("train_micro_batch_size_per_gpu", mbs, "per_device_train_batch_size"),
        ("gradient_accumulation_steps", gas, "gradient_accumulation_steps"),
        (
            "train_batch_size",
            world_size * mbs * gas,
            "train_batch_size (data-parallel world x micro x accumulation)",
        ),
        ("gradient_clipping", args.max_grad_norm, "max_grad_norm"),
        ("optimizer.params.lr", args.learning_rate, "learning_rate"),
        ("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2"),
        ("optimizer.params.eps", args.adam_epsilon, "adam_epsilon"),
        ("optimizer.params.weight_decay", args.weight_decay, "weight_decay"),
        ("scheduler.params.warmup_min_lr", 0, "warmup_min_lr"),
        ("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate"),
        ("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval"),
        ("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval"),
    ]
    if max_steps is not None:
        pairs += [
            ("scheduler.params.warmup_num_steps", args.get_warmup_steps(max_steps), "warmup_steps"),
            ("scheduler.params.total_num_steps", max_steps, "max_steps"),
        ]
    # The Trainer's data loader and loss division follow the arguments: absent batch keys
    # are the arguments' values (DeepSpeed would refuse a config with neither).
    out.setdefault("train_micro_batch_size_per_gpu", mbs)
    out.setdefault("gradient_accumulation_steps", gas)
    mismatches = []
    for key, hf_value, hf_name in pairs:
        value = _get(out, key)
        if value is None and key.endswith(".enabled") and hf_value:
            # fp16/bf16 on in the arguments but the section absent: DeepSpeed runs fp32.
            mismatches.append(f"- ds {key.split('.')[0]} absent (fp32) vs hf {hf_name}=True")
        if value is None:
            continue
        if value == "auto":
            _put(out, key, hf_value)
        elif (
            key.endswith("betas")
            and list(value) != hf_value
            or (not key.endswith("betas") and value != hf_value)
        ):
            mismatches.append(f"- ds {key}={value} vs hf {hf_name}={hf_value}")
    if mismatches:
        raise ValueError(
            f"{name}: please correct the following DeepSpeed config values that mismatch "
            "TrainingArguments values:\n" + "\n".join(mismatches) + "\nThe easiest method "
            "is to set these DeepSpeed config values to 'auto'."
        )
    return out


def default_config(args: Any) -> Config:
    """No fsdpx_config: fsdpx's defaults (ZeRO-3) with the arguments' batch size,
    accumulation, clipping and precision ([Note: Trainer precision])."""
    precision = {"param_dtype": _args_dtype(args), "reduce_dtype": "fp32"}
    return Config.from_dict(
        {
            "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "gradient_clipping": float(args.max_grad_norm),
            "precision": precision,
        }
    )


def _args_dtype(args: Any) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def _config_dtype(cfg: Config) -> str:
    """The compute dtype a config gives: bf16 autocast computes in bf16 too."""
    return "bf16" if cfg.precision.autocast == "bf16" else cfg.precision.param_dtype


def check_native(cfg: Config, args: Any, name: str) -> None:
    """A native config's batch, accumulation, clipping and compute dtype must be the
    arguments'."""
    pairs = [
        (
            "train_micro_batch_size_per_gpu",
            cfg.train_micro_batch_size_per_gpu,
            "per_device_train_batch_size",
            args.per_device_train_batch_size,
        ),
        (
            "gradient_accumulation_steps",
            cfg.gradient_accumulation_steps,
            "gradient_accumulation_steps",
            args.gradient_accumulation_steps,
        ),
        ("gradient_clipping", cfg.gradient_clipping, "max_grad_norm", args.max_grad_norm),
        (
            "precision (compute dtype)",
            _config_dtype(cfg),
            "bf16/fp16 (compute dtype)",
            _args_dtype(args),
        ),
    ]
    bad = [f"- fsdpx {a}={v} vs hf {b}={w}" for a, v, b, w in pairs if v != w]
    if bad:
        raise ValueError(
            f"{name}: the fsdpx config and the TrainingArguments disagree:\n"
            + "\n".join(bad)
            + "\nSet the fsdpx values to the arguments' (or pass a DeepSpeed JSON with "
            '"auto" values).'
        )
