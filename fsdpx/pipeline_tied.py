"""Parameters shared by pipeline stages (an embedding tied to the LM head on the first and
last stage): found before the split, kept equal after it.

[Note: tied parameters across stages] The split gives every stage its own copy of the
model ([Note: stage modules] in fsdpx/pipeline_split.py), so a parameter two units share
becomes one copy per stage that uses it. As DeepSpeed does for its tied-weight groups
(PipelineEngine's `_exec_reduce_tied_grads`), after the schedule's backward each copy's
gradient is summed with the other copies' over a process group of the ranks that hold
them (one group per tie and per coordinate of the other mesh axes), so every copy gets the
gradient of the unsplit model's one parameter and takes the same optimizer step. The
copies start equal (the first stage's values are broadcast when the groups are made, after
materialisation), and the gradient norm counts the tie once, on its first stage
(`replicas`), as DeepSpeed's `ds_pipe_replicated` does. Each copy must be sharded the
same way on every stage (the sum is of local shards): checked when the groups are made.
Only one stage per rank is supported (a V or looped schedule would put two copies on one
rank): refused with ties.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdpx.comm import counted
from fsdpx.dtensor import to_local
from fsdpx.parallel_dims import Axis


@dataclass(frozen=True)
class Tie:
    """One parameter of the unsplit model that units of several stages share."""

    stages: tuple[int, ...]
    """The stages holding a copy, ascending."""
    names: tuple[str, ...]
    """The copy's parameter name on each of those stages (full-model names)."""


def find_ties(model: nn.Module, stage_units: Sequence[Sequence[str]]) -> list[Tie]:
    """The parameters that units of different stages share, before the split.

    Args:
        model: the unsplit model.
        stage_units: the units of each stage (fsdpx.pipeline_split.plan_stages).

    Example::

        find_ties(net, [["0", "1"], ["2", "3"]])
        # [Tie(stages=(0, 1), names=("0.module.weight", "3.module.weight"))]
    """
    seen: dict[int, dict[int, str]] = {}
    order: list[int] = []
    for stage, units in enumerate(stage_units):
        for unit in units:
            module = model.get_submodule(unit)
            for name, p in module.named_parameters(remove_duplicate=False):
                if id(p) not in seen:
                    seen[id(p)] = {}
                    order.append(id(p))
                seen[id(p)].setdefault(stage, f"{unit}.{name}")
    ties = []
    for key in order:
        by_stage = seen[key]
        if len(by_stage) > 1:
            stages = tuple(sorted(by_stage))
            ties.append(Tie(stages, tuple(by_stage[s] for s in stages)))
    return ties


class TiedGradients:
    """Sums the tied copies' gradients over the stages that hold them ([Note: tied
    parameters across stages]). Built on every rank, in the same order (it makes process
    groups), once the stages are parallelised and materialised.

    Args:
        ties: find_ties's result (the same on every rank).
        parts: this rank's stage modules; stage_ids: their stage indices.
        mesh: the world mesh (with a pp axis).

    Raises:
        NotImplementedError: a rank runs several stages (V or looped schedules).
        ValueError: the copies of a tie are sharded differently on their stages.
    """

    def __init__(
        self,
        ties: Sequence[Tie],
        parts: Sequence[nn.Module],
        stage_ids: Sequence[int],
        mesh: DeviceMesh,
    ) -> None:
        if ties and len(stage_ids) != 1:
            raise NotImplementedError(
                f"parameters shared across pipeline stages ({[t.names for t in ties]}) need "
                f"one stage per rank (a GPipe or 1F1B schedule); this rank runs stages "
                f"{list(stage_ids)}. Use pipeline.stages_per_rank 1, or untie them"
            )
        self._held: list[tuple[nn.Parameter, dist.ProcessGroup]] = []
        self.replicas: list[nn.Parameter] = []
        """The copies the gradient norm leaves out (all but a tie's first stage's)."""
        if not ties:
            return
        names = list(mesh.mesh_dim_names or ())
        pp_axis = names.index(Axis.PP.value)
        # Rows: pp ranks; columns: every coordinate of the other axes.
        grid = mesh.mesh.movedim(pp_axis, 0).reshape(mesh.mesh.shape[pp_axis], -1)
        me = dist.get_rank()
        stage = stage_ids[0]
        for tie in ties:
            for column in range(grid.shape[1]):
                ranks = [int(grid[s, column]) for s in tie.stages]
                group = dist.new_group(ranks)  # every rank, every group, same order
                if me in ranks and stage in tie.stages:
                    p = parts[0].get_parameter(tie.names[tie.stages.index(stage)])
                    _check_same_layout(tie, p, group)
                    # The copies start equal whatever materialised them.
                    dist.broadcast(to_local(p).detach(), group=group, group_src=0)
                    self._held.append((p, group))
                    if stage != tie.stages[0]:
                        self.replicas.append(p)

    def reduce(self) -> None:
        """Sum each held copy's gradient over its tie's stages, in place (after the
        schedule's backward, before the gradient norm and the optimizer step)."""
        for p, group in self._held:
            if p.grad is None:
                raise RuntimeError(
                    "a parameter shared across pipeline stages got no gradient on this stage; "
                    "every stage holding a tied copy must use it in its forward"
                )
            counted.all_reduce(to_local(p.grad), group)


def _check_same_layout(tie: Tie, p: torch.Tensor, group: dist.ProcessGroup) -> None:
    mine = (tuple(to_local(p).shape), str(p.placements) if isinstance(p, DTensor) else "plain")
    every: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    if any(other != mine for other in every):
        raise ValueError(
            f"the parameter shared across pipeline stages {list(tie.stages)} (names "
            f"{list(tie.names)}) is sharded differently on them ({every}: local shape, "
            "placements); its gradient copies cannot be summed. Give the shared module the "
            "same tensor-parallel plan on every stage, or untie it"
        )
