"""`DeepSpeedEngine`: DeepSpeed's engine API over the native fsdpx `Engine`.

[Note: two engines, one core]
`fsdpx.deepspeed.initialize` returns this adapter; `fsdpx.shard` returns the native
`Engine`. Only the adapter speaks DeepSpeed: it is an `nn.Module` holding the model as
`self.module` (so `named_parameters()`/`state_dict()` carry DeepSpeed's "module." prefix),
its accessors are methods (`engine.gradient_accumulation_steps()`), attributes it does not
have fall through to the model (`engine.vocab_size`, `engine.gradient_checkpointing_enable()`)
and `engine.config` is the model's `config` when the model has one (model code reads
`model.config`), else the DeepSpeed config dict. Training itself — accumulation, loss
scaling, clipping, the optimizer step, checkpoints — is the native engine's, so both
engines train bit for bit alike. Where DeepSpeed's behaviour has no sound equivalent the
adapter raises, naming the alternative.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checkpoint_tools.format import CheckpointNotFoundError
from fsdpx.deepspeed._data import ROUTE_TRAIN, build_loader
from fsdpx.engine import Engine
from fsdpx.parallel_dims import ParallelDims

log = logging.getLogger("fsdpx.deepspeed")

# Names the model must not answer for the engine: on a sharded model they would act on
# shards (a truncated save, a generate that skips the engine). Each says what to use.
_NO_FALL_THROUGH = {
    "save_pretrained": "engine.save_16bit_model(save_dir) writes the full weights",
    "generate": "call engine.module.generate(...) on every rank",
}
_GLOBAL_SAMPLES_KEY = "fsdpx.deepspeed.global_samples"


class DeepSpeedEngine(nn.Module):
    """The engine `fsdpx.deepspeed.initialize` returns (DeepSpeed's `DeepSpeedEngine`)."""

    def __init__(
        self,
        engine: Engine,
        *,
        ds_config: dict[str, Any],
        training_data: Any = None,
        collate_fn: Any = None,
    ) -> None:
        super().__init__()
        self.module = engine.module
        # Not an nn.Module attribute: the native engine is not a module, and `self.module`
        # is the one model both share.
        object.__setattr__(self, "_engine", engine)
        self.ds_config = ds_config
        self.collate_fn = collate_fn
        self.global_samples = 0
        self._step_applied = False
        self._steps_per_print: int | None = ds_config.get("steps_per_print", 10)
        self._wall_clock_breakdown = bool(ds_config.get("wall_clock_breakdown", False))
        self._timers: dict[str, float] = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self._last_loss: torch.Tensor | None = None
        self._interval_start = time.perf_counter()
        self._interval_samples = 0
        self._in_no_sync = False
        self.training_dataloader = (
            self.deepspeed_io(training_data) if training_data is not None else None
        )

    # --- what DeepSpeed scripts read -------------------------------------------------

    @property
    def native(self) -> Engine:
        """The fsdpx `Engine` underneath (its API: README, "The engine")."""
        return self._engine

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._engine.optimizer

    @property
    def lr_scheduler(self) -> Any:
        return self._engine.lr_scheduler

    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def config(self) -> Any:  # type: ignore[override]
        """The model's `config` when it has one (model code reads `model.config`), else
        the DeepSpeed config dict (also at `engine.ds_config`)."""
        model_config = getattr(self.module, "config", None)
        return model_config if model_config is not None else self.ds_config

    @property
    def global_steps(self) -> int:
        return self._engine.global_steps

    @property
    def micro_steps(self) -> int:
        return self._engine.micro_steps

    @property
    def skipped_steps(self) -> int:
        return self._engine.skipped_steps

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def local_rank(self) -> int:
        index = self._engine.device.index
        return index if index is not None else _env_int("LOCAL_RANK", 0)

    @property
    def dp_world_size(self) -> int:
        return self._engine.parallel_dims.dp

    @property
    def mp_world_size(self) -> int:
        return self._engine.parallel_dims.tp

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        return ParallelDims.dp_mesh(self._engine.mesh).get_group()

    def _dp_rank(self) -> int:
        return ParallelDims.dp_mesh(self._engine.mesh).get_local_rank()

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._engine.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._engine.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        cfg = self._engine.config
        return (
            cfg.train_micro_batch_size_per_gpu
            * cfg.gradient_accumulation_steps
            * self.dp_world_size
        )

    def zero_optimization_stage(self) -> int:
        return self._engine.config.zero.stage

    def zero_optimization(self) -> bool:
        return self._engine.config.zero.stage > 0

    def fp16_enabled(self) -> bool:
        return self._engine.config.precision.param_dtype == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self._engine.config.precision.param_dtype == "bf16"

    def gradient_clipping(self) -> float:
        return self._engine.config.gradient_clipping

    def loss_scale(self) -> float:
        return self._engine.loss_scale

    def get_lr(self) -> list[float]:
        return self._engine.get_lr()

    def get_mom(self) -> list[Any]:
        """Per group: Adam's betas, or SGD/RMSprop's momentum (as DeepSpeed returns them)."""
        return [
            g["betas"] if "betas" in g else g.get("momentum") for g in self.optimizer.param_groups
        ]

    def get_global_grad_norm(self) -> float | None:
        return self._engine.get_global_grad_norm()

    def was_step_applied(self) -> bool:
        """True when the latest step() updated the parameters (False between accumulation
        boundaries and on a skipped fp16 step)."""
        return self._step_applied

    def is_gradient_accumulation_boundary(self) -> bool:
        return self._engine.is_gradient_accumulation_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Own the boundary: the coming backward/step are (not) the optimizer step's last."""
        self._engine._boundary_override = bool(is_boundary)

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing gradient_accumulation_steps (the micro-batch
        stays). Raises ValueError when it is not a multiple of micro-batch x dp size, or
        with gradients pending (mid optimizer step)."""
        per_step = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if train_batch_size % per_step != 0:
            raise ValueError(
                f"train_batch_size {train_batch_size} must be divisible by micro-batch x "
                f"data-parallel size = {per_step}"
            )
        if any(p.grad is not None for p in self.module.parameters()):
            raise ValueError(
                "set_train_batch_size with gradients pending (between the micro-steps of an "
                "optimizer step) would split one step over two accumulation counts; call it "
                "after step()"
            )
        native_cfg = self._engine.config
        self._engine.config = native_cfg.replace(
            gradient_accumulation_steps=train_batch_size // per_step
        )

    # --- training --------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        start = self._tick()
        out = self._engine.forward(*args, **kwargs)
        self._tock("forward", start)
        return out

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Backward of the loss; returns it divided by gradient_accumulation_steps when
        scale_wrt_gas (DeepSpeed's return value), else as given."""
        start = self._tick()
        self._engine.backward(loss, divide_by_accumulation=scale_wrt_gas, retain_graph=retain_graph)
        self._tock("backward", start)
        self._last_loss = loss.detach()
        return loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Count the micro-step; at the accumulation boundary step the optimizer and the
        scheduler (DeepSpeed's step). lr_kwargs (arguments for the scheduler's step) are
        not supported: the scheduler steps once per optimizer step."""
        if lr_kwargs:
            raise ValueError(
                f"step(lr_kwargs={lr_kwargs!r}) is not supported: the scheduler's step() takes "
                "no arguments here; drive the learning rate from the scheduler itself"
            )
        if self._in_no_sync:
            raise RuntimeError("engine.step() inside no_sync(): gradients were not reduced")
        start = self._tick()
        result = self._engine.step()
        self._tock("step", start)
        self._interval_samples += self.train_micro_batch_size_per_gpu() * self.dp_world_size
        self._step_applied = result is not None and not result.skipped
        if result is not None:
            self.global_samples += self.train_batch_size()
            self._report(result.global_step)

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """gradient_accumulation_steps micro-steps and one optimizer step (DeepSpeed's
        pipeline engine method; here for every layout). data_iter None: the loader built
        from training_data. Returns the global batch's mean loss."""
        if data_iter is None:
            if self.training_dataloader is None:
                raise ValueError(
                    "train_batch() without data_iter needs training_data= in initialize"
                )
            if not hasattr(self, "_train_iter"):
                from fsdpx.deepspeed._data import RepeatingLoader

                self._train_iter = RepeatingLoader(self.training_dataloader)
            data_iter = self._train_iter
        loss = self._engine.train_batch(data_iter)
        self._step_applied = True
        self.global_samples += self.train_batch_size()
        self._interval_samples += self.train_batch_size()
        self._last_loss = loss.detach()
        self._report(self.global_steps)
        return loss

    def eval_batch(
        self,
        data_iter: Iterator[Any],
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> torch.Tensor:
        """Forward only over gradient_accumulation_steps batches of data_iter (DeepSpeed's
        pipeline engine method; here for every layout). Returns the mean loss over the
        micro-batches and data-parallel ranks, on every rank. DeepSpeed's variants that
        return logits, skip the loss or change the reduction are refused."""
        gas = self.gradient_accumulation_steps()
        if return_logits or not compute_loss or reduce_output != "avg" or not bcast_loss:
            raise ValueError(
                "eval_batch supports DeepSpeed's default (the averaged loss, broadcast to "
                f"every stage); got return_logits={return_logits}, compute_loss="
                f"{compute_loss}, reduce_output={reduce_output!r}, bcast_loss={bcast_loss}. "
                "For outputs, run engine.module on a single stage (pp = 1)"
            )
        if num_micro_batches not in (None, gas):
            raise ValueError(
                f"eval_batch(num_micro_batches={num_micro_batches}): the schedule runs "
                f"gradient_accumulation_steps = {gas} micro-batches; pass None or {gas}"
            )
        return self._engine.eval_batch(data_iter)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the parameters' gradients (DeepSpeed sets them to None; so does this,
        whatever set_to_none says, since a zeroed sharded gradient holds memory for nothing)."""
        for param in self.module.parameters():
            param.grad = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep their gradients local (no reduction); ZeRO stage 0
        and 1 only, as in DeepSpeed. step() inside raises."""
        stage = self.zero_optimization_stage()
        if stage >= 2:
            raise RuntimeError(
                f"no_sync is incompatible with the gradient partitioning of ZeRO stage {stage} "
                "(as in DeepSpeed); use gradient_accumulation_steps instead"
            )
        if self._in_no_sync:
            raise RuntimeError("no_sync context manager reentry is unsupported")
        self._in_no_sync = True
        self._engine._no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False
            self._engine._no_sync = False

    # --- data ---------------------------------------------------------------------------

    def deepspeed_io(
        self,
        dataset: Any,
        batch_size: int | None = None,
        route: str = ROUTE_TRAIN,
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Any = None,
        num_local_io_workers: int | None = None,
    ) -> torch.utils.data.DataLoader[Any]:
        """This data-parallel rank's DataLoader over `dataset` (DeepSpeed's deepspeed_io)."""
        return build_loader(
            dataset,
            batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
            dp_rank=self._dp_rank(),
            dp_size=self.dp_world_size,
            route=route,
            pin_memory=pin_memory,
            data_sampler=data_sampler,
            collate_fn=collate_fn or self.collate_fn,
            num_workers=num_local_io_workers,
            drop_last=bool(self.ds_config.get("dataloader_drop_last", False)),
        )

    # --- checkpoints -------------------------------------------------------------------

    def save_checkpoint(
        self,
        save_dir: str | Path,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save an fsdpx checkpoint `<save_dir>/<tag>` (DeepSpeed's arguments; the files are
        fsdpx's format, loadable at any world size). Returns True, as DeepSpeed does."""
        if exclude_frozen_parameters:
            raise ValueError(
                "exclude_frozen_parameters=True is not supported: fsdpx checkpoints hold "
                "every parameter (frozen ones load back unchanged)"
            )
        state = dict(client_state or {})
        state[_GLOBAL_SAMPLES_KEY] = self.global_samples
        self._engine.save_checkpoint(save_dir, tag, state, save_latest=save_latest)
        return True

    def load_checkpoint(
        self,
        load_dir: str | Path,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load a checkpoint saved by save_checkpoint. Returns (path, client_state), or
        (None, None) when `load_dir` holds no checkpoint (DeepSpeed's fresh-start case)."""
        if not load_module_strict:
            raise ValueError(
                "load_module_strict=False is not supported: fsdpx loads every tensor of the "
                "model and raises naming any that is missing"
            )
        if custom_load_fn is not None:
            raise ValueError("custom_load_fn is not supported: fsdpx reads its own format")
        try:
            path, client_state = self._engine.load_checkpoint(
                load_dir,
                tag,
                load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=load_lr_scheduler_states,
                load_module_only=load_module_only,
            )
        except CheckpointNotFoundError as exc:
            log.warning("no checkpoint to load (%s); starting fresh", exc)
            return None, None
        client_state = dict(client_state)
        self.global_samples = int(client_state.pop(_GLOBAL_SAMPLES_KEY, self.global_samples))
        return str(path), client_state

    def save_16bit_model(
        self,
        save_dir: str | Path,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Write the full model in the training precision (DeepSpeed's method). A `.bin` /
        `.pt` name is a `torch.save`d state dict written by rank 0 (gathered one tensor at
        a time, as DeepSpeed does); a `.safetensors` name is written as fsdpx's safetensors
        export. Every rank must call it. Returns True."""
        if exclude_frozen_parameters:
            raise ValueError(
                "exclude_frozen_parameters=True is not supported: every tensor is saved"
            )
        from fsdpx.deepspeed._save16 import save_16bit

        save_16bit(self._engine, Path(save_dir), save_filename)
        return True

    def module_state_dict(
        self,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:
        """The model's state dict (sharded tensors are DTensors: each rank holds its shard,
        as DeepSpeed's ZeRO-3 holds partitions). For full tensors use save_16bit_model."""
        if exclude_frozen_parameters:
            raise ValueError("exclude_frozen_parameters=True is not supported")
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def destroy(self) -> None:
        """Release what outlives training (offload files, hooks, an async save in flight)."""
        self._engine.wait_for_checkpoint()
        self._engine.close()

    # --- fall-through and logs ---------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        if name in _NO_FALL_THROUGH:
            raise AttributeError(
                f"'DeepSpeedEngine' does not forward {name!r} to the sharded model: "
                f"{_NO_FALL_THROUGH[name]}"
            )
        module = self._modules.get("module")
        if module is not None and not name.startswith("__"):
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        raise AttributeError(f"'DeepSpeedEngine' object has no attribute {name!r}")

    def _tick(self) -> float:
        if self._wall_clock_breakdown and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _tock(self, phase: str, start: float) -> None:
        if self._wall_clock_breakdown:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._timers[phase] += time.perf_counter() - start

    def _report(self, step: int) -> None:
        """DeepSpeed's progress lines on rank 0 every steps_per_print optimizer steps."""
        every = self._steps_per_print
        if not every or step % every != 0:
            return
        elapsed = time.perf_counter() - self._interval_start
        samples_per_s = self._interval_samples / elapsed if elapsed > 0 else float("nan")
        self._interval_start, self._interval_samples = time.perf_counter(), 0
        if self.global_rank != 0:
            return
        loss = float(self._last_loss) if self._last_loss is not None else float("nan")
        log.info(
            "step=%d, skipped=%d, lr=%s, mom=%s, loss=%.6g, samples/sec=%.2f",
            step,
            self.skipped_steps,
            self.get_lr(),
            self.get_mom(),
            loss,
            samples_per_s,
        )
        if self._wall_clock_breakdown:
            ms = {k: 1000.0 * v for k, v in self._timers.items()}
            log.info(
                "time (ms) | forward: %.2f | backward: %.2f | step: %.2f",
                ms["forward"],
                ms["backward"],
                ms["step"],
            )
            self._timers = dict.fromkeys(self._timers, 0.0)


def _env_int(name: str, default: int) -> int:
    import os

    value = os.environ.get(name)
    return int(value) if value is not None and value.isdigit() else default
