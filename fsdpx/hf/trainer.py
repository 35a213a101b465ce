"""`fsdpx.hf.Trainer`: `transformers.Trainer` with fsdpx as the engine.

A stock Trainer script ports by changing the import and adding one argument::

    from fsdpx.hf import Trainer           # was: from transformers import Trainer
    trainer = Trainer(model=model, args=args, train_dataset=ds, fsdpx_config="ds_config.json")

[Note: Trainer on fsdpx] transformers has no extension point for a third-party engine, so
this subclass replaces the few places where the Trainer builds or drives one, and keeps
everything else (data loaders, loss and its normalisation over tokens and accumulation,
logging, callbacks, evaluation, `trainer_state.json`, checkpoint rotation):

- `_prepare_for_training` shards the model with `fsdpx.shard` (once, at the first
  `train()`, or at the first evaluation when that comes first) instead of
  `accelerator.prepare`. The optimizer is the config's when it names one, else the one
  `TrainingArguments.optim` names, over the Trainer's weight-decay groups. The scheduler is
  the config's when it has one, else the one the Trainer builds from `lr_scheduler_type`
  (on the engine's optimizer).
- The engine steps: `accelerator.backward` is the engine's backward (the Trainer has
  already divided the loss for accumulation and token counts), with the accumulation
  boundary the Trainer's loop sets; `optimizer.step()` is `engine.step()` (unscale, skip
  on fp16 overflow, clip, optimizer, scheduler), so `self.optimizer` is a view whose
  `step` does that and `self.lr_scheduler` a view whose `step` does nothing (the engine
  stepped it, and did not on a skipped step, as DeepSpeed). The gradient norm the Trainer
  logs is the engine's, filled in at the step.
- Checkpoints: `checkpoint-N/` holds the fsdpx checkpoint in `checkpoint-N/fsdpx/` (model,
  optimizer, scheduler, loss scaler, every rank's RNG, the TrainingArguments as JSON; no
  pickle, DESIGN.md clarification 14), the model's `config.json` /
  `generation_config.json` / tokenizer, and the Trainer's own `trainer_state.json`.
  Resuming loads the fsdpx checkpoint (any world size) and re-applies its RNG state where
  the Trainer restores RNG; `load_best_model_at_end` loads the best one's model part
  (fsdpx/hf/trainer_checkpoint.py, [Note: weights once per checkpoint]).

[Note: Trainer precision] The engine owns the precision, as DeepSpeed's does under the
Trainer (accelerate switches its autocast off for DeepSpeed): a DeepSpeed JSON's bf16 /
fp16 sections pair with `bf16=` / `fp16=` ([Note: auto values]); without fsdpx_config,
`bf16=True` / `fp16=True` give parameters gathered in that dtype over fp32 masters with
fp32 gradient reduction (and fp16's dynamic loss scaling); a native config's compute dtype
must equal the arguments'. The Trainer's own autocast is replaced by the engine's
(`precision.autocast`), so forward runs exactly as `engine(...)` would.
`bf16_full_eval` / `fp16_full_eval` are refused: the Trainer casts the model in place for
them, which would cast the sharded fp32 masters.

`activation_checkpointing=True` (the former `gradient_checkpointing`) is fsdpx's
activation checkpointing of the model's blocks (every `every_n_layers`-th), not
transformers' own.

Meshes: data parallel (ZeRO 0-3, HSDP), tensor parallel (`mesh.tp`: the data loaders
split batches over the dp ranks only, fsdpx/hf/trainer_mesh.py, [Note: Trainer data over
dp]), sequence parallel (`mesh.sp`, Ulysses or ring attention: the sp ranks share samples
as tp ranks do, and each step's batch is split by sequence with the loss kept the global
token mean, fsdpx/hf/trainer_sequence.py, [Note: Trainer under sp]) and expert parallel
(`mesh.ep`: ep ranks are dp ranks). Pipeline parallelism is refused: the Trainer's loop
runs one forward and backward per micro-batch, a pipeline schedule runs them all at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import torch
import transformers
from torch import nn

import fsdpx
from fsdpx.config import ActivationCheckpointConfig, Config
from fsdpx.engine import Engine
from fsdpx.hf.trainer_checkpoint import CheckpointMixin
from fsdpx.hf.trainer_config import (
    check_native,
    deepspeed_dp_world,
    default_config,
    fill_deepspeed,
    resolve_source,
)
from fsdpx.hf.trainer_mesh import MeshMixin
from fsdpx.hf.trainer_sequence import SequenceMixin
from fsdpx.parallel_dims import ParallelDims
from fsdpx.precision import autocast_context

__all__ = ["Trainer"]


class _EngineOptimizer:
    """`trainer.optimizer`: the engine's optimizer, whose `step()` is `engine.step()`."""

    def __init__(self, trainer: Trainer, engine: Engine) -> None:
        self._trainer = trainer
        self._engine = engine
        self.step_was_skipped = False  # read by accelerate's optimizer_step_was_skipped

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("fsdpx.hf.Trainer's optimizer step takes no closure")
        result = self._engine.step()
        if result is None:  # the Trainer steps only at its boundaries; the engine agrees
            raise RuntimeError("engine.step() was not at an accumulation boundary")
        self.step_was_skipped = result.skipped
        slot = self._trainer._grad_norm_slot
        if slot is not None:
            slot.fill_(math.nan if result.grad_norm is None else result.grad_norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine.optimizer, name)


class _EngineSteppedScheduler:
    """`trainer.lr_scheduler`: the engine's scheduler; `step()` is a no-op because
    `engine.step()` already stepped it ([Note: Trainer on fsdpx])."""

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)


class Trainer(CheckpointMixin, MeshMixin, SequenceMixin, transformers.Trainer):  # type: ignore[misc]
    """`transformers.Trainer` on fsdpx. Takes everything `Trainer` takes plus
    `fsdpx_config=`: an `fsdpx.Config`, a dict, or a path to a native config or to a
    DeepSpeed JSON (the file `--deepspeed` takes; "auto" values are filled from the
    TrainingArguments as transformers' DeepSpeed integration does). None: `Config()`
    (ZeRO-3) with the arguments' batch size, accumulation and clipping.

    Example::

        trainer = fsdpx.hf.Trainer(model=model, args=args, train_dataset=ds,
                                   fsdpx_config="ds_config.json")
        trainer.train()
        trainer.save_model("out")      # Hugging Face layout; AutoModel.from_pretrained loads it
    """

    def __init__(self, *args: Any, fsdpx_config: Any = None, **kwargs: Any) -> None:
        source = resolve_source(fsdpx_config)
        super().__init__(*args, **kwargs)
        self._fsdpx_source = source
        self.engine: Engine | None = None
        self._grad_norm_slot: torch.Tensor | None = None
        self._rng_after_load: dict[str, Any] | None = None
        self._fsdpx_dims: ParallelDims | None = None
        if self.args.bf16_full_eval or self.args.fp16_full_eval:
            raise ValueError(
                "fsdpx.hf.Trainer evaluates in the engine's precision; bf16_full_eval / "
                "fp16_full_eval would cast the sharded fp32 master weights in place. Drop them "
                "and set bf16=True / fp16=True (or the config's bf16 / fp16 section)"
            )
        if self.args.lr_scheduler_type == "reduce_lr_on_plateau" and not source.has_scheduler:
            raise ValueError(
                "lr_scheduler_type='reduce_lr_on_plateau' steps on evaluation metrics, which "
                "fsdpx's engine does not see; use another lr_scheduler_type or a scheduler "
                "section in fsdpx_config"
            )
        # Everything about the config that can be wrong is found now, before any sharding.
        cfg = self._fsdpx_config(max_steps=None)
        dims = ParallelDims.from_config(cfg.mesh, self.args.world_size)
        self._install_mesh(dims)
        self._check_sequence(dims)
        self.accelerator.backward = self._engine_backward

    @property
    def _hf_model(self) -> Any:
        if self.model is None:
            raise ValueError("fsdpx.hf.Trainer needs model= (or model_init=)")
        return self.model

    # --- the config ---------------------------------------------------------------------

    def _fsdpx_config(self, max_steps: int | None) -> Config:
        source, world = self._fsdpx_source, self.args.world_size
        if source.native is None and source.deepspeed is None:
            cfg = default_config(self.args)
        elif source.native is None:
            assert source.deepspeed is not None
            dp_world = deepspeed_dp_world(source.deepspeed, world)
            data = fill_deepspeed(source.deepspeed, self.args, dp_world, max_steps, source.name)
            sched = data.get("scheduler", {}).get("params", {})
            if max_steps is None:  # validating before the step count is known
                warmup = sched.get("warmup_num_steps")
                if warmup == "auto":
                    sched["warmup_num_steps"] = warmup = 0
                if sched.get("total_num_steps") == "auto":
                    sched["total_num_steps"] = int(warmup or 0) + 1
            cfg = Config.from_deepspeed(data, world_size=world)
        else:
            cfg = source.native
            check_native(cfg, self.args, source.name)
        if cfg.mesh.pp > 1:
            raise NotImplementedError(
                f"{source.name}: fsdpx.hf.Trainer runs data-, tensor-, sequence- and "
                "expert-parallel meshes (ZeRO 0-3, HSDP, mesh.tp, mesh.sp, mesh.ep); got "
                f"mesh.pp={cfg.mesh.pp}. The Trainer's loop runs one micro-batch at a time "
                "(no pipeline schedule); use fsdpx.shard with engine.train_batch for pipeline "
                "parallelism"
            )
        if cfg.mesh.tp > 1 and cfg.tensor_parallel.sequence_parallel:
            # Tried: a tiny Llama fails in torch's PrepareModuleInput ("module inputs and
            # input_layouts should have same length"): its decoder layer passes the
            # attention's hidden_states by keyword.
            raise NotImplementedError(
                f"{source.name}: tensor_parallel.sequence_parallel under fsdpx.hf.Trainer: "
                "Hugging Face decoder layers pass their attention's input by keyword, which "
                "torch's sequence-parallel input preparation does not take; set "
                "tensor_parallel.sequence_parallel to false (plain tensor parallelism runs)"
            )
        if cfg.mesh.tp > 1 and cfg.tensor_parallel.loss_parallel:
            raise NotImplementedError(
                f"{source.name}: tensor_parallel.loss_parallel under fsdpx.hf.Trainer: its "
                "vocabulary-sharded logits need the loss computed inside torch's "
                "loss_parallel() context, and the Trainer computes the model's own loss on "
                "whole logits (and gathers them for evaluation); set "
                "tensor_parallel.loss_parallel to false"
            )
        return cfg

    # --- sharding ------------------------------------------------------------------------

    def _ensure_engine(self, max_steps: int | None) -> Engine:
        if self.engine is not None:
            return self.engine
        cfg = self._fsdpx_config(max_steps)
        source = self._fsdpx_source
        model = self._hf_model
        kwargs: dict[str, Any] = {}
        if not source.has_optimizer:
            decay = set(self.get_decay_parameter_names(model))
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            kwargs["param_groups"] = [
                {
                    "params": [p for n, p in named if n in decay],
                    "weight_decay": self.args.weight_decay,
                },
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
            ]
            opt_cls, opt_kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
            kwargs["optimizer"] = lambda groups: opt_cls(groups, **opt_kwargs)
        cfg = self._activation_checkpointing(cfg)
        engine = fsdpx.shard(model, cfg, **kwargs)
        if not source.has_scheduler:
            if max_steps is None:
                raise ValueError(
                    "fsdpx.hf.Trainer shards the model at the first train() or evaluation; "
                    "evaluating first needs train_dataset or args.max_steps to size the "
                    "Trainer's learning-rate schedule"
                )
            self.lr_scheduler = None
            engine.lr_scheduler = self.create_scheduler(max_steps, optimizer=engine.optimizer)
        self.lr_scheduler = _EngineSteppedScheduler(engine.lr_scheduler)  # type: ignore[assignment]
        self._created_lr_scheduler = False
        self.optimizer = _EngineOptimizer(self, engine)  # type: ignore[assignment]
        self.engine = engine
        self.model_wrapped = self._hf_model
        return engine

    def _activation_checkpointing(self, cfg: Config) -> Config:
        """`activation_checkpointing=True` (`gradient_checkpointing`) becomes fsdpx's
        activation checkpointing of the blocks, applied before sharding; transformers' own,
        which Trainer.train() switches on, is switched off again (_hf_checkpointing_off)."""
        if not getattr(self.args, "activation_checkpointing", False):
            return cfg
        kwargs = dict(getattr(self.args, "activation_checkpointing_kwargs", None) or {})
        every = int(kwargs.pop("every_n_layers", 1))
        if kwargs.pop("offload", False) or kwargs:
            raise ValueError(
                f"activation_checkpointing_kwargs {self.args.activation_checkpointing_kwargs} "
                "cannot be honoured by fsdpx's activation checkpointing (it takes "
                "every_n_layers only); drop the other keys"
            )
        wanted = ActivationCheckpointConfig(
            mode="full" if every == 1 else "every_n", every_n=every if every > 1 else 2
        )
        if cfg.activation_checkpointing.mode not in ("none", wanted.mode):
            raise ValueError(
                f"{self._fsdpx_source.name}: activation_checkpointing.mode="
                f"{cfg.activation_checkpointing.mode!r} in the config, but the arguments ask "
                f"for {wanted.mode!r} (activation_checkpointing=True, every_n_layers={every}); "
                "set one of them"
            )
        self._hf_checkpointing_off()
        return dataclasses.replace(cfg, activation_checkpointing=wanted)

    def _hf_checkpointing_off(self) -> None:
        if getattr(self.args, "activation_checkpointing", False):
            model = self._hf_model
            off = getattr(model, "activation_checkpointing_disable", None) or getattr(
                model, "gradient_checkpointing_disable", None
            )
            if callable(off):
                off()

    def _eval_max_steps(self) -> int | None:
        if self.args.max_steps > 0:
            return int(self.args.max_steps)
        if self.train_dataset is None:
            return None
        return int(self.set_initial_training_values(self.args, self.get_train_dataloader())[-1])

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None
    ) -> tuple[nn.Module, Any]:
        self._ensure_engine(max_steps)
        self._hf_checkpointing_off()  # every train() switches transformers' on again
        # Accelerate must not wrap the sharded model (evaluation_loop prepares a model
        # the accelerator does not know yet); free_memory() at train start forgets it.
        if self._hf_model not in self.accelerator._models:
            self.accelerator._models.append(self._hf_model)
        self.accelerator._optimizers[:] = [self.optimizer]
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self._hf_model, train_dataloader

    def _wrap_model(
        self, model: nn.Module, training: bool = True, dataloader: Any = None
    ) -> nn.Module:
        if self.engine is None:
            self._ensure_engine(self._eval_max_steps())
            self.accelerator._models.append(self._hf_model)
        return self._hf_model

    # --- the step ------------------------------------------------------------------------

    def _engine_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if kwargs:
            raise ValueError(f"fsdpx.hf.Trainer's backward takes no {sorted(kwargs)}")
        assert self.engine is not None
        # The Trainer's loop decides the boundary (an epoch's last, shorter window too).
        self.engine._boundary_override = bool(self.accelerator.gradient_state.sync_gradients)
        if self.engine.sequence is not None:
            # The loss already carries the sp ranks in the Trainer's loss scale; the
            # engine's sp factor is for plain shares ([Note: Trainer under sp] in
            # fsdpx/hf/trainer_sequence.py).
            loss = loss / self.engine.sequence.size
        # The Trainer already divided the loss for accumulation / token counts.
        self.engine.backward(loss, divide_by_accumulation=False)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        # The engine clips inside engine.step(); the norm is written into this slot there
        # and read by the Trainer when it logs (after the step).
        self._grad_norm_slot = torch.full((), math.nan)
        return self._grad_norm_slot

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        return grad_norm  # None when clipping is off: the engine computes no norm then

    def autocast_smart_context_manager(
        self, cache_enabled: bool | None = True
    ) -> contextlib.AbstractContextManager[Any]:
        # The engine's precision, not the accelerator's autocast ([Note: Trainer precision]).
        if self.engine is None:
            return contextlib.nullcontext()
        return autocast_context(self.engine.config.precision.autocast, self.engine.device)
