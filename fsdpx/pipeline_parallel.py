"""Pipeline parallelism (mesh.pp > 1): the split of the model into this rank's stages,
the check that the schedule can run the layout, and the runner that drives one torch
schedule over the local stages.

    split_stages -> (fsdpx/parallelize.py: TP -> AC -> compile -> FSDP per stage,
                     materialise) -> build_runner -> PipelineRunner.step per optimizer step

The recipe in fsdpx/parallelize.py calls both ends; what pipelining asks of the FSDP step
is stated there ([Note: no resharding under PP], [Note: no shared comm context]). How the
model is cut into stage modules: [Note: stage modules] in fsdpx/pipeline_split.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    get_schedule_class,
)

from fsdpx.config import Config
from fsdpx.parallel_dims import Axis, ParallelDims
from fsdpx.pipeline_split import (
    model_units,
    plan_stages,
    prune_to_stage,
    stage_copies,
    stage_ids,
)
from fsdpx.pipeline_tied import Tie, TiedGradients, find_ties

if TYPE_CHECKING:
    from fsdpx.sequence.plan import SequencePlan

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
        tied: TiedGradients | None = None,
    ) -> None:
        self.schedule = schedule
        self.tied = tied
        """Sums the gradients of parameters shared across stages after each step's
        backward ([Note: tied parameters across stages] in fsdpx/pipeline_tied.py)."""
        self.stages = list(stages)
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        self._loss_fn = loss_fn
        self._pp_group = pp_group
        self._last_stage_rank = last_stage_rank
        self._scale = 1.0
        self._sequence: SequencePlan | None = None

    def scaled_loss(self, output: Any, target: Any) -> torch.Tensor:
        """The schedule's loss: the user's loss times loss_scale / micro-batches, as
        engine.backward scales it (in fp32: a 16-bit loss times the scale overflows).
        Scaling here rather than with the schedule's scale_grads keeps the fp16 activation
        gradients as large as without the pipeline, not micro-batches times larger.
        Under mesh.sp > 1 the loss is this rank's share ([Note: sp under pipeline
        parallelism])."""
        if self._sequence is None:
            loss = self._loss_fn(output, target).float()
        else:
            count = self._sequence.count_targets(target)
            loss = self._loss_fn(output, target, num_items_in_batch=count).float()
        return loss * self._scale if self._scale != 1.0 else loss

    def step(
        self,
        batches: Sequence[Any],
        loss_scale: float,
        device: torch.device,
        sequence: SequencePlan | None = None,
    ) -> torch.Tensor:
        """Forward and backward of `batches` (one per micro-batch) through the schedule;
        under mesh.sp > 1 (`sequence`) each batch holds whole sequences and this rank runs
        its share of them ([Note: sp under pipeline parallelism]).

        Returns:
            The mean unscaled loss of the micro-batches (under sp: this rank's share of
            it), on every rank of the pp group.
        """
        loss = self._run(self.schedule.step, batches, loss_scale / len(batches), device, sequence)
        if self.tied is not None:
            self.tied.reduce()
        return loss

    def evaluate(
        self,
        batches: Sequence[Any],
        device: torch.device,
        sequence: SequencePlan | None = None,
    ) -> torch.Tensor:
        """Forward only: `batches` through the schedule without gradients.

        Returns:
            The mean loss of the micro-batches (under sp: this rank's share), on every
            rank of the pp group.
        """
        with torch.no_grad():
            return self._run(self.schedule.eval, batches, 1.0, device, sequence)

    def _run(
        self,
        run: Callable[..., Any],
        batches: Sequence[Any],
        scale: float,
        device: torch.device,
        sequence: SequencePlan | None,
    ) -> torch.Tensor:
        if any(not isinstance(b, (tuple, list)) or len(b) != 2 for b in batches):
            raise ValueError(
                "under pipeline parallelism every batch must be an (inputs, targets) pair: "
                "the first stage reads inputs, the last stage targets"
            )
        kwargs: dict[str, Any] = {"return_outputs": False}
        if sequence is None:
            x = torch.cat([b[0] for b in batches]).to(device)
            y = torch.cat([b[1] for b in batches]).to(device)
        else:
            shards = [sequence.shard(tuple(b)) for b in batches]
            x = torch.cat([s["input"] for s in shards]).to(device)
            y = torch.cat([s["target"] for s in shards]).to(device)
            # A keyword argument of the schedule reaches every stage's forward, split by
            # micro-batch as the inputs are: RoPE in any block sees global positions.
            kwargs["position_ids"] = torch.cat([s["position_ids"] for s in shards]).to(device)
            scale *= sequence.size  # [Note: sp gradient scale] in fsdpx/sequence/plan.py
        self._scale = scale
        self._sequence = sequence
        losses: list[torch.Tensor] = []
        if self.has_last:
            kwargs.update(target=y, losses=losses)
        args = (x,) if self.has_first else ()
        with sequence.context() if sequence is not None else contextlib.nullcontext():
            run(*args, **kwargs)
        total = torch.zeros((), dtype=torch.float32, device=device)
        if self.has_last:
            total = torch.stack([t.detach().float() for t in losses]).mean() / self._scale
        dist.broadcast(total, group=self._pp_group, group_src=self._last_stage_rank)
        return total


def _clone_received(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Forward pre-hook of every stage but the first: its inputs as copies.

    [Note: in-place at a stage boundary] A stage receives its input as a leaf tensor that
    requires grad (the stage returns that leaf's gradient to the previous stage). An
    in-place op on it as the stage's first step (`nn.ReLU(inplace=True)` right after a
    split point) is an autograd error on a leaf, where the unsplit model applies it to a
    non-leaf activation. A copy gives the stage the non-leaf the model had; the cost is
    one activation-sized copy per micro-batch at each stage boundary.
    """
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


@dataclass(frozen=True)
class StageSplit:
    """This rank's pipeline stages: `parts[i]` is stage `ids[i]` of `num_stages`."""

    parts: list[nn.Module]
    """The stage modules (see [Note: stage modules] in fsdpx/pipeline_split.py); the last
    one is the model itself, pruned."""
    ids: list[int]
    """Their stage indices, in the order torch's schedules expect."""
    num_stages: int
    """Stages over all pp ranks (mesh.pp x pipeline.stages_per_rank)."""
    ties: tuple[Tie, ...] = ()
    """Parameters units of several stages share (fsdpx/pipeline_tied.py)."""


def split_stages(
    model: nn.Module,
    block_names: Sequence[str],
    *,
    cfg: Config,
    dims: ParallelDims,
    mesh: DeviceMesh,
    loss_fn: Callable[..., torch.Tensor] | None,
) -> StageSplit:
    """Check the schedule's layout, then cut `model` into this rank's stages.

    Args:
        model: the whole model (on its device or on meta), still unsharded; consumed:
            the last stage is `model` itself, pruned.
        block_names: its blocks' module names, in order.
        cfg, dims, mesh: the config and the world mesh (ParallelDims.build_mesh).
        loss_fn: `loss_fn(outputs, targets)`; required (the last stage calls it).
    Returns:
        StageSplit.
    Raises:
        ValueError: no loss_fn, or a layout the schedule cannot run (check_schedule).

    Example::

        split = split_stages(gpt, ["blocks.0", "blocks.1"], cfg=cfg, dims=dims, mesh=mesh,
                             loss_fn=loss_fn)
    """
    pcfg = cfg.pipeline
    if loss_fn is None:
        raise ValueError(
            "pipeline parallelism needs loss_fn: the last stage computes "
            "loss_fn(outputs, targets); pass fsdpx.shard(..., loss_fn=...)"
        )
    check_schedule(pcfg.schedule, dims.pp, pcfg.stages_per_rank, cfg.gradient_accumulation_steps)
    num_stages = dims.pp * pcfg.stages_per_rank
    stage_units = plan_stages(model, block_names, num_stages, pcfg)
    units = model_units(model, block_names)
    pp_rank = mesh[Axis.PP.value].get_local_rank()
    ids = stage_ids(pp_rank, dims.pp, pcfg.stages_per_rank, pcfg.schedule in V_SHAPED)
    ties = tuple(find_ties(model, stage_units))  # before the copies: they unshare them
    parts = stage_copies(model, len(ids))
    for part, sid in zip(parts, ids, strict=True):
        prune_to_stage(part, units, stage_units[sid])
    return StageSplit(parts=parts, ids=ids, num_stages=num_stages, ties=ties)


def build_runner(
    split: StageSplit,
    *,
    cfg: Config,
    dims: ParallelDims,
    mesh: DeviceMesh,
    device: torch.device,
    loss_fn: Callable[..., torch.Tensor],
) -> PipelineRunner:
    """The schedule over this rank's stages, once they are parallelised and materialised.

    Example::

        runner = build_runner(split, cfg=cfg, dims=dims, mesh=mesh, device=device,
                              loss_fn=loss_fn)
    """
    num_stages = split.num_stages
    pp_group = mesh[Axis.PP.value].get_group()
    for part, sid in zip(split.parts, split.ids, strict=True):
        if sid > 0:
            part.register_forward_pre_hook(_clone_received)
    stages = [
        PipelineStage(part, sid, num_stages, device, group=pp_group)
        for part, sid in zip(split.parts, split.ids, strict=True)
    ]
    name = cfg.pipeline.schedule
    v_style = name in V_SHAPED
    last_rank = 0 if v_style else (num_stages - 1) % dims.pp
    tied = TiedGradients(split.ties, split.parts, split.ids, mesh) if split.ties else None
    runner = PipelineRunner(
        schedule=None,
        stages=stages,
        loss_fn=loss_fn,
        pp_group=pp_group,
        last_stage_rank=last_rank,
        tied=tied,
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
