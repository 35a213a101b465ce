"""Pipeline parallelism (mesh.pp > 1) and the 3D recipe that composes it with tensor
parallelism and FSDP on one mesh.

Recipe per rank (torchtitan's order): split the model into stages (fsdpx/pipeline_split.py),
then for each local stage: tensor parallel, activation checkpointing, compile, FSDP over
the data axes; then one torch schedule runs all local stages.

[Note: no resharding under PP] Under pipeline parallelism every FSDP block keeps its
parameters gathered after forward (`reshard_after_forward=False`) whatever the ZeRO
stage says. Zero-bubble schedules split backward into an input-gradient and a later
weight-gradient pass; with per-block resharding the weight pass runs against resharded
parameters and the gradients come out wrong or missing, silently
(tests/test_pipeline_parallel.py shows the mismatch). Gradients are reduced once per
step, after the last micro-batch (the stage does that), so every ZeRO stage behaves like
stage 1/2 within a step.

[Note: no shared comm context] torchtitan shares one FSDP communication context between
the stage roots of a rank (`torch.distributed.fsdp.share_comm_ctx`) so that they use the
same CUDA streams. In torch 2.13 that context also holds the forward order used for
backward prefetching, and each stage's end-of-backward callback clears it while the
rank's other stage is still in backward: Interleaved1F1B and the V schedules then fail
with an IndexError inside FSDP's backward prefetch (tried on CPU/gloo). Each stage root
keeps its own context; on GPU this costs separate streams per local stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    get_schedule_class,
)

from fsdpx.activation_checkpoint import apply_activation_checkpointing
from fsdpx.config import Config
from fsdpx.materialize import materialize_
from fsdpx.parallel_dims import Axis, ParallelDims
from fsdpx.pipeline_split import (
    merged_view,
    model_units,
    plan_stages,
    prune_to_stage,
    stage_copies,
    stage_ids,
)
from fsdpx.tensor_parallel import apply_tensor_parallel, build_plan, check_plan
from fsdpx.zero import apply_zero

SINGLE_STAGE = frozenset({"GPipe", "1F1B"})
V_SHAPED = frozenset({"ZBVZeroBubble", "DualPipeV"})


def check_schedule(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> None:
    """Reject layouts the schedule cannot run, with the numbers, before anything is built.

    Raises:
        ValueError: wrong stages_per_rank for the schedule, or too few / a bad number of
            micro-batches (gradient_accumulation_steps).

    Example::

        check_schedule("1F1B", pp=4, stages_per_rank=1, microbatches=2)  # ValueError
    """
    # Single-stage schedules run one stage per rank, V schedules two (stage r and its
    # mirror), looped / interleaved ones several.
    if schedule in SINGLE_STAGE:
        need, ok = "exactly 1", stages_per_rank == 1
    elif schedule in V_SHAPED:
        need, ok = "exactly 2", stages_per_rank == 2
    else:
        need, ok = ">= 2", stages_per_rank >= 2
    if not ok:
        raise ValueError(
            f"pipeline.schedule {schedule!r} needs {need} stages per rank; got "
            f"pipeline.stages_per_rank = {stages_per_rank}"
        )
    stages = pp * stages_per_rank
    if schedule in ("1F1B", "DualPipeV") and microbatches < stages:
        raise ValueError(
            f"pipeline.schedule {schedule!r} needs at least as many micro-batches as stages: "
            f"gradient_accumulation_steps = {microbatches} < {stages} stages; raise "
            "gradient_accumulation_steps"
        )
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, microbatches // pp)
        if microbatches % rounds != 0:
            raise ValueError(
                f"pipeline.schedule {schedule!r} needs gradient_accumulation_steps to be a "
                f"multiple of its {rounds} rounds (max(1, {microbatches} // pp {pp})); got "
                f"{microbatches}. Use a multiple of mesh.pp = {pp}"
            )


class PipelineRunner:
    """Runs one optimizer step's micro-batches through the schedule on this rank."""

    def __init__(
        self,
        *,
        schedule: Any,
        stages: Sequence[PipelineStage],
        loss_fn: Callable[..., torch.Tensor],
        pp_group: dist.ProcessGroup,
        last_stage_rank: int,
    ) -> None:
        self.schedule = schedule
        self.stages = list(stages)
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        self._loss_fn = loss_fn
        self._pp_group = pp_group
        self._last_stage_rank = last_stage_rank
        self._scale = 1.0

    def scaled_loss(self, output: Any, target: Any) -> torch.Tensor:
        """The schedule's loss: the user's loss times loss_scale / micro-batches, as
        engine.backward scales it (in fp32: a 16-bit loss times the scale overflows).
        Scaling here rather than with the schedule's scale_grads keeps the fp16 activation
        gradients as large as without the pipeline, not micro-batches times larger."""
        loss = self._loss_fn(output, target).float()
        return loss * self._scale if self._scale != 1.0 else loss

    def step(self, batches: Sequence[Any], loss_scale: float, device: torch.device) -> torch.Tensor:
        """Forward and backward of `batches` (one per micro-batch) through the schedule.

        Returns:
            The mean unscaled loss of the micro-batches, on every rank of the pp group.
        """
        if any(not isinstance(b, (tuple, list)) or len(b) != 2 for b in batches):
            raise ValueError(
                "under pipeline parallelism every batch must be an (inputs, targets) pair: "
                "the first stage reads inputs, the last stage targets"
            )
        x = torch.cat([b[0] for b in batches]).to(device)
        y = torch.cat([b[1] for b in batches]).to(device)
        self._scale = loss_scale / len(batches)
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"return_outputs": False}
        if self.has_last:
            kwargs.update(target=y, losses=losses)
        args = (x,) if self.has_first else ()
        self.schedule.step(*args, **kwargs)
        total = torch.zeros((), dtype=torch.float32, device=device)
        if self.has_last:
            total = torch.stack([t.detach().float() for t in losses]).mean() / self._scale
        dist.broadcast(total, group=self._pp_group, group_src=self._last_stage_rank)
        return total


@dataclass
class Parallelized:
    """What the 3D recipe made on this rank."""

    module: nn.Module
    """The model (pp = 1) or a PipelineView of the local stages (pp > 1)."""
    parts: list[nn.Module]
    """The FSDP roots: the model, or one per local pipeline stage."""
    pipeline: PipelineRunner | None
    """The schedule runner (pp > 1)."""


def parallelize(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    *,
    cfg: Config,
    dims: ParallelDims,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    device: torch.device,
    loss_fn: Callable[..., torch.Tensor] | None,
    on_meta: bool,
    init_fn: Callable[[nn.Module], None] | None = None,
    pp_block_reshard_after_forward: bool | int = False,
) -> Parallelized:
    """Split (pp), tensor-parallelise (tp), checkpoint, compile and shard (FSDP) `model`.

    Args:
        model: the model, on its device or on meta; consumed (stages are built from it).
        blocks: its blocks (fsdpx.blocks.find_blocks).
        cfg, dims, mesh: the config and the world mesh (ParallelDims.build_mesh).
        mp_policy: FSDP mixed precision.
        loss_fn: `loss_fn(outputs, targets)`; required under pp (the last stage calls it).
        on_meta: materialise each stage after sharding (needs init_fn).
        pp_block_reshard_after_forward: internal, for the regression test of
            [Note: no resharding under PP]; never change it in training.
    Returns:
        Parallelized.

    Example::

        built = parallelize(gpt, find_blocks(gpt), cfg=cfg, dims=dims, mesh=mesh,
                            mp_policy=MixedPrecisionPolicy(), device=torch.device("cpu"),
                            loss_fn=loss_fn, on_meta=False)
    """
    if on_meta and init_fn is None:
        # reset_parameters() would run per stage and per tp shard with one seed: stages
        # would repeat each other's values and tp ranks disagree on replicated ones.
        raise ValueError(
            f"a model built on the meta device with mesh.tp = {dims.tp} and mesh.pp = "
            f"{dims.pp} needs init_fn: pass fsdpx.shard(..., init_fn=fsdpx.per_param_init(fn)), "
            "which initialises each parameter from its full-model name, so every layout "
            "gets the values of the unsplit model"
        )
    names = {id(m): n for n, m in model.named_modules()}
    block_names = [names[id(b)] for b in blocks]
    plan = None
    if dims.tp > 1:
        plan = build_plan(model, cfg.tensor_parallel, block_names)
        check_plan(model, plan, dims.tp)
        if cfg.tensor_parallel.loss_parallel and dims.pp > 1:
            raise NotImplementedError(
                "tensor_parallel.loss_parallel with pipeline parallelism (mesh.pp > 1) is not "
                "implemented yet; set loss_parallel to false (the last stage then gathers the "
                "logits and computes the loss on whole rows)"
            )
    runner_inputs = None
    if dims.pp > 1:
        pcfg = cfg.pipeline
        if loss_fn is None:
            raise ValueError(
                "pipeline parallelism needs loss_fn: the last stage computes "
                "loss_fn(outputs, targets); pass fsdpx.shard(..., loss_fn=...)"
            )
        check_schedule(
            pcfg.schedule, dims.pp, pcfg.stages_per_rank, cfg.gradient_accumulation_steps
        )
        num_stages = dims.pp * pcfg.stages_per_rank
        stage_units = plan_stages(model, block_names, num_stages, pcfg)
        units = model_units(model, block_names)
        pp_rank = mesh[Axis.PP.value].get_local_rank()
        ids = stage_ids(pp_rank, dims.pp, pcfg.stages_per_rank, pcfg.schedule in V_SHAPED)
        parts = stage_copies(model, len(ids))
        for part, sid in zip(parts, ids, strict=True):
            prune_to_stage(part, units, stage_units[sid])
        runner_inputs = (ids, num_stages)
    else:
        parts = [model]
    raf: bool | int | None = pp_block_reshard_after_forward if dims.pp > 1 else None
    for part in parts:
        present = {n for n, _ in part.named_modules()}
        part_blocks = [part.get_submodule(n) for n in block_names if n in present]
        if plan is not None:
            apply_tensor_parallel(
                part,
                plan,
                mesh[Axis.TP.value],
                sequence_parallel=cfg.tensor_parallel.sequence_parallel,
                first_block=block_names[0],
                last_block=block_names[-1],
            )
        apply_activation_checkpointing(part_blocks, cfg.activation_checkpointing)
        if cfg.compile:
            for block in part_blocks:
                block.compile()
        apply_zero(
            part,
            part_blocks,
            mesh=ParallelDims.fsdp_mesh(mesh),
            zero=cfg.zero,
            mp_policy=mp_policy,
            block_reshard_after_forward=raf,
        )
        if on_meta:
            materialize_(part, device, seed=cfg.seed, init_fn=init_fn)
    if runner_inputs is None:
        return Parallelized(module=model, parts=parts, pipeline=None)
    assert loss_fn is not None
    ids, num_stages = runner_inputs
    runner = _build_runner(parts, ids, num_stages, cfg, dims, mesh, device, loss_fn)
    return Parallelized(module=merged_view(parts), parts=parts, pipeline=runner)


def _build_runner(
    parts: Sequence[nn.Module],
    ids: Sequence[int],
    num_stages: int,
    cfg: Config,
    dims: ParallelDims,
    mesh: DeviceMesh,
    device: torch.device,
    loss_fn: Callable[..., torch.Tensor],
) -> PipelineRunner:
    pp_group = mesh[Axis.PP.value].get_group()
    stages = [
        PipelineStage(part, sid, num_stages, device, group=pp_group)
        for part, sid in zip(parts, ids, strict=True)
    ]
    name = cfg.pipeline.schedule
    v_style = name in V_SHAPED
    last_rank = 0 if v_style else (num_stages - 1) % dims.pp
    runner = PipelineRunner(
        schedule=None, stages=stages, loss_fn=loss_fn, pp_group=pp_group, last_stage_rank=last_rank
    )
    cls = get_schedule_class(name)
    gas = cfg.gradient_accumulation_steps
    # The loss is divided by the micro-batch count in scaled_loss (see there).
    if issubclass(cls, PipelineScheduleSingle):
        runner.schedule = cls(
            stages[0], n_microbatches=gas, loss_fn=runner.scaled_loss, scale_grads=False
        )
    else:
        assert issubclass(cls, PipelineScheduleMulti)
        runner.schedule = cls(
            stages, n_microbatches=gas, loss_fn=runner.scaled_loss, scale_grads=False
        )
    return runner
