"""The DeepSpeed config keys fsdpx knows, and what it does with each: one table, read by the
translator (fsdpx.deepspeed._config) and printed by `fsdpx config explain`.

Each key is a dotted path into DeepSpeed's JSON config and has one rule:

- ``section``: a block whose keys are listed separately;
- ``mapped``: translated. ``target`` names the fsdpx field when the value is copied as it
  is (the translator does that generically); without a target the translator derives the
  fsdpx fields in code and ``note`` says how;
- ``ignored``: tunes something DeepSpeed does that FSDP2 (or the user's own loop) handles
  itself; accepted, reported in the summary line with ``note`` as the reason;
- ``refused``: changes training in a way fsdpx does not implement; a ValueError naming
  the key and ``note`` (what to use instead). Values in ``accept`` leave the feature off
  and are accepted (reported as ignored: "feature off").

A key that is in no rule is an unknown-key error with a did-you-mean. The table covers every
key DeepSpeed 0.19.8 (DEEPSPEED_VERSION) accepts: tests/data/deepspeed_0.19.8_keys.json,
extracted from DeepSpeed's config classes by scripts/extract_deepspeed_keys.py. The rows for
features fsdpx does not have are in fsdpx.deepspeed._keys_more. The rules follow
DeepSpeed's config documentation (deepspeed.ai/docs/config-json) and its runtime
(deepspeed/runtime/config.py, zero/config.py, zero/offload_config.py, lr_schedules.py).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fsdpx.config import SCHEDULER_KEYS
from fsdpx.deepspeed._keys_moe import moe_rules
from fsdpx.deepspeed._keys_more import more_rules
from fsdpx.optimizers import OPTIMIZER_PARAM_KEYS, OPTIMIZERS

Action = Literal["section", "mapped", "ignored", "refused"]

DEEPSPEED_VERSION = "0.19.8"
"""The DeepSpeed release whose config keys the table covers (tests/test_deepspeed_keys_cover.py)."""

# Short reasons for the one-line summary; `note` carries the long one for `explain`.
FSDP2_DOES_IT = "FSDP2 manages this itself"
LOGGING = "logging/profiling: fsdpx reports through telemetry"
INTERNAL = "DeepSpeed-internal implementation switch"
MONITOR_OUT = "monitor output: files come from `fsdpx-monitor export`"
OFFLOAD_TUNING = "DeepSpeed's offload buffer tuning"
NOT_APPLICABLE = "not applicable to fsdpx"


@dataclass(frozen=True)
class KeyRule:
    """What fsdpx does with one DeepSpeed key."""

    action: Action
    note: str = ""
    """mapped: how it translates; ignored: why; refused: what to use instead."""
    target: str | None = None
    """mapped only: the fsdpx field the value is copied to (None: derived in code)."""
    tag: str = ""
    """ignored only: the short reason shown in the summary line."""
    accept: tuple[Any, ...] = ()
    """refused only: values that leave the feature off, accepted as no-ops."""


def _section(note: str = "") -> KeyRule:
    return KeyRule("section", note)


def _mapped(note: str, target: str | None = None) -> KeyRule:
    return KeyRule("mapped", note, target=target)


def _ignored(note: str, tag: str) -> KeyRule:
    return KeyRule("ignored", note, tag=tag)


def _refused(note: str, *accept: Any) -> KeyRule:
    return KeyRule("refused", note, accept=accept)


_BUCKETS = "FSDP2 communicates one fully_shard unit (block) at a time; no bucket sizes to set"
_PREFETCH = "FSDP2 keeps the running block gathered and prefetches the next one"
_NOT_QWZ = "not implemented yet (ZeRO++ quantized collectives); set it to false"
_QWZ = (
    "ZeRO++ qwZ: FSDP's all-gathers carry int8 blocks of zero.quantization_block_size "
    "(default 256) with fp32 scales"
)
_QGZ = (
    "ZeRO++ qgZ: the gradient reduce-scatter becomes an int8 all-to-all over the shard group "
    "(one level; for DeepSpeed's within-node-then-across-nodes scheme set "
    "zero.quantized_gradients_hierarchical = true, and zero.quantized_gradients_bits = 4 for "
    "int4, in a native config)"
)
_MONITOR_KEYS = {
    "tensorboard": ("output_path", "job_name"),
    "csv_monitor": ("output_path", "job_name"),
    "wandb": ("team", "group", "project"),
    "comet": (
        "samples_log_interval",
        "project",
        "workspace",
        "api_key",
        "experiment_name",
        "experiment_key",
        "online",
        "mode",
    ),
}


def _offload_rules(prefix: str, target: str, extra: dict[str, KeyRule]) -> dict[str, KeyRule]:
    rules = {
        prefix: _section(f"-> {target} (OffloadConfig)"),
        f"{prefix}.device": _mapped("none | cpu | nvme", f"{target}.device"),
        f"{prefix}.nvme_path": _mapped("directory for device nvme", f"{target}.nvme_path"),
        f"{prefix}.pin_memory": _mapped("pin host buffers", f"{target}.pin_memory"),
        f"{prefix}.buffer_count": _ignored(
            f"fsdpx bounds NVMe staging memory in bytes ({target}.buffer_mb, default 256 "
            "MiB), not in DeepSpeed buffer counts; set buffer_mb in a native config",
            OFFLOAD_TUNING,
        ),
    }
    rules.update({f"{prefix}.{k}": v for k, v in extra.items()})
    return rules


def _table() -> dict[str, KeyRule]:
    t: dict[str, KeyRule] = {
        # --- batch size and optimizer-step shape ----------------------------------------
        "train_batch_size": _mapped(
            "checked: == train_micro_batch_size_per_gpu * gradient_accumulation_steps * "
            "data-parallel size; 'auto' or missing: derived from the others (DeepSpeed's rules)"
        ),
        "train_micro_batch_size_per_gpu": _mapped(
            "-> train_micro_batch_size_per_gpu ('auto' or missing: derived)"
        ),
        "gradient_accumulation_steps": _mapped(
            "-> gradient_accumulation_steps ('auto' or missing: derived)"
        ),
        "gradient_clipping": _mapped("-> gradient_clipping (0: off)", "gradient_clipping"),
        "communication_data_type": _mapped(
            "-> precision.reduce_dtype (fp32 | fp16 | bf16); missing: the compute dtype, as "
            "in DeepSpeed"
        ),
        "prescale_gradients": _ignored(
            "only moves the division by the data-parallel size before the reduction; FSDP2 "
            "splits that division itself and the averaged gradient is the same",
            FSDP2_DOES_IT,
        ),
        "gradient_predivide_factor": _ignored(
            "how the averaging division is split around the reduction; FSDP2 chooses the "
            "split, the averaged gradient is the same",
            FSDP2_DOES_IT,
        ),
        "sparse_gradients": _refused(
            "sparse embedding gradients are not supported on FSDP2; remove the key "
            "(dense gradients)",
            False,
        ),
        "disable_allgather": _ignored("legacy stage-1 switch; FSDP2 always all-gathers", INTERNAL),
        "steps_per_print": _ignored(
            "fsdpx.deepspeed.initialize's engine prints DeepSpeed's progress line (step, "
            "loss, lr, samples/s) on rank 0 every N steps; the native fsdpx.shard engine "
            "prints none (per-step values go to the telemetry records)",
            LOGGING,
        ),
        "wall_clock_breakdown": _ignored(
            "fsdpx.deepspeed.initialize's engine prints forward/backward/step times with "
            "the progress line; the native engine's step times are in the telemetry records",
            LOGGING,
        ),
        "memory_breakdown": _ignored(
            "memory printing; allocator memory is in the telemetry records", LOGGING
        ),
        "dump_state": _ignored("prints the config; use `fsdpx config explain`", LOGGING),
        "flops_profiler": _ignored("DeepSpeed's profiler; use torch.profiler", LOGGING),
        "comms_logger": _ignored("DeepSpeed's collective logger; use torch.profiler", LOGGING),
        "zero_allow_untested_optimizer": _ignored(
            "DeepSpeed's optimizer allow-list; fsdpx shards any torch optimizer", NOT_APPLICABLE
        ),
        "zero_force_ds_cpu_optimizer": _ignored(
            "DeepSpeed's CPU-Adam check; fsdpx's offload chooses its own optimizer kernel",
            NOT_APPLICABLE,
        ),
        "dataloader_drop_last": _ignored(
            "applies to the data loader built from training_data, which "
            "fsdpx.deepspeed.initialize honours; the native fsdpx.shard builds no loader",
            NOT_APPLICABLE,
        ),
        "autotuning": _ignored("settings of DeepSpeed's autotuning launcher", NOT_APPLICABLE),
        "checkpoint": _section("-> checkpoint (node_local); the rest is DeepSpeed's own format"),
        "checkpoint.use_node_local_storage": _mapped(
            "each node writes and reads its ranks' files on its own storage",
            "checkpoint.node_local",
        ),
        **{
            f"checkpoint.{key}": _ignored(
                f"DeepSpeed's {what}; fsdpx checkpoints are its own format (cfg.checkpoint) "
                "and load onto any world size and stage",
                NOT_APPLICABLE,
            )
            for key, what in (
                ("tag_validation", "check that every rank saves the same tag"),
                ("load_universal", "universal checkpoint loading"),
                ("checkpoint_serialization", "torch.save serialization switch"),
                ("parallel_write", "pipeline-stage writers"),
                ("writer", "checkpoint writer engines"),
            )
        },
        "aio": _ignored(
            "tunes DeepSpeed's async I/O library; fsdpx's NVMe I/O is set by the offload config",
            OFFLOAD_TUNING,
        ),
        "amp": _refused(
            'NVIDIA Apex AMP is not supported; use "bf16": {"enabled": true} or "fp16"',
            {"enabled": False},
        ),
        "torch_autocast": _section("-> precision.autocast"),
        "torch_autocast.enabled": _mapped("true -> precision.autocast = 'bf16' (fp32 parameters)"),
        "torch_autocast.dtype": _mapped("bfloat16 only (float16 refused: use the fp16 block)"),
        "torch_autocast.lower_precision_safe_modules": _ignored(
            "torch.autocast decides per op which run in bf16; gradients are reduced in "
            "precision.reduce_dtype",
            NOT_APPLICABLE,
        ),
        "elasticity": _refused(
            "elastic batch sizing is not supported; fix train_batch_size and remove the block",
            {"enabled": False},
        ),
        "data_efficiency": _refused(
            "DeepSpeed's data sampling/routing is not supported; sample data in your loop",
            {"enabled": False},
        ),
        "curriculum_learning": _refused(
            "curriculum learning is not supported; order the data in your loop",
            {"enabled": False},
        ),
        "compression_training": _refused(
            "DeepSpeed's compression training is not supported; remove the block"
        ),
        "sparse_attention": _refused(
            "DeepSpeed's sparse attention kernels are not supported; use your model's "
            "attention (e.g. torch's scaled_dot_product_attention)"
        ),
        "sequence_parallel_size": _mapped(
            "Ulysses sequence parallelism over mesh.sp (fsdpx.sequence); the batch rule "
            "divides the world by it",
            "mesh.sp",
        ),
        "data_types": _refused(
            "FSDP2 sets the gradient accumulation dtype (fp32 sharded gradients at stages "
            "2-3, precision.reduce_dtype at stages 0-1); remove the block",
            {},
        ),
        # --- precision ------------------------------------------------------------------
        "fp16": _section("-> precision (fp16) and fp16 (LossScaleConfig)"),
        "fp16.enabled": _mapped(
            "true: precision.param_dtype = fp16 (reduce_dtype: communication_data_type, else fp16)"
        ),
        "fp16.loss_scale": _mapped("0: dynamic; > 0: a static scale", "fp16.static_scale"),
        "fp16.initial_scale_power": _mapped("", "fp16.initial_scale_power"),
        "fp16.loss_scale_window": _mapped("", "fp16.window"),
        "fp16.hysteresis": _mapped("", "fp16.hysteresis"),
        "fp16.consecutive_hysteresis": _mapped("", "fp16.consecutive_hysteresis"),
        "fp16.min_loss_scale": _mapped("", "fp16.min_scale"),
        "fp16.auto_cast": _ignored(
            "FSDP2 casts floating-point forward inputs to the compute dtype anyway "
            "(cast_forward_inputs)",
            FSDP2_DOES_IT,
        ),
        "fp16.fp16_master_weights_and_grads": _refused(
            "fsdpx keeps fp32 master weights and gradients (the sharded parameters); "
            "remove the key",
            False,
        ),
        "bf16": _section("-> precision (bf16)"),
        "bf16.enabled": _mapped(
            "true: precision.param_dtype = bf16 (reduce_dtype: communication_data_type, else bf16)"
        ),
        "bf16.immediate_grad_update": _ignored(
            "when DeepSpeed folds bf16 gradients into fp32 accumulators; FSDP2 reduces into "
            "the fp32 sharded gradients itself",
            FSDP2_DOES_IT,
        ),
        "bfloat16": _section("old name of the bf16 block"),
        "bfloat16.enabled": _mapped("as bf16.enabled"),
        "bfloat16.immediate_grad_update": _ignored("as bf16.immediate_grad_update", FSDP2_DOES_IT),
        "compile": _section("DeepSpeed 0.19.8: DeepCompile options"),
        # --- ZeRO -----------------------------------------------------------------------
        "zero_optimization": _section("-> zero (true/false: stage 1/0, as in DeepSpeed)"),
        "zero_optimization.stage": _mapped(
            "-> zero.stage; without zero_optimization: 0 (DeepSpeed's default; fsdpx's own "
            "default is 3)"
        ),
        "zero_optimization.zero_hpz_partition_size": _mapped(
            "ZeRO++ hpZ secondary partition", "zero.hpz_partition_size"
        ),
        "zero_optimization.mics_shard_size": _mapped(
            "MiCS: > 0 gives HSDP with mesh.dp_shard = mics_shard_size and mesh.dp_replicate "
            "= data-parallel size / mics_shard_size; -1: off"
        ),
        "zero_optimization.cpu_offload": _mapped(
            "old spelling: true -> zero.offload_optimizer.device = cpu"
        ),
        "zero_optimization.cpu_offload_param": _mapped(
            "old spelling: true -> zero.offload_param.device = cpu"
        ),
        "zero_optimization.cpu_offload_params": _mapped("as cpu_offload_param"),
        "zero_optimization.cpu_offload_use_pin_memory": _mapped(
            "old spelling: -> pin_memory of the cpu offloads"
        ),
        "zero_optimization.zero_quantized_weights": _mapped(_QWZ, "zero.quantized_weights"),
        "zero_optimization.zero_quantized_nontrainable_weights": _refused(
            f"quantized frozen weights: {_NOT_QWZ}", False
        ),
        "zero_optimization.zero_quantized_gradients": _mapped(_QGZ, "zero.quantized_gradients"),
        "zero_optimization.zeropp_loco_param": _refused(
            "ZeRO++ LoCo error feedback is not implemented; remove the key", None
        ),
        "zero_optimization.load_from_fp32_weights": _refused(
            "fsdpx always restores the fp32 master weights from the checkpoint; remove the "
            "key (or set it true)",
            True,
        ),
        "zero_optimization.allgather_partitions": _ignored(
            "FSDP2 always all-gathers parameter shards", FSDP2_DOES_IT
        ),
        "zero_optimization.reduce_scatter": _ignored(
            "FSDP2 always reduce-scatters gradients (and all-reduces across HSDP replicas)",
            FSDP2_DOES_IT,
        ),
        "zero_optimization.overlap_comm": _ignored(
            "FSDP2 overlaps communication with compute itself (prefetch, separate streams)",
            FSDP2_DOES_IT,
        ),
        "zero_optimization.contiguous_gradients": _ignored(
            "FSDP2 reduce-scatters each block's gradients from one flat buffer already",
            FSDP2_DOES_IT,
        ),
        "zero_optimization.allgather_bucket_size": _ignored(_BUCKETS, FSDP2_DOES_IT),
        "zero_optimization.reduce_bucket_size": _ignored(_BUCKETS, FSDP2_DOES_IT),
        "zero_optimization.use_multi_rank_bucket_allreduce": _ignored(_BUCKETS, FSDP2_DOES_IT),
        "zero_optimization.round_robin_gradients": _ignored(
            "order of DeepSpeed's offloaded-gradient copies", INTERNAL
        ),
        "zero_optimization.sub_group_size": _ignored(
            "granularity of DeepSpeed's offloaded optimizer step", OFFLOAD_TUNING
        ),
        "zero_optimization.elastic_checkpoint": _ignored(
            "fsdpx checkpoints load onto any world size and stage", NOT_APPLICABLE
        ),
        "zero_optimization.ignore_unused_parameters": _ignored(
            "FSDP2 handles parameters that get no gradient", FSDP2_DOES_IT
        ),
        "zero_optimization.legacy_stage1": _ignored("DeepSpeed's old stage-1 code", INTERNAL),
        "zero_optimization.mics_hierarchical_params_gather": _ignored(
            "FSDP2 all-gathers inside the shard group only", FSDP2_DOES_IT
        ),
        "zero_optimization.memory_efficient_linear": _ignored(
            "DeepSpeed's stage-3 linear wrapper; FSDP2 needs none", INTERNAL
        ),
        "zero_optimization.pipeline_loading_checkpoint": _ignored(
            "DeepSpeed's pipeline checkpoint loading path", INTERNAL
        ),
        "zero_optimization.override_module_apply": _ignored(
            "DeepSpeed's stage-3 patch of Module.apply", INTERNAL
        ),
        "zero_optimization.log_trace_cache_warnings": _ignored(
            "DeepSpeed's stage-3 trace-cache logging", LOGGING
        ),
    }
    for name in (
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "stage3_prefetch_bucket_size",
        "max_live_parameters",
        "max_reuse_distance",
        "prefetch_bucket_size",
    ):
        t[f"zero_optimization.{name}"] = _ignored(_PREFETCH, FSDP2_DOES_IT)
    for name in (
        "stage3_param_persistence_threshold",
        "stage3_model_persistence_threshold",
        "param_persistence_threshold",
        "model_persistence_threshold",
    ):
        t[f"zero_optimization.{name}"] = _ignored(
            "FSDP2 shards every parameter of a block, small ones included", FSDP2_DOES_IT
        )
    for name in (
        "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
        "gather_16bit_weights_on_model_save",
    ):
        t[f"zero_optimization.{name}"] = _ignored(
            "engine.save_16bit_model always gathers the full model", NOT_APPLICABLE
        )
    t["zero_optimization.stage3_module_granularity_threshold"] = _ignored(
        "DeepSpeed's hook granularity; fsdpx shards per block (zero.block_classes)", INTERNAL
    )
    t.update(
        _offload_rules(
            "zero_optimization.offload_optimizer",
            "zero.offload_optimizer",
            {
                "ratio": _refused(
                    "partial optimizer offload is not implemented; offload all of it (remove "
                    "ratio) or none",
                    1,
                    1.0,
                ),
                "fast_init": _ignored("DeepSpeed's NVMe swap-file start-up", OFFLOAD_TUNING),
                "pipeline": _ignored("DeepSpeed's NVMe read/write overlap", OFFLOAD_TUNING),
                "pipeline_read": _ignored("DeepSpeed's NVMe read overlap", OFFLOAD_TUNING),
                "pipeline_write": _ignored("DeepSpeed's NVMe write overlap", OFFLOAD_TUNING),
            },
        )
    )
    t.update(
        _offload_rules(
            "zero_optimization.offload_param",
            "zero.offload_param",
            {
                "buffer_size": _ignored(
                    "fsdpx bounds NVMe staging memory in bytes (zero.offload_param.buffer_mb)",
                    OFFLOAD_TUNING,
                ),
                "max_in_cpu": _ignored(
                    "fsdpx bounds host staging memory by zero.offload_param.buffer_mb",
                    OFFLOAD_TUNING,
                ),
            },
        )
    )
    # --- optimizer and scheduler --------------------------------------------------------
    t.update(
        {
            "optimizer": _section(
                "-> optimizer; missing: fsdpx builds its default (adamw) unless fsdpx.shard "
                "gets optimizer="
            ),
            "optimizer.type": _mapped(
                "Adam (adam_w_mode true, DeepSpeed's default) / AdamW -> adamw; Adam with "
                "adam_w_mode false -> adam; SGD -> sgd; OneBitAdam -> onebit_adam (ZeRO "
                "stage 0, as in DeepSpeed); ZeroOneAdam -> zero_one_adam and OneBitLamb -> "
                "onebit_lamb (ZeRO stage 0); Lamb -> lamb (fsdpx.lamb.Lamb, DeepSpeed's FusedLamb "
                "semantics, any ZeRO stage); any other type is refused (pass optimizer=callable to fsdpx.shard)"
            ),
            "optimizer.legacy_fusion": _ignored("DeepSpeed's kernel choice", INTERNAL),
            "optimizer.params": _section(),
            # The keys some optimizer of the registry reads (fsdpx/optimizers.py).
            **{
                f"optimizer.params.{key}": _mapped("", f"optimizer.{key}")
                for key in OPTIMIZER_PARAM_KEYS
            },
            "optimizer.params.adam_w_mode": _mapped("chooses adamw (true) or adam (false)"),
            "optimizer.params.torch_adam": _ignored(
                "DeepSpeed's Adam kernel choice; fsdpx uses torch.optim", INTERNAL
            ),
            "optimizer.params.fused": _ignored("kernel choice; fsdpx picks it", INTERNAL),
            "optimizer.params.amsgrad": _refused(
                "AMSGrad is not in the built-in optimizers; pass optimizer=lambda p: "
                "torch.optim.AdamW(p, amsgrad=True, ...) to fsdpx.shard",
                False,
            ),
            "optimizer.params.bias_correction": _mapped(
                "false: Adam without bias correction (fsdpx.optim.AdamW's fused adam_step)",
                "optimizer.bias_correction",
            ),
            "optimizer.params.dampening": _refused(
                "SGD dampening is not in the built-in optimizer; pass optimizer=lambda p: "
                "torch.optim.SGD(p, dampening=..., ...) to fsdpx.shard",
                0,
                0.0,
            ),
            "optimizer.params.nesterov": _refused(
                "Nesterov SGD is not in the built-in optimizer; pass optimizer=lambda p: "
                "torch.optim.SGD(p, nesterov=True, ...) to fsdpx.shard",
                False,
            ),
            # 1-bit Adam (fsdpx.onebit_adam); DeepSpeed 0.19.8 no longer ships the 1-bit
            # family, but configs written for earlier releases carry these keys.
            "optimizer.params.freeze_step": _mapped(
                "OneBitAdam: full-precision warmup steps", "optimizer.freeze_step"
            ),
            "optimizer.params.cuda_aware": _ignored(
                "1-bit optimizers: DeepSpeed's switch for CUDA-aware MPI; fsdpx's compressed "
                "exchange runs on the data-parallel process group (NCCL on CUDA, gloo on "
                "CPU), which moves device tensors itself",
                NOT_APPLICABLE,
            ),
            "optimizer.params.comm_backend_name": _ignored(
                "1-bit optimizers: DeepSpeed's choice of its NCCL or MPI compressed backend; "
                "fsdpx's exchange uses the data-parallel process group's backend (the same "
                "sign + scale algorithm, counted by fsdpx.comm)",
                NOT_APPLICABLE,
            ),
            "scheduler": _section("-> scheduler (DeepSpeed's schedules, same parameter names)"),
            "scheduler.type": _mapped(
                "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle -> scheduler.type; others "
                "refused (pass lr_scheduler=callable to fsdpx.shard)"
            ),
            "scheduler.params": _section(),
            "scheduler.params.cycle_momentum": _refused(
                "fsdpx's OneCycle cycles only the learning rate, and DeepSpeed's cycles "
                "momentum unless cycle_momentum is false: set it false to accept lr-only "
                "cycling, or pass lr_scheduler=callable to fsdpx.shard",
                False,
            ),
            "scheduler.params.last_batch_iteration": _refused(
                "resume the schedule with engine.load_checkpoint instead", -1
            ),
        }
    )
    names = sorted(set().union(*SCHEDULER_KEYS.values()))
    for name in names:
        t[f"scheduler.params.{name}"] = _mapped("", f"scheduler.{name}")
    for name in ("cycle_min_mom", "cycle_max_mom", "decay_mom_rate"):
        t[f"scheduler.params.{name}"] = _ignored(
            "read only with cycle_momentum true, which fsdpx refuses", NOT_APPLICABLE
        )
    # --- activation checkpointing, pipeline, tensor parallel ----------------------------
    t.update(
        {
            "activation_checkpointing": _section(
                "present: activation_checkpointing.mode = full (fsdpx checkpoints every "
                "block; drop the model's deepspeed.checkpointing.checkpoint calls)"
            ),
            "activation_checkpointing.partition_activations": _refused(
                "splitting saved activations across tensor-parallel ranks is not implemented; "
                "set it false",
                False,
            ),
            "activation_checkpointing.cpu_checkpointing": _refused(
                "keeping checkpointed activations in CPU memory is not implemented; set it false",
                False,
            ),
            "activation_checkpointing.contiguous_memory_optimization": _ignored(
                "DeepSpeed's buffer for checkpointed activations; the torch allocator manages them",
                INTERNAL,
            ),
            "activation_checkpointing.number_checkpoints": _ignored(
                "sizes DeepSpeed's contiguous activation buffer", INTERNAL
            ),
            "activation_checkpointing.synchronize_checkpoint_boundary": _ignored(
                "a device sync for profiling", LOGGING
            ),
            "activation_checkpointing.profile": _ignored("DeepSpeed's checkpoint timers", LOGGING),
            "pipeline": _section(
                "-> mesh.pp and pipeline (schedule 1F1B: DeepSpeed's TrainSchedule)"
            ),
            "pipeline.stages": _mapped(
                "an integer -> mesh.pp; 'auto' (the stage count comes from "
                "PipelineModule(num_stages=...)) leaves mesh.pp at 1: set mesh.pp"
            ),
            "pipeline.partition": _ignored(
                "fsdpx splits the block list evenly, or at pipeline.split_points",
                NOT_APPLICABLE,
            ),
            "pipeline.seed_layers": _refused(
                "per-layer seeding is not supported; fsdpx seeds from cfg.seed", False
            ),
            "pipeline.activation_checkpoint_interval": _mapped(
                ">= 1: activation_checkpointing.mode = full; 0: off"
            ),
            "pipeline.pipe_partitioned": _ignored(
                "DeepSpeed's split of activations sent between stages across TP ranks",
                INTERNAL,
            ),
            "pipeline.grad_partitioned": _ignored(
                "DeepSpeed's split of gradients sent between stages across TP ranks",
                INTERNAL,
            ),
            "tensor_parallel": _section("-> mesh.tp"),
            "tensor_parallel.autotp_size": _mapped("-> mesh.tp (automatic plan)"),
        }
    )
    # --- monitors -> telemetry ----------------------------------------------------------
    for block, keys in _MONITOR_KEYS.items():
        t[block] = _section("-> telemetry")
        t[f"{block}.enabled"] = _mapped("true: telemetry.enabled = true")
        for key in keys:
            t[f"{block}.{key}"] = _ignored(
                f"{block} output is produced from the telemetry log by `fsdpx-monitor export`",
                MONITOR_OUT,
            )
    more = {**more_rules(), **moe_rules()}
    assert not set(more) & set(t), f"rows defined twice: {sorted(set(more) & set(t))}"
    t.update({k: KeyRule(r.action, r.note, tag=r.tag, accept=r.accept) for k, r in more.items()})  # type: ignore[arg-type]
    return t


DS_KEYS: Mapping[str, KeyRule] = types.MappingProxyType(_table())
"""Every DeepSpeed key fsdpx knows -> its rule (see the module docstring)."""

OPTIMIZER_TYPES: Mapping[str, str] = types.MappingProxyType(
    {ds: name for name, spec in OPTIMIZERS.items() for ds in spec.deepspeed_types}
)
"""Lower-cased DeepSpeed optimizer type -> fsdpx optimizer.type ("adam" becomes "adam"
when params.adam_w_mode is false)."""
