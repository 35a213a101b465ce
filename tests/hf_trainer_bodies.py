"""Rank bodies for the fsdpx.hf.Trainer tests: the same script with the stock
transformers Trainer (one process) and fsdpx.hf.Trainer (2 ranks), same global batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.hf_bodies import VOCAB, tiny_llama

GLOBAL_BATCH = 4  # per micro-step, over all ranks
SEQ = 16


class PatternData(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Random tokens where every other token is the previous one + 1 (learnable).

    masked: sample i's labels are -100 on its first i % 11 and its last i % 3 tokens (a
    prompt and right padding), so valid targets are spread unevenly over sequence halves."""

    def __init__(self, n: int = 64, seed: int = 0, masked: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        x[:, 1::2] = (x[:, 0::2] + 1) % VOCAB
        self.x = x
        self.labels = x.clone()
        if masked:
            for i in range(n):
                self.labels[i, : i % 11] = -100
                self.labels[i, SEQ - i % 3 :] = -100

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.labels[i]}


def training_args(out: str, world: int, **kw: Any) -> Any:
    from transformers import TrainingArguments

    base: dict[str, Any] = dict(
        output_dir=out,
        per_device_train_batch_size=GLOBAL_BATCH // world,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=3e-3,
        warmup_steps=1,
        weight_decay=0.01,
        max_grad_norm=0.1,  # small enough that every step clips
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        optim="adamw_torch",
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        per_device_eval_batch_size=8,  # 16 eval samples: 2 batches on 1 rank, 1 per rank on 2
    )
    base.update(kw)
    return TrainingArguments(**base)


PARITY_CASES: list[dict[str, Any]] = [
    {
        "name": "zero2-linear-trainer-optimizer",
        # eval_accumulation_steps: predictions leave the ranks every step (gathered, in order)
        "args": {"lr_scheduler_type": "linear", "eval_accumulation_steps": 1},
        "ds": {
            "zero_optimization": {"stage": 2},
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto",
            "gradient_clipping": "auto",
        },
    },
    {
        "name": "zero3-cosine-config-adamw",
        "args": {"lr_scheduler_type": "cosine", "weight_decay": 0.0},
        "ds": {
            "zero_optimization": {"stage": 3},
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
            },
        },
    },
]


def _losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().clone()
    return out


def _predictions(trainer: Any) -> torch.Tensor:
    return torch.as_tensor(trainer.predict(PatternData(16, seed=1)).predictions)


def stock_reference(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Plain transformers.Trainer, one process, each parity case; and fsdpx.hf.Trainer on
    this one process in bf16 and fp16 (the single-process reference of those modes)."""
    from transformers import Trainer

    results = []
    for case in PARITY_CASES:
        model = tiny_llama().train()
        args = training_args(str(Path(tmp) / case["name"]), 1, **case["args"])
        trainer = Trainer(model=model, args=args, train_dataset=PatternData())
        trainer.train()
        eval_loss = trainer.evaluate(PatternData(16, seed=1))["eval_loss"]
        results.append(
            {
                "losses": _losses(trainer),
                "params": _full_params(model),
                "eval_loss": eval_loss,
                "predictions": _predictions(trainer),
            }
        )
    precision = {d: _precision_run(tmp, world_size, d) for d in ("bf16", "fp16")}
    return {"parity": results, "precision": precision}


def _precision_run(tmp: str, world_size: int, dtype: str) -> dict[str, Any]:
    """The first parity case with bf16=True / fp16=True and the JSON's section "auto": the
    dtype the blocks compute in, the masters' dtype, losses, parameters, loss scale."""
    from fsdpx.hf import Trainer

    case = PARITY_CASES[0]
    model = tiny_llama().train()
    seen: set[str] = set()
    model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda module, inputs, out: seen.add(str(out.dtype))
    )
    ds = {**case["ds"], dtype: {"enabled": "auto"}}
    args = training_args(str(Path(tmp) / dtype), world_size, **{dtype: True}, **case["args"])
    trainer = Trainer(model=model, args=args, train_dataset=PatternData(), fsdpx_config=ds)
    trainer.train()
    result = {
        "losses": _losses(trainer),
        "params": _full_params(model),
        "compute": sorted(seen),
        "masters": sorted({str(p.dtype) for p in model.parameters()}),
        "loss_scale": float(trainer.engine.loss_scaler.scale),
        "skipped": trainer.engine.skipped_steps,
    }
    trainer.engine.close()
    return result


def fsdpx_runs(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """fsdpx.hf.Trainer on the ranks: each parity case, then an uninterrupted run that
    saves checkpoints every 2 steps with save_total_limit=2."""
    from fsdpx.hf import Trainer

    parity = []
    for case in PARITY_CASES:
        model = tiny_llama().train()
        args = training_args(str(Path(tmp) / case["name"]), world_size, **case["args"])
        trainer = Trainer(
            model=model, args=args, train_dataset=PatternData(), fsdpx_config=case["ds"]
        )
        trainer.train()
        grad_norms = [h.get("grad_norm") for h in trainer.state.log_history if "loss" in h]
        eval_loss = trainer.evaluate(PatternData(16, seed=1))["eval_loss"]
        parity.append(
            {
                "losses": _losses(trainer),
                "params": _full_params(model),
                "grad_norms": grad_norms,
                "eval_loss": eval_loss,
                "predictions": _predictions(trainer),
            }
        )
        trainer.engine.close()
    full = _resume_run(Path(tmp) / "resume", world_size, resume=False)
    precision = {d: _precision_run(tmp, world_size, d) for d in ("bf16", "fp16")}
    return {
        "parity": parity,
        "uninterrupted": full,
        "checkpointed": _checkpointed_run(tmp),
        "precision": precision,
        "best": _best_model_run(tmp, world_size),
    }


def _best_model_run(tmp: str, world_size: int) -> dict[str, Any]:
    """load_best_model_at_end with the *highest* eval loss as best: step 2's checkpoint
    (evaluated every 2 steps over 4), so the weights after train() are step 2's, not the
    last ones."""
    from transformers import TrainerCallback

    from fsdpx.hf import Trainer

    saved: dict[int, dict[str, torch.Tensor]] = {}

    class AtSave(TrainerCallback):  # type: ignore[misc]
        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            saved[state.global_step] = _full_params(kw["model"])

    model = tiny_llama().train()
    args = training_args(
        str(Path(tmp) / "best"),
        world_size,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=True,
    )
    ds = {"zero_optimization": {"stage": 3}, "gradient_clipping": "auto"}
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=PatternData(),
        eval_dataset=PatternData(16, seed=1),
        fsdpx_config=ds,
        callbacks=[AtSave()],
    )
    trainer.train()
    best = trainer.state.best_model_checkpoint
    trainer.engine.close()
    return {"best": Path(best).name, "saved": saved, "params": _full_params(model)}


def _checkpointed_run(tmp: str) -> dict[str, Any]:
    """The first parity case with activation_checkpointing=True: fsdpx's checkpointing of
    the blocks, transformers' switched off; the same numbers."""
    from fsdpx.hf import Trainer

    case = PARITY_CASES[0]
    model = tiny_llama().train()
    args = training_args(str(Path(tmp) / "ac"), 2, activation_checkpointing=True, **case["args"])
    trainer = Trainer(model=model, args=args, train_dataset=PatternData(), fsdpx_config=case["ds"])
    trainer.train()
    from torch.distributed._composable.contract import _get_registry

    # fsdpx applies torch's composable checkpoint (hooks, no wrapper module) to the blocks.
    wrapped = any("checkpoint" in (_get_registry(m) or {}) for m in model.modules())
    return {
        "losses": _losses(trainer),
        "params": _full_params(model),
        "fsdpx_ac": wrapped,
        "hf_ac": model.is_activation_checkpointing,
    }


def _resume_run(out: Path, world_size: int, *, resume: bool) -> dict[str, Any]:
    from fsdpx.hf import Trainer

    args = training_args(
        str(out), world_size, max_steps=6, save_strategy="steps", save_steps=2, save_total_limit=2
    )
    ds = {"zero_optimization": {"stage": 3}, "gradient_clipping": "auto"}
    trainer = Trainer(
        model=tiny_llama().train(), args=args, train_dataset=PatternData(), fsdpx_config=ds
    )
    trainer.train(resume_from_checkpoint=True if resume else None)
    trainer.save_model(str(out / ("final-resumed" if resume else "final")))
    return {"log": [h for h in trainer.state.log_history if "loss" in h]}


def fsdpx_resume(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Fresh processes: resume the run of fsdpx_runs from its newest checkpoint-N."""
    return _resume_run(Path(tmp) / "resume", world_size, resume=True)
