"""DeepSpeed JSON config -> fsdpx.Config, driven by the key table in fsdpx.deepspeed._keys.

A DeepSpeed script ports by replacing ``deepspeed.initialize(...)`` with::

    engine = fsdpx.shard(model, fsdpx.Config.from_deepspeed("ds_config.json"))

Every key of the file ends in exactly one row: mapped (with the fsdpx value), ignored
(tuning FSDP2 does itself, with the reason) or refused (a ValueError naming the key and
what to use instead). Unknown keys are errors with a did-you-mean. The mapped and ignored
keys are reported once, in one summary line logged on the "fsdpx" logger and returned in
the Translation; `fsdpx config explain FILE` prints the whole table.

Where DeepSpeed's defaults differ from fsdpx's, the DeepSpeed default is written out:
ZeRO stage 0 without a zero_optimization block, warmup_max_lr 0.001, reduction in the
compute dtype without communication_data_type, Adam meaning AdamW (adam_w_mode).
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fsdpx.config import SCHEDULER_KEYS, Config
from fsdpx.deepspeed._json import load_deepspeed_config
from fsdpx.deepspeed._keys import DS_KEYS, OPTIMIZER_TYPES, KeyRule

logger = logging.getLogger("fsdpx")

Status = Literal["mapped", "ignored", "refused", "unknown", "error"]
ABSENT = "<absent>"
"""The value shown for a key the file leaves out whose DeepSpeed default fsdpx writes."""
DERIVED = "<derived>"
"""The value shown for a batch key the file leaves out and the batch rule derives."""
_DTYPES = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "bfp16": "bf16"}


@dataclass(frozen=True)
class Row:
    """What happened to one DeepSpeed key."""

    key: str
    value: Any
    status: Status
    detail: str
    """mapped: the fsdpx value(s); ignored: why; refused/unknown/error: the message."""
    tag: str = ""
    """ignored only: the short reason used in the summary line."""


@dataclass(frozen=True)
class Translation:
    """The result of translating one DeepSpeed config."""

    config: Config
    rows: tuple[Row, ...]
    world_size: int
    summary: str
    """The one-line report of mapped and ignored keys (logged by from_deepspeed)."""


class _Translator:
    """One translation: walks the file, fills `native` (fsdpx keys) and `rows`."""

    def __init__(self, data: dict[str, Any], name: str, world_size: int) -> None:
        self.name = name
        self.world_size = world_size
        self.leaves: dict[str, Any] = {}
        self.sections: set[str] = set()
        self.rows: dict[str, Row] = {}
        self.native: dict[str, Any] = {}
        self._walk(data, "")

    # --- bookkeeping ------------------------------------------------------------------

    def _walk(self, data: Mapping[str, Any], prefix: str) -> None:
        for key, value in data.items():
            path = f"{prefix}{key}"
            rule = DS_KEYS.get(path)
            if rule is None:
                self._row(path, value, "unknown", _unknown_message(path))
            elif rule.action == "section":
                if path == "zero_optimization" and isinstance(value, bool):
                    value = {"stage": 1 if value else 0}  # DeepSpeed's old boolean form
                if not isinstance(value, Mapping):
                    self._row(path, value, "error", f"'{path}' must be an object; got {value!r}")
                    continue
                self.sections.add(path)
                self._walk(value, path + ".")
            else:
                self.leaves[path] = value

    def _row(self, key: str, value: Any, status: Status, detail: str, tag: str = "") -> None:
        assert key not in self.rows, f"{key} reported twice"
        self.rows[key] = Row(key, value, status, detail, tag)

    def _error(self, key: str, value: Any, message: str) -> None:
        self._row(key, value, "error", message)

    def _set(self, target: str, value: Any) -> None:
        node = self.native
        *parents, last = target.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value

    def _get(self, key: str, default: Any = None) -> Any:
        value = self.leaves.get(key, default)
        return default if value == "auto" else value

    def _map(self, key: str, target: str, value: Any, note: str = "") -> None:
        self._set(target, value)
        self._row(key, self.leaves.get(key, ABSENT), "mapped", f"{target} = {value!r}{note}")

    # --- the translation --------------------------------------------------------------

    def run(self) -> None:
        self._precision()
        self._zero()
        self._optimizer()
        self._scheduler()
        self._parallel_and_batch()
        self._activation_checkpointing()
        self._telemetry()
        for key, value in self.leaves.items():
            if key not in self.rows:
                self._generic(key, value, DS_KEYS[key])

    def _generic(self, key: str, value: Any, rule: KeyRule) -> None:
        if rule.action == "ignored":
            self._row(key, value, "ignored", rule.note, rule.tag)
        elif rule.action == "refused":
            if _accepts(value, rule.accept):
                self._row(key, value, "ignored", f"feature off ({value!r})", "feature off")
            else:
                self._row(key, value, "refused", f"'{key}' = {value!r}: {rule.note}")
        elif value == "auto":
            self._row(key, value, "mapped", f"'auto' -> fsdpx default {rule.target}", "auto")
        elif rule.target is None:
            # A derived key whose handler stopped at an earlier error in its group.
            self._row(key, value, "error", "not translated: see the other errors")
        else:
            if key.endswith(".device") and isinstance(value, str):
                value = value.lower()
            self._map(key, rule.target, value)

    def _precision(self) -> None:
        fp16 = self._flag("fp16.enabled")
        bf16 = self._flag("bf16.enabled") or self._flag("bfloat16.enabled")
        if fp16 and bf16:
            self._error("fp16.enabled", True, "fp16 and bf16 are both enabled; enable one")
            return
        autocast = self._torch_autocast(fp16 or bf16)
        if autocast is None:
            return
        param = "fp16" if fp16 else "bf16" if bf16 else "fp32"
        comm = self.leaves.get("communication_data_type")
        reduce = param
        if comm is not None and comm != "auto":
            reduce = _DTYPES.get(str(comm).lower(), "")
            if not reduce:
                self._error(
                    "communication_data_type",
                    comm,
                    f"'communication_data_type' must be one of fp32, fp16, bf16; got {comm!r}",
                )
                return
        master = self._bf16_masters(bf16)
        if master is None:
            return
        self._set(
            "precision",
            {
                "param_dtype": param,
                "reduce_dtype": reduce,
                "autocast": autocast,
                "master_dtype": master,
            },
        )
        why = ""
        if comm in (None, "auto"):
            why = " (no communication_data_type: reduce in the compute dtype, as DeepSpeed does)"
            if autocast != "none":
                why = (
                    " (no communication_data_type: every gradient reduced in fp32, where "
                    "DeepSpeed reduces those of torch_autocast.lower_precision_safe_modules in "
                    "bf16)"
                )
        for key in ("fp16.enabled", "bf16.enabled", "bfloat16.enabled"):
            if key in self.leaves and key not in self.rows:  # 'auto' has its row already
                detail = f"precision.param_dtype = {param!r}, reduce_dtype = {reduce!r}{why}"
                self._row(key, self.leaves[key], "mapped", detail)
        if "communication_data_type" in self.leaves:
            self._row(
                "communication_data_type",
                comm,
                "mapped",
                f"precision.reduce_dtype = {reduce!r}",
            )
        if not fp16:
            for key in [k for k in self.leaves if k.startswith("fp16.")]:
                if key not in self.rows:
                    self._row(key, self.leaves[key], "ignored", "fp16 is not enabled", "fp16 off")

    def _bf16_masters(self, bf16: bool) -> str | None:
        """bf16_master_weights_and_grads + bf16_optimizer_states -> precision.master_dtype
        ("fp32" or "bf16"); None after an error."""
        keys = {}
        for name in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
            for block in ("bf16", "bfloat16"):
                if f"{block}.{name}" in self.leaves:
                    keys[name] = f"{block}.{name}"
        master_key = keys.get("bf16_master_weights_and_grads", "bf16.bf16_master_weights_and_grads")
        states_key = keys.get("bf16_optimizer_states", "bf16.bf16_optimizer_states")
        master, states = self._flag(master_key), self._flag(states_key)
        if not (master or states):
            for key in keys.values():
                if key not in self.rows:
                    self._row(
                        key, self.leaves[key], "ignored", "feature off (false)", "feature off"
                    )
            return "fp32"
        if states and not master:
            self._error(
                states_key,
                True,
                "bf16_optimizer_states requires bf16_master_weights_and_grads to be enabled "
                "(DeepSpeed's rule)",
            )
            return None
        if not states:
            self._error(
                master_key,
                True,
                "bf16 master weights with fp32 optimizer states is DeepSpeed's ZeRO-Offload + "
                "DeepSpeedCPUAdam layout, which fsdpx does not implement (its offload keeps fp32 "
                "masters): set bf16_optimizer_states true too (bf16 moments), or remove the key",
            )
            return None
        if not bf16:
            self._error(master_key, True, 'bf16 master weights need "bf16": {"enabled": true}')
            return None
        for key in (master_key, states_key):
            self._row(key, True, "mapped", "precision.master_dtype = 'bf16'")
        return "bf16"

    def _torch_autocast(self, cast_params: bool) -> str | None:
        """DeepSpeed's torch_autocast block -> precision.autocast ("none" or "bf16"); None
        after an error."""
        if not self._flag("torch_autocast.enabled"):
            for key in [k for k in self.leaves if k.startswith("torch_autocast.")]:
                if key not in self.rows:
                    self._row(key, self.leaves[key], "ignored", "torch_autocast is not enabled")
            return "none"
        if cast_params:
            self._error(
                "torch_autocast.enabled",
                True,
                "torch_autocast and bf16/fp16 are both enabled; torch_autocast keeps fp32 "
                "parameters and casts per op: enable one",
            )
            return None
        dtype = self.leaves.get("torch_autocast.dtype", ABSENT)
        if str(dtype).lower() not in ("bfloat16", "bf16", "torch.bfloat16"):
            self._error(
                "torch_autocast.dtype",
                dtype,
                "fsdpx's autocast runs in bfloat16 only (float16 autocast needs a gradient "
                "scaler; torch's default autocast dtype on CUDA is float16): set "
                '"dtype": "bfloat16", or use "fp16": {"enabled": true} for fp16 training',
            )
            return None
        self._row("torch_autocast.enabled", True, "mapped", "precision.autocast = 'bf16'")
        self._row("torch_autocast.dtype", dtype, "mapped", "precision.autocast = 'bf16'")
        key = "torch_autocast.lower_precision_safe_modules"
        if key in self.leaves:
            self._row(
                key,
                self.leaves[key],
                "ignored",
                "torch.autocast decides per op which run in bf16; gradients are reduced in "
                "precision.reduce_dtype (communication_data_type; fp32 by default)",
                "autocast",
            )
        return "bf16"

    def _flag(self, key: str) -> bool:
        value = self.leaves.get(key, False)
        if value == "auto":
            self._row(key, value, "mapped", "'auto' -> false (fsdpx default)", "auto")
            return False
        if not isinstance(value, bool):
            self._error(key, value, f"'{key}' must be true or false; got {value!r}")
            return False
        return value

    def _zero(self) -> None:
        stage = self.leaves.get("zero_optimization.stage", 0)
        if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
            self._error("zero_optimization.stage", stage, f"stage must be 0-3; got {stage!r}")
            stage = 0
        note = "" if "zero_optimization" in self.sections else " (no zero_optimization block:"
        note += " DeepSpeed's default; fsdpx's own default is 3)" if note else ""
        if "zero_optimization.stage" not in self.rows:
            self._map("zero_optimization.stage", "zero.stage", stage, note)
        for legacy, block in (
            ("cpu_offload", "offload_optimizer"),
            ("cpu_offload_param", "offload_param"),
            ("cpu_offload_params", "offload_param"),
        ):
            key = f"zero_optimization.{legacy}"
            if key in self.leaves:
                on = self.leaves[key] is True
                pin = self.leaves.get("zero_optimization.cpu_offload_use_pin_memory")
                if on and f"zero_optimization.{block}.device" not in self.leaves:
                    self._set(f"zero.{block}.device", "cpu")
                    if isinstance(pin, bool):
                        self._set(f"zero.{block}.pin_memory", pin)
                detail = f"zero.{block}.device = 'cpu'" if on else "false: no offload"
                self._row(key, self.leaves[key], "mapped", detail)
        key = "zero_optimization.cpu_offload_use_pin_memory"
        if key in self.leaves:
            self._row(key, self.leaves[key], "mapped", "pin_memory of the legacy cpu offloads")
        device = str(self.leaves.get("zero_optimization.offload_param.device", "none")).lower()
        if device != "none" and stage != 3:
            self._error(
                "zero_optimization.offload_param.device",
                device,
                f"offload_param needs ZeRO stage 3 (parameters are sharded only there); got "
                f"stage {stage}. Use offload_optimizer, or stage 3",
            )
        mics = self.leaves.get("zero_optimization.mics_shard_size")
        if mics is not None:
            if not isinstance(mics, int) or isinstance(mics, bool):
                self._error("zero_optimization.mics_shard_size", mics, "must be an integer")
            elif mics <= 0:
                self._row("zero_optimization.mics_shard_size", mics, "ignored", "off", "off")
            elif stage != 3:
                self._error(
                    "zero_optimization.mics_shard_size",
                    mics,
                    f"MiCS (mics_shard_size {mics}) needs ZeRO stage 3; got stage {stage}",
                )

    def _optimizer(self) -> None:
        if "optimizer" not in self.sections:
            self._row(
                "optimizer",
                ABSENT,
                "mapped",
                "fsdpx builds its default optimizer (adamw, lr 0.001) unless fsdpx.shard gets "
                "optimizer=...; DeepSpeed would use the optimizer you passed it",
            )
            return
        raw = self.leaves.get("optimizer.type")
        kind = OPTIMIZER_TYPES.get(str(raw).lower())
        if kind is None:
            self._row(
                "optimizer.type",
                raw,
                "refused",
                f"optimizer type {raw!r} is not built into fsdpx; pass optimizer=callable to "
                "fsdpx.shard, e.g. fsdpx.shard(model, cfg, optimizer=lambda params: "
                "MyOptimizer(params, lr=...)), and remove the optimizer block",
            )
            return
        w_mode = self.leaves.get("optimizer.params.adam_w_mode", True)
        if str(raw).lower() == "adam" and w_mode is False:
            kind = "adam"
        note = ""
        if str(raw).lower() == "adam" and kind == "adamw":
            note = " (DeepSpeed's Adam has adam_w_mode true by default: decoupled weight decay)"
        self._map("optimizer.type", "optimizer.type", kind, note)
        if kind in ("onebit_adam", "zero_one_adam"):
            self._onebit_bias_correction(str(raw))
        if kind == "onebit_lamb":
            self._lamb_bias_correction(str(raw))
        if "optimizer.params.adam_w_mode" in self.leaves:
            self._row(
                "optimizer.params.adam_w_mode", w_mode, "mapped", f"optimizer.type = {kind!r}"
            )

    def _onebit_bias_correction(self, name: str) -> None:
        key = "optimizer.params.bias_correction"
        value = self.leaves.get(key, True)
        if not isinstance(value, bool):
            self._error(key, value, "must be true or false")
            return
        self._map(
            key,
            "optimizer.bias_correction",
            value,
            f" (DeepSpeed's {name} accepted bias_correction but never applied it: its "
            "updates were uncorrected, as fsdpx's are with false; fsdpx applies true, "
            "which a short freeze phase needs: [Note: 0/1 Adam's bias correction])",
        )

    def _lamb_bias_correction(self, name: str) -> None:
        key = "optimizer.params.bias_correction"
        value = self.leaves.get(key, True)
        if not isinstance(value, bool):
            self._error(key, value, "must be true or false")
            return
        self._map(
            key,
            "optimizer.bias_correction",
            False,
            f" (DeepSpeed's {name} accepts bias_correction ({value}) but never applies it; "
            "fsdpx's has the same uncorrected update)",
        )

    def _scheduler(self) -> None:
        if "scheduler" not in self.sections:
            return
        kind = self.leaves.get("scheduler.type")
        if kind not in SCHEDULER_KEYS or kind == "none":
            self._row(
                "scheduler.type",
                kind,
                "refused",
                f"scheduler type {kind!r} is not built into fsdpx (it has "
                f"{', '.join(k for k in SCHEDULER_KEYS if k != 'none')}); pass "
                "lr_scheduler=callable to fsdpx.shard, e.g. lambda opt: "
                "torch.optim.lr_scheduler.LambdaLR(opt, ...), and remove the scheduler block",
            )
            return
        self._map("scheduler.type", "scheduler.type", kind)
        reads = SCHEDULER_KEYS[str(kind)]
        for key in [k for k in self.leaves if k.startswith("scheduler.params.")]:
            name = key.rsplit(".", 1)[1]
            if DS_KEYS[key].target and name not in reads:
                self._error(
                    key,
                    self.leaves[key],
                    f"'{name}' is not a parameter of DeepSpeed's {kind} (DeepSpeed raises a "
                    f"TypeError too); {kind} takes: {', '.join(sorted(reads))}",
                )
        if (
            kind in ("WarmupLR", "WarmupDecayLR")
            and "scheduler.params.warmup_max_lr" not in self.leaves
        ):
            self._set("scheduler.warmup_max_lr", 0.001)
            self._row(
                "scheduler.params.warmup_max_lr",
                ABSENT,
                "mapped",
                "scheduler.warmup_max_lr = 0.001 (DeepSpeed's default; fsdpx's would be the "
                "optimizer lr)",
            )
        if kind == "OneCycle":
            for name in ("cycle_min_lr", "cycle_max_lr"):
                if f"scheduler.params.{name}" not in self.leaves:
                    self._error(f"scheduler.params.{name}", ABSENT, f"OneCycle needs '{name}'")
            if "scheduler.params.cycle_momentum" not in self.leaves:
                rule = DS_KEYS["scheduler.params.cycle_momentum"]
                self._row(
                    "scheduler.params.cycle_momentum",
                    ABSENT,
                    "refused",
                    f"'scheduler.params.cycle_momentum' is absent (true): {rule.note}",
                )

    def _parallel_and_batch(self) -> None:
        pp = self._positive("pipeline.stages", "mesh.pp")
        tp = self._positive("tensor_parallel.autotp_size", "mesh.tp")
        # Sequence-parallel ranks see the same samples: DeepSpeed divides the world by
        # sequence_parallel_size in its batch rule too.
        sp = self._positive("sequence_parallel_size", "mesh.sp")
        mics = self.leaves.get("zero_optimization.mics_shard_size")
        if self.world_size % (pp * tp * sp):
            key = "pipeline.stages" if pp > 1 else "tensor_parallel.autotp_size"
            if sp > 1:
                key = "sequence_parallel_size"
            # _positive already filed this key as "mapped"; the error replaces that row.
            del self.rows[key]
            sp_part = f" x sequence-parallel size ({sp})" if sp > 1 else ""
            self._error(
                key,
                {"pipeline.stages": pp, "sequence_parallel_size": sp}.get(key, tp),
                f"world size {self.world_size} is not divisible by pipeline stages ({pp}) x "
                f"tensor-parallel size ({tp}){sp_part}; launch a multiple of {pp * tp * sp} "
                "ranks or make pipeline.stages x tensor_parallel.autotp_size"
                f"{' x sequence_parallel_size' if sp > 1 else ''} divide the world size",
            )
            return
        dp = self.world_size // (pp * tp * sp)
        self._expert_parallel()
        if (
            isinstance(mics, int)
            and mics > 0
            and "zero_optimization.mics_shard_size" not in self.rows
        ):
            if dp % mics:
                self._error(
                    "zero_optimization.mics_shard_size",
                    mics,
                    f"mics_shard_size {mics} must divide the data-parallel size {dp}",
                )
            else:
                self._set("mesh", {**self.native.get("mesh", {}), "dp_shard": mics})
                self.native["mesh"]["dp_replicate"] = dp // mics
                self._row(
                    "zero_optimization.mics_shard_size",
                    mics,
                    "mapped",
                    f"mesh.dp_shard = {mics}, mesh.dp_replicate = {dp // mics} (HSDP)",
                )
        self._batch(dp, pp, tp)

    def _expert_parallel(self) -> None:
        """expert_parallel.enabled + autoep_size -> mesh.ep (fsdpx/deepspeed/_keys_moe.py)."""
        enabled_key, size_key = "expert_parallel.enabled", "expert_parallel.autoep_size"
        enabled = self.leaves.get(enabled_key)
        size = self.leaves.get(size_key)
        if enabled is None and size is None:
            return
        if enabled is not True:
            for key in (enabled_key, size_key):
                if key in self.leaves:
                    self._row(key, self.leaves[key], "ignored", "feature off", "feature off")
            return
        if size is None:
            self._row(enabled_key, True, "ignored", "autoep_size absent (1): mesh.ep stays 1")
            return
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            self._row(enabled_key, True, "mapped", "see autoep_size")
            self._error(size_key, size, f"'{size_key}' must be an integer >= 1; got {size!r}")
            return
        self._row(enabled_key, True, "mapped", f"mesh.ep = autoep_size ({size})")
        self._map(size_key, "mesh.ep", size)

    def _positive(self, key: str, target: str) -> int:
        value = self.leaves.get(key)
        if value is None:
            return 1
        if value == "auto":
            self._row(
                key,
                value,
                "ignored",
                f"'auto' takes the size from DeepSpeed's model wrapper, which fsdpx cannot "
                f"read: {target} stays 1; set {target} in a native config",
                "auto",
            )
            return 1
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            self._error(key, value, f"'{key}' must be an integer >= 1 or 'auto'; got {value!r}")
            return 1
        self._map(key, target, value)
        return value

    def _batch(self, dp: int, pp: int, tp: int) -> None:
        keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        tb, mb, gas = (self._get(k) for k in keys)
        for key, v in zip(keys, (tb, mb, gas), strict=True):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                self._error(key, v, f"'{key}' must be an integer or 'auto'; got {v!r}")
                return
        given = (tb, mb, gas)
        # DeepSpeed's _set_batch_related_parameters, branch for branch (floor divisions).
        if tb is not None and mb is not None and gas is None:
            gas = tb // mb // dp
        elif tb is not None and gas is not None and mb is None:
            mb = tb // dp // gas
        elif mb is not None and gas is not None and tb is None:
            tb = mb * gas * dp
        elif tb is not None and mb is None and gas is None:
            gas, mb = 1, tb // dp
        elif mb is not None and tb is None and gas is None:
            gas, tb = 1, mb * dp
        elif tb is None and mb is None:
            self._error(
                "train_batch_size",
                ABSENT,
                "Either train_batch_size or train_micro_batch_size_per_gpu needs to be "
                "provided (DeepSpeed's rule)",
            )
            return
        assert tb is not None and mb is not None and gas is not None
        world = f"data-parallel size {dp} = world size {self.world_size}"
        world += f" / (pipeline {pp} x tensor {tp})" if pp * tp > 1 else ""
        if min(tb, mb, gas) <= 0 or tb != mb * gas * dp:
            self._error(
                "train_batch_size",
                given[0] if given[0] is not None else ABSENT,
                f"Check batch related parameters. train_batch_size is not equal to "
                f"micro_batch_per_gpu * gradient_acc_step * world_size {tb} != {mb} * {gas} * "
                f"{dp} ({world}); each must be >= 1. Fix train_batch_size, "
                "train_micro_batch_size_per_gpu or gradient_accumulation_steps, or the world "
                "size (world_size=, else the WORLD_SIZE environment variable)",
            )
            return
        self._set("train_micro_batch_size_per_gpu", mb)
        self._set("gradient_accumulation_steps", gas)
        check = f"{tb} == {mb} * {gas} * {dp} (micro batch x accumulation x {world})"
        for key, value, derived in zip(keys, given, (tb, mb, gas), strict=True):
            how = "derived" if value is None else "checked" if key == keys[0] else "mapped"
            target = "" if key == keys[0] else f"{key} = {derived}; "
            if key in self.leaves or key != keys[0]:
                self._row(key, self.leaves.get(key, DERIVED), "mapped", f"{target}{how}: {check}")

    def _activation_checkpointing(self) -> None:
        interval = self.leaves.get("pipeline.activation_checkpoint_interval")
        on = "activation_checkpointing" in self.sections
        if interval is not None:
            if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
                self._error(
                    "pipeline.activation_checkpoint_interval", interval, "must be an integer >= 0"
                )
                return
            detail = "0: off" if interval == 0 else "activation_checkpointing.mode = 'full'"
            self._row("pipeline.activation_checkpoint_interval", interval, "mapped", detail)
            on = on or interval > 0
        if on:
            self._set("activation_checkpointing", {"mode": "full"})
        if "activation_checkpointing" in self.sections:
            rule = DS_KEYS["activation_checkpointing"]
            self._row("activation_checkpointing", "{...}", "mapped", rule.note)
        if "pipeline" in self.sections:
            self._row("pipeline", "{...}", "mapped", "pipeline.schedule = '1F1B' (DeepSpeed's)")

    def _telemetry(self) -> None:
        for key in [k for k in self.leaves if k.endswith(".enabled")]:
            block = key.split(".")[0]
            if block not in ("tensorboard", "wandb", "csv_monitor", "comet"):
                continue
            on = self.leaves[key]
            if on is True:
                self._set("telemetry", {"enabled": True})
                detail = (
                    f"telemetry.enabled = True ({block} output: `fsdpx-monitor export` over "
                    "the telemetry log)"
                )
            elif on is False:
                detail = "false: off"
            else:
                self._error(key, on, f"'{key}' must be true or false; got {on!r}")
                continue
            self._row(key, on, "mapped", detail)

    # --- result -----------------------------------------------------------------------

    def ordered_rows(self) -> tuple[Row, ...]:
        order = list(self.leaves) + [k for k in self.rows if k not in self.leaves]
        return tuple(self.rows[k] for k in order if k in self.rows)


@dataclass
class _Summary:
    mapped: list[str] = field(default_factory=list)
    ignored: dict[str, list[str]] = field(default_factory=dict)


def summary_line(rows: tuple[Row, ...], name: str, world_size: int) -> str:
    """One line: every mapped key, every ignored key grouped by its short reason."""
    s = _Summary()
    for row in rows:
        if row.status == "mapped" and row.value not in (ABSENT, DERIVED):
            s.mapped.append(row.key + (" (auto: fsdpx default)" if row.tag == "auto" else ""))
        elif row.status == "ignored":
            s.ignored.setdefault(row.tag, []).append(row.key)
    ignored = "; ".join(f"{tag}: {', '.join(keys)}" for tag, keys in s.ignored.items())
    defaults = [r.key for r in rows if r.value == ABSENT and r.status == "mapped"]
    text = (
        f"DeepSpeed config {name} -> fsdpx Config (world size {world_size}): "
        f"mapped {len(s.mapped)}: {', '.join(s.mapped) or '-'}"
    )
    if defaults:
        text += f"; DeepSpeed defaults written out: {', '.join(defaults)}"
    n_ignored = sum(len(v) for v in s.ignored.values())
    text += f"; ignored {n_ignored}" + (f" ({ignored})" if ignored else "")
    return text + f". Full table: fsdpx config explain {name}"


def _run(
    source: str | Path | Mapping[str, Any], world_size: int | None
) -> tuple[_Translator, tuple[Row, ...], Config | None, str | None]:
    data, name = load_deepspeed_config(source)
    tr = _Translator(data, name, world_size_from_env(world_size))
    tr.run()
    rows = tr.ordered_rows()
    bad = [r for r in rows if r.status in ("refused", "unknown", "error")]
    if bad:
        lines = "\n".join(f"  {r.key}: {r.detail}" for r in bad)
        return tr, rows, None, f"{name}: {len(bad)} DeepSpeed key(s) cannot be used:\n{lines}"
    try:
        cfg = Config.from_dict(tr.native)
    except ValueError as e:
        return tr, rows, None, f"{name}: the translated fsdpx config is invalid: {e}"
    return tr, rows, cfg, None


def explain(
    source: str | Path | Mapping[str, Any], *, world_size: int | None = None
) -> tuple[tuple[Row, ...], Config | None, str | None]:
    """Every row of the translation, the Config (None on failure) and the error (or None).

    Unlike translate, refused and unknown keys do not stop it: they are rows too.

    Example::

        rows, cfg, error = explain("ds_config.json", world_size=8)
    """
    _, rows, cfg, error = _run(source, world_size)
    return rows, cfg, error


def translate(
    source: str | Path | Mapping[str, Any], *, world_size: int | None = None
) -> Translation:
    """Translate a DeepSpeed config; see Config.from_deepspeed.

    Raises:
        ValueError listing every refused, unknown or inconsistent key.
    """
    tr, rows, cfg, error = _run(source, world_size)
    if error is not None:
        raise ValueError(error)
    assert cfg is not None
    return Translation(cfg, rows, tr.world_size, summary_line(rows, tr.name, tr.world_size))


def from_deepspeed(
    source: str | Path | Mapping[str, Any], *, world_size: int | None = None
) -> Config:
    """Config.from_deepspeed: translate and log the summary line at INFO on logger "fsdpx",
    once per job: on rank 0 only (the launcher's RANK; every rank translates the same
    file), as DeepSpeed prints its config once."""
    tr = translate(source, world_size=world_size)
    if os.environ.get("RANK", "0") == "0":
        logger.info("%s", tr.summary)
    return tr.config


def world_size_from_env(world_size: int | None) -> int:
    if world_size is None:
        raw = os.environ.get("WORLD_SIZE", "1")
        try:
            world_size = int(raw)
        except ValueError:
            raise ValueError(
                f"WORLD_SIZE environment variable must be an integer; got {raw!r}"
            ) from None
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    return world_size


def _accepts(value: Any, accept: tuple[Any, ...]) -> bool:
    # bool is an int: True must not pass for 1, nor False for 0.
    return any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in accept)


def _unknown_message(path: str) -> str:
    parent, _, leaf = path.rpartition(".")
    siblings = [
        k.rpartition(".")[2] for k in DS_KEYS if k.rpartition(".")[0] == parent and k != path
    ]
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    where = f"{parent}." if parent else ""
    hint = f"did you mean '{where}{close[0]}'?" if close else "see `fsdpx config explain`"
    return f"unknown DeepSpeed config key '{path}'; {hint}"
