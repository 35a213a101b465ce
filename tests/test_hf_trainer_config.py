"""fsdpx_config= for fsdpx.hf.Trainer: DeepSpeed JSON vs native, "auto" values from the
TrainingArguments, and the errors for conflicting values (in-process, no Trainer: the
arguments are a stand-in with the fields the fill reads)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fsdpx.config import Config, PrecisionConfig
from fsdpx.hf.trainer_config import check_native, default_config, fill_deepspeed, resolve_source


def _args(**kw: Any) -> SimpleNamespace:
    base: dict[str, Any] = dict(
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
        learning_rate=5e-5,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.01,
        fp16=False,
        fp16_full_eval=False,
        bf16=False,
        bf16_full_eval=False,
    )
    base.update(kw)
    ns = SimpleNamespace(**base)
    ns.get_warmup_steps = lambda n: 10  # noqa: ARG005 - TrainingArguments' method
    return ns


HF_ZERO3 = {
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


def test_the_transformers_docs_zero3_file_fills_from_the_arguments(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(HF_ZERO3))
    source = resolve_source(path)
    assert source.deepspeed is not None and source.has_optimizer and source.has_scheduler
    data = fill_deepspeed(source.deepspeed, _args(bf16=True), 2, 100, source.name)
    cfg = Config.from_deepspeed(data, world_size=2)
    assert cfg.train_micro_batch_size_per_gpu == 8 and cfg.gradient_accumulation_steps == 2
    assert cfg.gradient_clipping == 1.0 and cfg.zero.stage == 3
    assert cfg.optimizer.lr == 5e-5 and cfg.optimizer.weight_decay == 0.01
    assert cfg.scheduler.warmup_num_steps == 10 and cfg.scheduler.total_num_steps == 100
    assert cfg.precision.param_dtype == "bf16"


def test_conflicting_values_name_both_sides() -> None:
    data = dict(HF_ZERO3, train_micro_batch_size_per_gpu=4, gradient_clipping=0.5)
    with pytest.raises(
        ValueError,
        match=r"(?s)mismatch TrainingArguments values:\n"
        r"- ds train_micro_batch_size_per_gpu=4 vs hf per_device_train_batch_size=8\n"
        r"- ds gradient_clipping=0.5 vs hf max_grad_norm=1.0\n.*set these DeepSpeed config "
        r"values to 'auto'",
    ):
        fill_deepspeed(data, _args(), 2, 100, "<dict>")


def test_bf16_argument_with_a_config_that_has_no_bf16_is_a_mismatch() -> None:
    with pytest.raises(
        ValueError, match=r"- ds bf16 absent \(fp32\) vs hf bf16\|bf16_full_eval=True"
    ):
        fill_deepspeed({"zero_optimization": {"stage": 2}}, _args(bf16=True), 1, 10, "<dict>")


def test_refused_deepspeed_keys_give_from_deepspeeds_error() -> None:
    data = fill_deepspeed(
        {"zero_optimization": {"stage": 2}, "optimizer": {"type": "Lion", "params": {}}},
        _args(),
        1,
        10,
        "<dict>",
    )
    with pytest.raises(ValueError, match=r"optimizer\.type"):
        Config.from_deepspeed(data, world_size=1)


def test_native_or_deepspeed_or_neither() -> None:
    assert resolve_source({"zero": {"stage": 2}}).native is not None
    assert resolve_source({"zero_optimization": {"stage": 2}}).deepspeed is not None
    assert resolve_source({"optimizer": {"type": "adamw", "params": {}}}).deepspeed is not None
    default = resolve_source(None)
    assert default.native is None and default.deepspeed is None and not default.has_optimizer
    with pytest.raises(ValueError, match=r"neither.*Config\.from_deepspeed.*Config\.from_file"):
        resolve_source({"zeroo": {}})


def test_a_native_config_must_agree_with_the_arguments() -> None:
    cfg = Config.from_dict({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})
    with pytest.raises(
        ValueError,
        match=r"- fsdpx train_micro_batch_size_per_gpu=4 vs hf per_device_train_batch_size=8\n"
        r"- fsdpx gradient_clipping=0.0 vs hf max_grad_norm=1.0",
    ):
        check_native(cfg, _args(), "<Config>")


def test_without_a_config_bf16_and_fp16_arguments_set_the_precision() -> None:
    assert default_config(_args()).precision == PrecisionConfig()
    assert default_config(_args(bf16=True)).precision == PrecisionConfig("bf16", "fp32")
    fp16 = default_config(_args(fp16=True, max_grad_norm=0.5))
    assert fp16.precision == PrecisionConfig("fp16", "fp32")
    assert (fp16.train_micro_batch_size_per_gpu, fp16.gradient_clipping) == (8, 0.5)


def test_a_native_config_must_compute_in_the_arguments_dtype() -> None:
    cfg = Config.from_dict(
        {
            "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 1.0,
        }
    )
    check_native(cfg, _args(), "<Config>")
    with pytest.raises(
        ValueError,
        match=r"- fsdpx precision \(compute dtype\)=fp32 vs hf bf16/fp16 \(compute dtype\)=bf16",
    ):
        check_native(cfg, _args(bf16=True), "<Config>")
    autocast = Config.from_dict(
        {
            "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 1.0,
            "precision": {"autocast": "bf16"},
        }
    )
    check_native(autocast, _args(bf16=True), "<Config>")  # autocast computes in bf16


def _tiny_model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )


@pytest.mark.parametrize("flag", ["bf16_full_eval", "fp16_full_eval"])
def test_trainer_refuses_full_eval_casts(tmp_path: Path, flag: str) -> None:
    from transformers import TrainingArguments

    from fsdpx.hf import Trainer

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **{flag: True})
    with pytest.raises(ValueError, match=r"bf16_full_eval / fp16_full_eval would cast the sharded"):
        Trainer(model=_tiny_model(), args=args)


def test_best_model_needs_the_checkpoints_fsdpx_state(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    from fsdpx.hf import Trainer

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = Trainer(model=_tiny_model(), args=args)
    trainer.state.best_model_checkpoint = str(tmp_path / "checkpoint-2")  # save_only_model's
    with pytest.raises(
        ValueError,
        match=r"checkpoint-2 has no fsdpx checkpoint \(fsdpx/\); .*save_only_model=True cannot",
    ):
        trainer._load_best_model()


def test_trainer_refuses_pipeline_meshes(tmp_path: Path) -> None:
    """tp, sp and ep run (tests/test_hf_trainer_mesh.py); pp is refused when the Trainer is
    built, before any sharding."""
    from transformers import TrainingArguments

    from fsdpx.hf import Trainer

    model = _tiny_model()
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(
        NotImplementedError,
        match=r"runs data-, tensor-, sequence- and expert-parallel meshes .* got mesh\.pp=2\. "
        r".*use fsdpx\.shard",
    ):
        Trainer(
            model=model,
            args=args,
            fsdpx_config={
                "zero": {"stage": 2},
                "mesh": {"pp": 2},
                "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
                "gradient_clipping": args.max_grad_norm,
            },
        )


def test_sequence_parallel_refuses_what_needs_whole_labels(tmp_path: Path) -> None:
    """mesh.sp splits labels by sequence: a compute_loss_func, label smoothing, or a model
    whose loss takes no num_items_in_batch are refused ([Note: Trainer under sp])."""
    from transformers import TrainingArguments

    from fsdpx.hf import Trainer
    from fsdpx.parallel_dims import ParallelDims

    sp2 = ParallelDims(pp=1, dp_replicate=1, dp_shard=1, tp=1, world_size=2, sp=2)

    def trainer(**kw: Any) -> Any:
        loss_func = kw.pop("compute_loss_func", None)
        args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)
        return Trainer(model=_tiny_model(), args=args, compute_loss_func=loss_func)

    with pytest.raises(ValueError, match=r"compute_loss_func with mesh\.sp=2: .* drop"):
        trainer(compute_loss_func=lambda outputs, labels, num_items_in_batch: 0)._check_sequence(
            sp2
        )
    with pytest.raises(ValueError, match=r"label_smoothing_factor=0\.1 with mesh\.sp=2: .* to 0"):
        trainer(label_smoothing_factor=0.1)._check_sequence(sp2)
    plain = trainer()
    plain._check_sequence(sp2)  # a transformers causal LM takes num_items_in_batch
    plain.model_accepts_loss_kwargs = False
    with pytest.raises(ValueError, match=r"mesh\.sp=2 needs a model whose forward takes num_items"):
        plain._check_sequence(sp2)
    with pytest.raises(ValueError, match=r"needs 'input_ids' or 'inputs_embeds' .* \['labels'\]"):
        plain._sequence_length({"labels": None})


def test_dp_rank_drops_the_tensor_and_sequence_coordinates() -> None:
    from fsdpx.hf.trainer_mesh import dp_rank
    from fsdpx.parallel_dims import ParallelDims

    # world mesh (pp, dp_replicate, dp_shard, sp, tp) = (1, 2, 2, 1, 2): ranks 0-1 are
    # dp rank 0, 2-3 dp rank 1, ...
    dims = ParallelDims(pp=1, dp_replicate=2, dp_shard=2, tp=2, world_size=8)
    assert [dp_rank(dims, r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=4, tp=1, world_size=4, ep=2)
    assert [dp_rank(dims, r) for r in range(4)] == [0, 1, 2, 3]  # ep ranks are dp ranks


def test_deepspeed_batch_rule_divides_the_world_by_tp_and_sp() -> None:
    from fsdpx.hf.trainer_config import deepspeed_dp_world

    assert deepspeed_dp_world({"tensor_parallel": {"autotp_size": 2}}, 8) == 4
    assert deepspeed_dp_world({"sequence_parallel_size": 2, "zero_optimization": {}}, 8) == 4
    assert deepspeed_dp_world({"zero_optimization": {"stage": 3}}, 8) == 8
    # train_batch_size "auto" is micro x accumulation x dp, not x world
    data = fill_deepspeed(
        {"train_batch_size": "auto", "tensor_parallel": {"autotp_size": 2}}, _args(), 4, None, "x"
    )
    assert data["train_batch_size"] == 8 * 2 * 4


def _tensor_parallel_trainer(tmp_path: Path, **kw: Any) -> Any:
    """A one-process Trainer given a 2-rank tp mesh by hand: the mesh plumbing's refusals
    without spawning ranks."""
    from transformers import TrainingArguments

    from fsdpx.hf import Trainer
    from fsdpx.parallel_dims import ParallelDims

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)
    trainer = Trainer(model=_tiny_model(), args=args)
    trainer._install_mesh(ParallelDims(pp=1, dp_replicate=1, dp_shard=1, tp=2, world_size=2))
    return trainer


def test_tensor_parallel_refuses_what_would_count_samples_tp_times(tmp_path: Path) -> None:
    import torch

    with pytest.raises(ValueError, match=r"include_num_input_tokens_seen='all' with mesh\.tp=2"):
        _tensor_parallel_trainer(tmp_path, include_num_input_tokens_seen="all")
    trainer = _tensor_parallel_trainer(tmp_path)
    assert trainer.get_tp_size() == 2
    with pytest.raises(
        ValueError, match=r"eval_use_gather_object=True with tensor or sequence parallelism"
    ):
        trainer.gather_function(torch.zeros(2), use_gather_object=True)
    trainer.accelerator.dataloader_config.dispatch_batches = True
    loader: Any = torch.utils.data.DataLoader(torch.arange(4), batch_size=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dispatch_batches=True: .* leave dispatch_batches off"):
        trainer.accelerator.prepare_data_loader(loader)


@pytest.mark.parametrize("option", ["loss_parallel", "sequence_parallel"])
def test_trainer_refuses_loss_and_sequence_parallel_inside_tp(tmp_path: Path, option: str) -> None:
    from transformers import TrainingArguments

    from fsdpx.hf import Trainer

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(
        NotImplementedError,
        match=rf"tensor_parallel\.{option} under fsdpx\.hf\.Trainer: .* to false",
    ):
        Trainer(
            model=_tiny_model(),
            args=args,
            fsdpx_config={
                "mesh": {"tp": 2},
                "tensor_parallel": {option: True},
                "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
                "gradient_clipping": args.max_grad_norm,
            },
        )
