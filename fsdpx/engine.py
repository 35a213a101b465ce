"""The training engine: a thin facade with DeepSpeed's method names over parts that each
live in their own module (zero, precision, clip, schedulers, distributed).

A DeepSpeed loop ports unchanged::

    for x, y in loader:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()          # steps the optimizer only at the accumulation boundary

Built by `fsdpx.shard`; not meant to be constructed directly.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from fsdpx.config import Config
from fsdpx.distributed import guarded
from fsdpx.optimizer_step import OptimizerStep, PlainStep
from fsdpx.parallel_dims import Axis, ParallelDims
from fsdpx.precision import LossScaler, autocast_context, grads_have_overflow
from fsdpx.telemetry.checkpoint_events import report_loaded, saved_reporter
from fsdpx.telemetry.phases import BACKWARD, FORWARD, OPTIMIZER, next_batch, phase_clock
from fsdpx.tensor_parallel import loss_context, plain_loss
from fsdpx.zero import prepare_micro_step

if TYPE_CHECKING:
    from fsdpx.checkpoint.saving import Checkpointer

    # torch.distributed.pipelining pulls in torch._dynamo and sympy (~30 MiB, seconds):
    # imported only by runs that pipeline (fsdpx/parallelize.py).
    from fsdpx.pipeline_parallel import PipelineRunner
    from fsdpx.sequence.plan import SequencePlan
    from fsdpx.telemetry.publisher import Publisher


@dataclass(frozen=True)
class StepResult:
    """What happened at one accumulation boundary."""

    global_step: int
    """engine.global_steps after this step."""
    skipped: bool
    """True when an fp16 overflow skipped the optimizer step (parameters untouched)."""
    grad_norm: float | None
    """Total gradient norm before clipping (None when clipping is off or the step skipped)."""
    loss_scale: float
    """The loss scale in force for the step's backward passes."""


class Engine:
    """Runtime state of one sharded model. See the module docstring for the loop."""

    def __init__(
        self,
        *,
        module: FSDPModule,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        cfg: Config,
        dims: ParallelDims,
        mesh: DeviceMesh,
        loss_scaler: LossScaler,
        device: torch.device,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        pipeline: PipelineRunner | None = None,
        telemetry: Publisher | None = None,
        optimizer_step: OptimizerStep | None = None,
        sequence: SequencePlan | None = None,
    ) -> None:
        # One object, two static types: FSDPModule is a mixin that type checkers do not
        # see as an nn.Module.
        self.module: nn.Module = cast(nn.Module, module)
        self._fsdp_root = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.config = cfg
        self.parallel_dims = dims
        self.mesh = mesh
        self.device = device
        self.loss_scaler = loss_scaler
        self.loss_fn = loss_fn
        # Under pipeline parallelism train_batch runs the schedule; gradient norms are
        # summed over the stages (the pp group).
        self._pipeline = pipeline
        # Live telemetry (fsdpx/telemetry): None when telemetry.enabled is off. The phase
        # clock measures only while a publisher enabled it ([Note: phase spans]).
        self.telemetry = telemetry
        self._clock = phase_clock()
        self._pp_group = mesh[Axis.PP.value].get_group() if dims.pp > 1 else None
        self._loss_parallel = dims.tp > 1 and cfg.tensor_parallel.loss_parallel
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._checkpointer_made: Checkpointer | None = None  # see _checkpointer
        self._last_grad_norm: float | None = None
        self._params = [p for p in self.module.parameters() if p.requires_grad]
        # How the optimizer steps ([Note: step strategies] in fsdpx/optimizer_step.py):
        # fsdpx.shard hands in offload's; any other optimizer unscales, clips and steps.
        # Offload refuses pp > 1 (fsdpx/offload/plan.py), so tied copies meet PlainStep only.
        replicas = pipeline.tied.replicas if pipeline is not None and pipeline.tied else []
        self._optimizer_step: OptimizerStep = optimizer_step or PlainStep(
            optimizer, self._params, self._pp_group, norm_once=replicas
        )
        # Set by fsdpx.deepspeed's engine (set_gradient_accumulation_boundary, no_sync):
        # a caller-owned boundary, and gradients kept local while `_no_sync` holds.
        self._boundary_override: bool | None = None
        self._no_sync = False
        self._sync_changed = False
        # mesh.sp > 1: batches are split by sequence, attention exchanged, and the loss is
        # each rank's share ([Note: sp gradient scale] in fsdpx/sequence/plan.py).
        self._sequence = sequence

    # --- forward / backward / step ----------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    @guarded
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # A raise closes the span untimed (fsdpx/telemetry/phases.py [Note: spans closed
        # on a raise]), as in backward, step and train_batch's loss.
        autocast = autocast_context(self.config.precision.autocast, self.device)
        with self._clock.span(FORWARD), autocast, self._sequence_context():
            return self.module(*args, **kwargs)

    def _sequence_context(self) -> contextlib.AbstractContextManager[Any]:
        return self._sequence.context() if self._sequence else contextlib.nullcontext()

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the coming backward/step is the last micro-step of an optimizer step."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    @guarded
    def backward(
        self,
        loss: torch.Tensor,
        *,
        divide_by_accumulation: bool = True,
        retain_graph: bool = False,
    ) -> torch.Tensor:
        """Backward of loss / gradient_accumulation_steps (times the fp16 loss scale).

        divide_by_accumulation=False skips the division (the loss is already a share of the
        step's); retain_graph as in `Tensor.backward`.

        Returns `loss` as given (no loss scale, no division); DeepSpeed instead returns
        `loss.float() / gradient_accumulation_steps` when accumulating.
        """
        if self._pipeline is not None:
            raise NotImplementedError(
                "engine.backward is not available under pipeline parallelism (mesh.pp > 1): "
                "the schedule interleaves forward and backward; use engine.train_batch"
            )
        boundary = self.is_gradient_accumulation_boundary() and not self._no_sync
        if self.config.gradient_accumulation_steps > 1 or self._no_sync or self._sync_changed:
            # With one micro-step every backward is a boundary and FSDP's defaults (sync,
            # reshard) already hold; setting them walks every module on each step. After a
            # no_sync backward they are set back once.
            prepare_micro_step(self._fsdp_root, self.config.zero, is_boundary=boundary)
            self._sync_changed = not boundary
        self._optimizer_step.prepare_backward(boundary)
        factor = self.loss_scaler.scale
        if divide_by_accumulation:
            factor /= self.config.gradient_accumulation_steps
        if self._sequence is not None:
            factor *= self._sequence.size  # [Note: sp gradient scale]
        with self._clock.span(BACKWARD), loss_context(self._loss_parallel):
            (loss * factor if factor != 1.0 else loss).backward(retain_graph=retain_graph)
        if self.telemetry is not None:
            self.telemetry.observe_loss(loss)
        return loss

    @guarded
    def step(self) -> StepResult | None:
        """Count a micro-step; at the boundary unscale, skip on overflow, clip, step the
        optimizer and scheduler, and zero the gradients. Returns None between boundaries."""
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            return None
        self.micro_steps += 1
        scale = self.loss_scaler.scale
        with self._clock.span(OPTIMIZER):
            skipped = self._optimizer_boundary(scale)
        self.global_steps += 1
        result = StepResult(self.global_steps, skipped, self._last_grad_norm, scale)
        if self.telemetry is not None:
            self.telemetry.on_step(self, result)  # queues a record; never blocks
        return result

    def _optimizer_boundary(self, scale: float) -> bool:
        """Unscale, skip on overflow, clip, step the optimizer and scheduler, zero the
        gradients; returns whether the step was skipped."""
        skipped = False
        inv_scale = 1.0
        if self.loss_scaler.checks_overflow:
            # The overflow check is a world-wide all-reduce: every rank must skip together.
            overflow = grads_have_overflow(self._params)
            skipped = self.loss_scaler.update(overflow)
            inv_scale = 1.0 / scale
        self._last_grad_norm = None
        if not skipped:
            self._last_grad_norm = self._optimizer_step.step(
                inv_scale, self.config.gradient_clipping
            )
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return skipped

    @guarded
    def train_batch(self, data_iter: Iterator[Any]) -> torch.Tensor:
        """Run gradient_accumulation_steps micro-steps from data_iter and one optimizer step.

        Each batch is `(inputs, targets)`: the loss is `loss_fn(module(inputs), targets)`
        when shard() got a loss_fn, else `module(inputs, targets)` (models that compute
        their own loss). A dict batch is passed as keyword arguments. Returns the mean
        loss over the micro-steps and the data-parallel ranks (the global batch loss).
        Under pipeline parallelism the micro-batches run through the schedule (the last
        stage calls loss_fn) and every rank gets the loss. Under mesh.sp > 1 each batch
        holds whole sequences: fsdpx.sequence.shard_batch splits it, the model gets
        `position_ids=`, loss_fn is called with `num_items_in_batch=`, and the loss
        returned is the whole sequences' (fsdpx/sequence/plan.py).
        """
        if self._pipeline is not None:
            # Forward and backward interleave inside the schedule: only data wait and
            # the optimizer step are timed apart.
            batches = [
                next_batch(data_iter) for _ in range(self.config.gradient_accumulation_steps)
            ]
            loss = self._pipeline.step(
                batches, self.loss_scaler.scale, self.device, sequence=self._sequence
            )
            if self.telemetry is not None:
                self.telemetry.observe_loss(loss)
            self.micro_steps += self.config.gradient_accumulation_steps - 1
            self.step()  # the boundary: overflow check, clipping, optimizer
            return self.all_reduce_mean(self._whole_loss(loss))
        total = torch.zeros((), device=self.device)
        for _ in range(self.config.gradient_accumulation_steps):
            with loss_context(self._loss_parallel):
                loss = self._timed_loss(next_batch(data_iter))
            self.backward(loss)
            self.step()
            total += self._whole_loss(plain_loss(loss).detach().float())
        return self.all_reduce_mean(total / self.config.gradient_accumulation_steps)

    @guarded
    def eval_batch(self, data_iter: Iterator[Any]) -> torch.Tensor:
        """Forward only, in eval mode and without gradients: gradient_accumulation_steps
        batches from data_iter, as train_batch reads them (under pipeline parallelism
        through the schedule). Returns the mean loss over the micro-batches and the
        data-parallel ranks; the training mode is restored afterwards.
        """
        gas = self.config.gradient_accumulation_steps
        modules = [self.module]
        if self._pipeline is not None:
            modules += [s.submod for s in self._pipeline.stages]
        was_training = [m.training for m in modules]
        for m in modules:
            m.train(False)
        try:
            if self._pipeline is not None:
                batches = [next(data_iter) for _ in range(gas)]
                loss = self._pipeline.evaluate(batches, self.device, sequence=self._sequence)
                return self.all_reduce_mean(self._whole_loss(loss))
            total = torch.zeros((), device=self.device)
            with torch.no_grad():
                for _ in range(gas):
                    with loss_context(self._loss_parallel):
                        total += self._whole_loss(plain_loss(self._loss_of(next(data_iter))))
            return self.all_reduce_mean(total / gas)
        finally:
            for m, mode in zip(modules, was_training, strict=True):
                m.train(mode)

    def _timed_loss(self, batch: Any) -> torch.Tensor:
        with self._clock.span(FORWARD):
            return self._loss_of(batch)

    def _whole_loss(self, loss: torch.Tensor) -> torch.Tensor:
        # Under sp each rank holds a share of the sequence's loss: report their sum.
        return self._sequence.sum_shares(loss) if self._sequence else loss.float()

    def _loss_of(self, batch: Any) -> torch.Tensor:
        with autocast_context(self.config.precision.autocast, self.device):
            return self._loss_of_batch(batch)

    def _loss_of_batch(self, batch: Any) -> torch.Tensor:
        if self._sequence is not None:
            return self._sequence.loss(self.module, self.loss_fn, batch)
        if isinstance(batch, dict):
            return self.module(**batch)
        inputs, targets = batch
        if self.loss_fn is not None:
            return self.loss_fn(self.module(inputs), targets)
        return self.module(inputs, targets)

    # --- evaluation -------------------------------------------------------------------

    @guarded
    def all_reduce_mean(self, value: torch.Tensor | float) -> torch.Tensor:
        """The mean of `value` over the data-parallel ranks (every rank gets it).

        Example (every rank evaluates its share, the mean loss is reported)::

            with torch.no_grad():
                loss = model_loss(engine(x_val), y_val)
            val_loss = engine.all_reduce_mean(loss).item()
        """
        t = torch.as_tensor(value, dtype=torch.float32, device=self.device).clone()
        group = ParallelDims.dp_mesh(self.mesh).get_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(t, group=group)
            t /= dist.get_world_size(group)
        return t

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    # --- DeepSpeed-style accessors ----------------------------------------------------

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    @property
    def sequence(self) -> SequencePlan | None:
        """The sequence-parallel plan under mesh.sp > 1 (how batches are split and the
        loss scaled: fsdpx/sequence/plan.py), else None."""
        return self._sequence

    def get_global_grad_norm(self) -> float | None:
        """Norm of the last step's gradients (computed when clipping is on)."""
        return self._last_grad_norm

    @property
    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    @guarded
    def save_16bit_model(
        self, save_dir: str, *, dtype: str | None = None, max_shard_bytes: int = 5 * 2**30
    ) -> list[Path]:
        """Write the full model as Hugging Face-style safetensors (DeepSpeed's name).

        dtype None uses the precision config's param_dtype ("fp32" keeps fp32). Tensors are
        gathered one at a time, so no rank holds the whole model. Every rank must call it.
        """
        if self._pipeline is not None:
            raise NotImplementedError(
                "save_16bit_model under pipeline parallelism: each stage holds part of the "
                "model; use save_checkpoint, then `fsdpx-ckpt consolidate` for the full weights"
            )
        from fsdpx.export import save_full_model  # [Note: engine imports on first use]

        return save_full_model(
            self.module,
            save_dir,
            dtype=dtype or self.config.precision.param_dtype,
            max_shard_bytes=max_shard_bytes,
        )

    @guarded
    def save_pretrained(
        self,
        save_directory: str | Path,
        *,
        dtype: str | None = None,
        max_shard_bytes: int = 5 * 2**30,
    ) -> list[Path]:
        """Write a Hugging Face model in Hugging Face layout (config.json,
        generation_config.json, safetensors shards + index) that plain transformers'
        `from_pretrained` loads; one tensor gathered at a time. Every rank calls it. Needs
        `pip install fsdpx[hf]` (`fsdpx.hf.save_pretrained`)."""
        if self._pipeline is not None:
            raise NotImplementedError(
                "save_pretrained under pipeline parallelism: each stage holds part of the "
                "model; use save_checkpoint, then `fsdpx-ckpt consolidate --hf-config DIR`"
            )
        from fsdpx.hf.saving import save_pretrained  # the hf extra, only when asked for

        return save_pretrained(
            self.module, save_directory, dtype=dtype, max_shard_bytes=max_shard_bytes
        )

    # --- checkpoints (fsdpx/checkpoint; format: checkpoint_tools/FORMAT.md) ---------------

    _COUNTERS = ("global_steps", "micro_steps", "skipped_steps")

    @property
    def _checkpointer(self) -> Checkpointer:
        """The engine's Checkpointer, made on first use.

        [Note: engine imports on first use] The checkpoint package (checkpoint_tools'
        format, msgpack, zstandard, the shuffle kernels) and the safetensors export are
        imported when a save or load first needs them, not with the engine: an engine that
        never checkpoints, such as `fsdpx.hf.from_pretrained`'s, does not pay their ~1.5
        MiB of resident memory (benchmarks/hf.py --part load measures each rank's RSS
        growth against 0.6x the model). Making the Checkpointer later changes nothing
        else: it only holds options until its first save (its process group is made
        then too)."""
        if self._checkpointer_made is None:
            from fsdpx.checkpoint.saving import Checkpointer

            self._checkpointer_made = Checkpointer.from_config(self.config)
        return self._checkpointer_made

    @guarded
    def save_checkpoint(
        self,
        save_dir: str | Path,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        *,
        save_latest: bool = True,
    ) -> Path:
        """Save model, optimizer, scheduler, loss scaler, step counters and every rank's RNG
        states as `<save_dir>/<tag>` (tag None: "global_step<N>"), atomically, then point
        `<save_dir>/latest` at it. Every rank calls it, after engine.step() (gradients are
        not saved). client_state: msgpack-able values (rank 0's is kept), e.g. the epoch or
        data-loader position. With checkpoint.async_save it returns once the state is in
        host memory; the next save, load_checkpoint or wait_for_checkpoint waits for it.
        Returns the checkpoint's path. With telemetry, rank 0 sends `checkpoint_saved` once
        the checkpoint is committed ([Note: checkpoint events] in checkpoint/saving.py).
        """
        return self._checkpointer.save(
            save_dir,
            model=self.module,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            loss_scaler=self.loss_scaler,
            engine_state={k: getattr(self, k) for k in self._COUNTERS},
            client_state=client_state,
            layout={"zero_stage": self.config.zero.stage, "mesh": list(self.mesh.shape)},
            tag=tag,
            save_latest=save_latest,
            on_commit=saved_reporter(self.telemetry, step=self.global_steps),
            **self._checkpoint_layout(),
        )

    @guarded
    def load_checkpoint(
        self,
        load_dir: str | Path,
        tag: str | None = None,
        *,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[Path, dict[str, Any]]:
        """Restore what save_checkpoint saved (tag None: the one `latest` names), at any
        world size, ZeRO stage or mesh. Returns (checkpoint path, client_state). Raises
        fsdpx.CheckpointNotFoundError when there is nothing to load (DeepSpeed returns
        None), CheckpointCorruptError naming the damaged file, tensor and offset, and
        DeepSpeedCheckpointError for a DeepSpeed checkpoint folder. With telemetry, rank 0
        sends `checkpoint_loaded` ([Note: checkpoint events]).
        """
        self._checkpointer.wait()  # a save in flight is not part of the load's time
        started = time.perf_counter()
        result = self._checkpointer.load(
            load_dir,
            model=self.module,
            optimizer=self.optimizer,
            tag=tag,
            lr_scheduler=self.lr_scheduler,
            loss_scaler=self.loss_scaler,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            partial=self._pipeline is not None,
        )
        for k in self._COUNTERS:
            if k in result.engine_state:
                setattr(self, k, int(result.engine_state[k]))
        took = time.perf_counter() - started
        report_loaded(self.telemetry, result, step=self.global_steps, duration_s=took)
        return result.path, result.client_state

    def _checkpoint_layout(self) -> dict[str, Any]:
        # Under pipeline parallelism each rank holds its stages only: plain tensors
        # (buffers, Adam's step) are written by the rank at coordinate 0 of every non-pp
        # axis, one per stage, and rank 0 merges the stages' optimizer descriptions
        # ([Note: pipeline checkpoints] in fsdpx/checkpoint/saving.py).
        if self._pipeline is None:
            return {}
        coord = self.mesh.get_coordinate()
        names = self.mesh.mesh_dim_names
        assert coord is not None and names is not None
        first = all(c == 0 for c, n in zip(coord, names, strict=True) if n != Axis.PP.value)
        return {"plain_writer": first, "partial": True}

    @guarded
    def wait_for_checkpoint(self) -> Path | None:
        """Block until an asynchronous save in flight is committed; raise its error."""
        if self._checkpointer_made is None:  # nothing was ever saved
            return None
        return self._checkpointer.wait()

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def close(self) -> None:
        """Release what outlives training steps: offload swap files and gradient hooks
        (also released when the engine is garbage collected or the interpreter exits)."""
        if self._optimizer_step.owns_resources:
            self.wait_for_checkpoint()
            self._optimizer_step.close()
