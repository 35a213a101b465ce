"""What the engine does differently under mesh.sp > 1, resolved once into a frozen plan.

[Note: sp gradient scale] Each sp rank's loss is its share of the sequence's loss (sum over
its valid tokens / the sequence's valid-token count), so the shares of an sp group add up to
the loss of the whole sequence and the gradient of the whole sequence is the sum of the
ranks' gradients. FSDP averages gradients over all of its ranks, dp_shard x sp (and
dp_replicate), which would divide that sum by sp: engine.backward multiplies the loss by sp,
so the average over the sp ranks is their sum, and the average over the data-parallel
ranks stays the usual mean over samples. The reported loss (train_batch, eval_batch) is
the sum of the shares over the sp group, then the mean over the data-parallel ranks.

[Note: sp under pipeline parallelism] Under mesh.pp > 1 the schedule, not the engine, runs
forward, loss and backward (fsdpx/pipeline_parallel.py's PipelineRunner), so the runner
takes the plan: it shards each (inputs, targets) batch as train_batch does, hands
`position_ids` to the schedule as a keyword argument (torch's schedules split it by
micro-batch and pass it to every stage, so a block's RoPE on any stage sees global
positions), runs the schedule inside `context()` (the sp collectives of a stage's
attention run between its pipeline sends and receives; the sp ranks of one stage run the
same schedule, so they meet in the same order) and multiplies its loss scale by sp. The
last stage's loss gets `num_items_in_batch` from `count_targets`: the schedule hands the
loss function one micro-batch's targets and nothing else, so the whole sequence's count is
the sum of the shards' counts over the sp group (padding adds only -100 labels), one small
all-reduce per micro-batch, where train_batch reads it from shard_batch.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from fsdpx.config import Config
from fsdpx.parallel_dims import Axis, ParallelDims
from fsdpx.sequence.batch import IGNORE_INDEX, shard_sequence
from fsdpx.sequence.hf_model import is_hf_model
from fsdpx.sequence.ring import RingSDPA
from fsdpx.sequence.ulysses import UlyssesSDPA


@dataclass(frozen=True)
class SequencePlan:
    group: dist.ProcessGroup
    size: int
    rank: int
    pad: bool
    ring: bool
    """context_parallel.mode "ring": ring attention on the load-balanced layout
    (fsdpx/sequence/ring.py); False: Ulysses on contiguous shards."""
    intercept_sdpa: bool
    """Native models: F.scaled_dot_product_attention runs through Ulysses (UlyssesSDPA) or
    the ring (RingSDPA); Hugging Face models go through their attention registry instead
    (fsdpx/hf/ulysses.py)."""

    def context(self) -> contextlib.AbstractContextManager[Any]:
        """Entered around the engine's forward ([Note: Ulysses for native models])."""
        if not self.intercept_sdpa:
            return contextlib.nullcontext()
        return RingSDPA(self.group) if self.ring else UlyssesSDPA(self.group)

    def shard(self, batch: Any) -> dict[str, Any]:
        return shard_sequence(
            batch, rank=self.rank, size=self.size, pad=self.pad, balanced=self.ring
        )

    def loss(self, module: nn.Module, loss_fn: Callable[..., Tensor] | None, batch: Any) -> Tensor:
        """This rank's share of the loss of one micro-batch taken whole from the loader."""
        shard = self.shard(batch)
        with self.context():
            if "input" in shard:  # an (inputs, targets) batch
                if loss_fn is None:
                    raise ValueError(
                        "an (inputs, targets) batch under mesh.sp > 1 needs a loss: pass "
                        "fsdpx.shard(..., loss_fn=fsdpx.sequence.loss_fn)"
                    )
                out = module(shard["input"], position_ids=shard["position_ids"])
                return loss_fn(out, shard["target"], num_items_in_batch=shard["num_items_in_batch"])
            if loss_fn is not None and "shift_labels" in shard:
                labels = shard.pop("shift_labels")
                shard.pop("labels")
                n = shard.pop("num_items_in_batch")
                return loss_fn(module(**shard), labels, num_items_in_batch=n)
            out = module(**shard)
            return out["loss"] if isinstance(out, Mapping) else out

    def count_targets(self, targets: Tensor) -> Tensor:
        """Valid targets of the whole sequences whose shards `targets` are (a collective
        over the sp group; [Note: sp under pipeline parallelism])."""
        count = (targets != IGNORE_INDEX).sum()
        dist.all_reduce(count, group=self.group)
        return count

    def sum_shares(self, loss: Tensor) -> Tensor:
        """The loss of the whole sequence from each rank's share (for reporting)."""
        total = loss.detach().float().clone()
        dist.all_reduce(total, group=self.group)
        return total


def build_sequence_plan(
    cfg: Config,
    dims: ParallelDims,
    mesh: DeviceMesh,
    *,
    hf_model: bool,
) -> SequencePlan | None:
    """The plan for mesh.sp > 1 (None at sp = 1); check_sequence_config ran before."""
    if dims.sp == 1:
        return None
    sp = mesh[Axis.SP.value]
    return SequencePlan(
        group=sp.get_group(),
        size=dims.sp,
        rank=sp.get_local_rank(),
        pad=cfg.context_parallel.pad,
        ring=cfg.context_parallel.mode == "ring",
        intercept_sdpa=not hf_model,
    )


def check_sequence_config(
    cfg: Config,
    dims: ParallelDims,
    *,
    loss_fn: Callable[..., Tensor] | None,
    model: nn.Module | None = None,
) -> None:
    """Errors for settings mesh.sp cannot honour (no collective; every rank decides alike).
    fsdpx.shard calls it before it builds the mesh."""
    if dims.sp == 1:
        return
    if cfg.zero.stage == 0:
        raise ValueError(
            "mesh.sp > 1 shards the weights over dp_shard x sp (the sp ranks are "
            "data-parallel ranks for the weights), so it needs zero.stage 1, 2 or 3; got "
            "stage 0"
        )
    if model is not None and is_hf_model(model) and cfg.context_parallel.mode == "ulysses":
        # Ring attention has no head constraint: each rank keeps every (tp-local) head.
        from fsdpx.hf.ulysses import check_hf_heads

        check_hf_heads(model, sp=dims.sp, tp=dims.tp)
    if loss_fn is not None:
        params = inspect.signature(loss_fn).parameters
        takes = "num_items_in_batch" in params or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
        )
        if not takes:
            raise ValueError(
                f"under mesh.sp = {dims.sp} the loss_fn is called as loss_fn(outputs, "
                "targets, num_items_in_batch=...) so that each rank's loss is its share of "
                "the sequence's mean; {name} takes no num_items_in_batch. Pass "
                "fsdpx.shard(..., loss_fn=fsdpx.sequence.loss_fn)".format(
                    name=getattr(loss_fn, "__name__", repr(loss_fn))
                )
            )
