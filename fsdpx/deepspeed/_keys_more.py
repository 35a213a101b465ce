"""Rows of the DeepSpeed key table for the DeepSpeed 0.19.8 keys outside fsdpx's core
translation: features fsdpx does not have (refused, with the reason and what to do instead)
and knobs that do not change training results (ignored, with the reason).

fsdpx.deepspeed._keys merges these into DS_KEYS. They are plain data here (no import of
fsdpx.deepspeed._keys, so neither module depends on the other's import order). The key list
they complete is tests/data/deepspeed_0.19.8_keys.json (scripts/extract_deepspeed_keys.py);
tests/test_deepspeed_keys_cover.py checks that every key in it has a row.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Rule(NamedTuple):
    """One row: as fsdpx.deepspeed._keys.KeyRule (action, note, tag, accept)."""

    action: str
    note: str
    tag: str = ""
    accept: tuple[Any, ...] = ()


def _ignored(note: str, tag: str) -> Rule:
    return Rule("ignored", note, tag)


def _refused(note: str, *accept: Any) -> Rule:
    return Rule("refused", note, "", accept)


# The short tags of fsdpx.deepspeed._keys (repeated: this module imports nothing from it).
_FSDP2 = "FSDP2 manages this itself"
_LOGGING = "logging/profiling: fsdpx reports through telemetry"
_INTERNAL = "DeepSpeed-internal implementation switch"
_NA = "not applicable to fsdpx"
_OFFLOAD = "DeepSpeed's offload buffer tuning"

# The 1-bit family's parameters (freeze_step, cuda_aware, ... max_coeff) have their rows in
# _keys.py with OneBitAdam; DeepSpeed 0.19.8 no longer ships those optimizers, but configs
# written for earlier releases still carry the keys.

_REMOVED = "DeepSpeed 0.19.8 removed this feature too (it raises DeepSpeedConfigError)"
_DEEPCOMPILE = "a DeepCompile option, read only with compile.deepcompile true, which fsdpx refuses"
_INFERENCE_TP = (
    "DeepSpeed's inference tensor-parallel settings; for training set "
    "tensor_parallel.autotp_size (-> mesh.tp)"
)


def more_rules() -> dict[str, Rule]:
    """The rows (dotted DeepSpeed key -> Rule)."""
    r: dict[str, Rule] = {
        # --- precision --------------------------------------------------------------
        "bf16.bf16_master_weights_and_grads": Rule(
            "mapped",
            "true (with bf16_optimizer_states true) -> precision.master_dtype = 'bf16'",
            "",
            (),
        ),
        "bf16.bf16_optimizer_states": Rule(
            "mapped", "true (with bf16_master_weights_and_grads true) -> the same", "", ()
        ),
        "bf16.check_grad_overflow": _refused(
            "fsdpx checks gradients for inf/NaN (and skips the step) only under fp16 loss "
            "scaling, not under bf16; set it false to train without the check",
            False,
        ),
        "gradient_allreduce_op": _refused(
            "fsdpx averages gradients over the data-parallel ranks; summing ('sum') is not "
            "implemented: scale the loss by the data-parallel size instead",
            "mean",
        ),
        "managed_gradient_accumulation": _refused(
            "fsdpx always manages gradient accumulation (engine.backward divides the loss "
            "by gradient_accumulation_steps and engine.step steps at the boundary); remove "
            "the key",
            True,
        ),
        "seq_parallel_communication_data_type": _ignored(
            "fsdpx's Ulysses all-to-all sends q/k/v and the attention output in the "
            "model's compute dtype (precision.param_dtype)",
            "compute dtype",
        ),
        "hybrid_engine": _refused(
            "DeepSpeed-Chat's hybrid engine (generation inside RLHF training) is not "
            "implemented; remove the block",
            {},
            {"enabled": False},
        ),
        "weight_quantization": _refused(
            "DeepSpeed's weight quantization is not implemented; remove the block",
            {},
            {"enabled": False},
        ),
        # --- compile (in DeepSpeed 0.19.8 the block configures DeepCompile) ----------
        "compile.deepcompile": _refused(
            "DeepCompile (graph-level ZeRO passes) is not implemented; for torch.compile "
            "set compile: true in an fsdpx config, or call engine.compile()",
            False,
        ),
        # --- logging, checkpoint engines, process ---------------------------------------
        "log_level": _ignored("DeepSpeed's logger level; fsdpx logs on 'fsdpx'", _LOGGING),
        "timers": _ignored(
            "DeepSpeed's throughput timer; samples/s is in the telemetry records", _LOGGING
        ),
        "vocabulary_size": _ignored(
            "read only for DeepSpeed's tensor-core alignment warning", _LOGGING
        ),
        "disable_python_gc": _ignored(
            "when DeepSpeed runs Python's garbage collector; no effect on the results",
            _INTERNAL,
        ),
        "cuda_visible_devices": _ignored(
            "not read by DeepSpeed 0.19.8's config (example configs carry it); the devices "
            "are the launcher's (torchrun, CUDA_VISIBLE_DEVICES)",
            _NA,
        ),
        "datastates_ckpt": _ignored(
            "DataStates asynchronous checkpoint engine; fsdpx writes its own checkpoints "
            "(cfg.checkpoint)",
            _NA,
        ),
        # --- tensor parallel ----------------------------------------------------------
        "tensor_parallel.tp": _refused(_INFERENCE_TP, {}),
        "tensor_parallel.tensor_parallel": _refused(_INFERENCE_TP, {}),
        "tensor_parallel.dtype": _ignored(
            "AutoTP's module-injection dtype; the training dtype comes from the bf16/fp16 blocks",
            _NA,
        ),
        "tensor_parallel.keep_module_on_host": _ignored(
            "where AutoTP keeps a module before sharding it", _INTERNAL
        ),
        "tensor_parallel.tp_overlap_comm": _ignored(
            "overlap of AutoTP's all-reduces with compute; the result is the same", _INTERNAL
        ),
        "tensor_parallel.injection_policy_tuple": _refused(
            "custom AutoTP injection policies are not supported; fsdpx uses its automatic "
            "tensor-parallel plan (fsdpx.tp_plans)",
            None,
        ),
        "tensor_parallel.partition_config": _refused(
            "custom AutoTP partition configs are not supported; fsdpx uses its automatic "
            "tensor-parallel plan (fsdpx.tp_plans)",
            None,
        ),
        "tensor_parallel.preset_model": _refused(
            "AutoTP model presets are not supported; fsdpx uses its automatic "
            "tensor-parallel plan (fsdpx.tp_plans)",
            None,
        ),
        "tensor_parallel.kernel_inject": _refused(
            "DeepSpeed's kernel injection is not supported; remove the key", False
        ),
        "tensor_parallel.replace_with_kernel_inject": _refused(
            "DeepSpeed's kernel injection is not supported; remove the key", False
        ),
        "tensor_parallel.vocab_parallel_lm_head": _refused(
            "a vocabulary-parallel LM head is not in fsdpx's automatic plan; remove the key",
            None,
            False,
        ),
        "tensor_parallel.vocab_parallel_ce_backend": _ignored(
            "read only with vocab_parallel_lm_head, which fsdpx refuses", _NA
        ),
        # --- ZeRO -----------------------------------------------------------------------
        "allgather_size": _ignored(
            "all-gather bucket size of the old boolean zero_optimization form; FSDP2 "
            "communicates one fully_shard unit (block) at a time",
            _FSDP2,
        ),
        "zero_optimization.allgather_sequential": _ignored(
            "order of DeepSpeed's stage-3 all-gathers; FSDP2 all-gathers per block", _FSDP2
        ),
        "zero_optimization.stage3_allgather_sequential": _ignored(
            "order of DeepSpeed's stage-3 all-gathers; FSDP2 all-gathers per block", _FSDP2
        ),
        "zero_optimization.use_all_reduce_for_fetch_params": _ignored(
            "how DeepSpeed fetches stage-3 parameters; FSDP2 all-gathers them", _FSDP2
        ),
        "zero_optimization.stage3_use_all_reduce_for_fetch_params": _ignored(
            "how DeepSpeed fetches stage-3 parameters; FSDP2 all-gathers them", _FSDP2
        ),
        "zero_optimization.compute_grad_norm": _ignored(
            "whether DeepSpeed's stage 1/2 keeps the gradient norm; fsdpx computes it when "
            "gradient_clipping is on",
            _INTERNAL,
        ),
        "zero_optimization.enable_sanity_checks": _ignored(
            "DeepSpeed's stage-3 debug checks", _INTERNAL
        ),
        "zero_optimization.parameter_alignment": _ignored(
            "padding in DeepSpeed's stage 1/2 flat buffers; FSDP2 lays out its own", _FSDP2
        ),
        "zero_optimization.leaf_module": _ignored(
            "DeepSpeed's stage-3 leaf modules (gathered whole); FSDP2 gathers whole blocks "
            "(zero.block_classes)",
            _FSDP2,
        ),
        "zero_optimization.module_granularity_threshold": _ignored(
            "DeepSpeed's hook granularity; fsdpx shards per block (zero.block_classes)",
            _INTERNAL,
        ),
        "zero_optimization.save_muon_momentum_buffer_in_memory": _ignored(
            "read only with the Muon optimizer, which fsdpx does not build", _NA
        ),
        "zero_optimization.offload_optimizer.cpuadam_cores_perc": _ignored(
            "share of cores DeepSpeed's CPU Adam uses; fsdpx's uses torch's thread count",
            _OFFLOAD,
        ),
        "zero_optimization.offload_optimizer.super_offload": _refused(
            "SuperOffload is not implemented; remove the key (plain offload_optimizer)", False
        ),
        "zero_optimization.zenflow": _refused(
            "ZenFlow (offload with deferred, selective updates) is not implemented; it "
            "changes which gradients update when. Remove the block (plain offload_optimizer)",
            None,
        ),
        # --- optimizer parameters --------------------------------------------------------
        "optimizer.params.adamw_mode": _refused(
            "DeepSpeed's engine sets CPU Adam's adamw_mode itself; use optimizer.params.adam_w_mode"
        ),
        "optimizer.params.decoupled_weight_decay": _refused(
            "choose decoupled weight decay with optimizer type AdamW (or Adam with "
            "adam_w_mode true)"
        ),
        "optimizer.params.maximize": _refused(
            "maximize is not in the built-in optimizer config; pass optimizer=lambda p: "
            "fsdpx.optim.AdamW(p, maximize=True, ...) to fsdpx.shard",
            False,
        ),
        "optimizer.params.differentiable": _refused(
            "differentiable optimizer steps are not supported; remove the key", False
        ),
        "optimizer.params.capturable": _ignored(
            "torch Adam's CUDA-graph capture switch; the update is the same", _INTERNAL
        ),
        "optimizer.params.foreach": _ignored(
            "torch Adam's kernel choice; fsdpx picks it", _INTERNAL
        ),
        "optimizer.params.set_grad_none": _ignored(
            "FusedAdam's zero_grad style; engine.zero_grad sets gradients to None", _INTERNAL
        ),
        "optimizer.params.fp32_optimizer_states": _refused(
            "fsdpx keeps optimizer states in fp32 (16-bit states are not implemented); "
            "remove the key",
            True,
        ),
        "optimizer.params.max_grad_norm": _refused(
            "use the top-level gradient_clipping (DeepSpeed refuses max_grad_norm for Adam too)"
        ),
        "optimizer.params.initial_accumulator_value": _refused(
            "Adagrad is not built in; pass optimizer=lambda p: torch.optim.Adagrad(p, ...) "
            "to fsdpx.shard"
        ),
        "optimizer.params.lr_decay": _refused(
            "Adagrad is not built in; pass optimizer=lambda p: torch.optim.Adagrad(p, ...) "
            "to fsdpx.shard"
        ),
    }
    for name in (
        "free_activation",
        "free_activation_threshold",
        "offload_activation",
        "offload_activation_pin_memory",
        "offload_opt_states",
        "offload_parameters",
        "double_buffer",
        "symmetric_memory",
        "sync_before_reduce",
        "sync_after_reduce",
        "sync_before_allgather",
        "sync_after_allgather",
        "keep_int_input_tensors",
        "keep_all_input_tensors",
        "passes",
        "debug_log",
        "autoep_non_moe",
    ):
        r[f"compile.{name}"] = _ignored(_DEEPCOMPILE, _NA)
    for name in ("bf16_master_weights_and_grads", "bf16_optimizer_states", "check_grad_overflow"):
        r[f"bfloat16.{name}"] = r[f"bf16.{name}"]
    for name in ("min_lr", "step_rate", "step_size", "staircase"):
        r[f"scheduler.params.lr_range_test_{name}"] = _refused(
            "LRRangeTest is not built into fsdpx; pass lr_scheduler=callable to fsdpx.shard"
        )
    for key in (
        "eigenvalue",
        "graph_harvesting",
        "nebula",
        "progressive_layer_drop",
        "quantize_training",
    ):
        r[key] = _refused(f"{_REMOVED}; remove the block", {"enabled": False})
    return r
