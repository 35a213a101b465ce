"""Rank bodies for fsdpx.hf.Trainer under tensor and expert parallelism: the stock
transformers Trainer on one process against fsdpx.hf.Trainer on 2 ranks, same data, seed
and global batch; then checkpoint-N resume and save_model() in Hugging Face layout."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from tests.hf_trainer_bodies import PatternData, training_args

# name -> (model kind, mesh of the 2-rank run, data-parallel ranks of that mesh)
MESH_CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    "tp2": ("llama", {"tensor_parallel": {"autotp_size": 2}}, 1),
    "ep2": ("mixtral", {"expert_parallel": {"enabled": True, "autoep_size": 2}}, 2),
    # sequence parallel over 2 ranks, ZeRO-3 over sp: both ranks train on halves of the
    # same sequences, whose -100 labels fall unevenly on the halves (PatternData masked);
    # Ulysses from a DeepSpeed JSON, ring attention from a native config (no DeepSpeed key
    # selects it)
    "sp2": ("llama", {"sequence_parallel_size": 2}, 1),
    "sp2ring": ("llama", {"mesh": {"sp": 2}, "context_parallel": {"mode": "ring"}}, 1),
    # average_tokens_across_devices=False: the Trainer's token count is the rank's own
    "sp2local": ("llama", {"sequence_parallel_size": 2}, 1),
    # 4 ranks (slow tier): two tp groups, each its own data-parallel rank
    "tp2dp2": ("llama", {"tensor_parallel": {"autotp_size": 2}}, 2),
}


def _model(kind: str) -> Any:
    if kind == "llama":
        from tests.hf_bodies import tiny_llama

        return tiny_llama().train()
    from tests.moe_hf_bodies import VOCAB, make_model

    assert VOCAB >= 64  # PatternData's tokens are < tests.hf_bodies.VOCAB (128)
    model: Any = make_model(kind).train()
    model.resize_token_embeddings(128)
    return model


def _data(case: str, n: int = 64, seed: int = 0) -> PatternData:
    return PatternData(n, seed=seed, masked=case.startswith("sp"))


def _ds(case: str) -> dict[str, Any]:
    if "mesh" in MESH_CASES[case][1]:
        # A native config names its optimizer (the Trainer's is not used): training_args'
        # AdamW, without weight decay (a native optimizer decays every parameter, the
        # Trainer not biases and norms; _case_args sets it to 0 on both sides).
        return {
            "zero": {"stage": 3},
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.1,
            "optimizer": {"type": "adamw", "lr": 3e-3, "weight_decay": 0.0},
            **MESH_CASES[case][1],
        }
    return {
        "zero_optimization": {"stage": 3},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        **MESH_CASES[case][1],
    }


def _case_args(case: str) -> dict[str, Any]:
    if case == "sp2local":
        return {"average_tokens_across_devices": False}
    return {"weight_decay": 0.0} if "mesh" in MESH_CASES[case][1] else {}


def _args(out: Path, dp: int, **kw: Any) -> Any:
    base: dict[str, Any] = dict(
        max_steps=4,
        lr_scheduler_type="linear",
        eval_accumulation_steps=1,
        save_strategy="steps",
        save_steps=2,
    )
    return training_args(str(out), dp, **{**base, **kw})


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().clone()
    return out


def _record(trainer: Any, model: torch.nn.Module, case: str) -> dict[str, Any]:
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "losses": [h["loss"] for h in logged],
        "grad_norms": [h.get("grad_norm") for h in logged],
        "params": _full_params(model),
        "eval_loss": trainer.evaluate(_data(case, 16, seed=1))["eval_loss"],
        "predictions": torch.as_tensor(trainer.predict(_data(case, 16, seed=1)).predictions),
        "total_batch": trainer.get_total_train_batch_size(trainer.args),
    }


def stock(rank: int, world_size: int, tmp: str, cases: list[str]) -> dict[str, Any]:
    """The stock Trainer on one process for each case's model."""
    from transformers import Trainer

    out = {}
    for case in cases:
        model = _model(MESH_CASES[case][0])
        args = _args(Path(tmp) / f"stock-{case}", 1, save_strategy="no", **_case_args(case))
        trainer = Trainer(model=model, args=args, train_dataset=_data(case))
        trainer.train()
        out[case] = _record(trainer, model, case)
    return out


def meshed(rank: int, world_size: int, tmp: str, cases: list[str]) -> dict[str, Any]:
    """fsdpx.hf.Trainer on the case's mesh; then checkpoint-4 removed and the run resumed
    from checkpoint-2 in a fresh Trainer (same processes), and save_model()."""
    from fsdpx.hf import Trainer

    out: dict[str, Any] = {}
    for case in cases:
        kind, _, dp = MESH_CASES[case]
        folder = Path(tmp) / case
        model = _model(kind)
        trainer = Trainer(
            model=model,
            args=_args(folder, dp, **_case_args(case)),
            train_dataset=_data(case),
            fsdpx_config=_ds(case),
        )
        trainer.train()
        result = _record(trainer, model, case)
        result["mesh"] = {
            "tp": trainer.engine.parallel_dims.tp,
            "sp": trainer.engine.parallel_dims.sp,
            "ep": trainer.engine.parallel_dims.ep,
            "dp": trainer.engine.parallel_dims.dp,
        }
        trainer.engine.close()
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(folder / "checkpoint-4")  # as if the job died after step 2's save
        torch.distributed.barrier()
        model = _model(kind)
        resumed = Trainer(
            model=model,
            args=_args(folder, dp, **_case_args(case)),
            train_dataset=_data(case),
            fsdpx_config=_ds(case),
        )
        resumed.train(resume_from_checkpoint=True)
        logged = [h for h in resumed.state.log_history if "loss" in h]
        result["resumed_losses"] = [h["loss"] for h in logged]
        result["resumed_params"] = _full_params(model)
        resumed.save_model(str(folder / "final"))
        resumed.engine.close()
        out[case] = result
    return out
