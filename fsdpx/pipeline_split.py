"""Splitting a model into pipeline stages at module boundaries.

[Note: stage modules] A stage is a copy of the whole model with the modules of other
stages removed: top-level modules (embeddings, final norm, head) are set to None, blocks
are deleted from their ModuleList *keeping the other keys*, so parameter names on every
stage are those of the full model (`blocks.5.mlp.up_proj.weight` stays that on stage 2)
and checkpoints move between layouts. The model's forward must skip a None module and
iterate its block list (torchtitan's convention; fsdpx/demo/gpt.py follows it).

[Note: every unit on one stage] Each unit, parameters or not, lives on the one stage whose
span of units contains it. A parameter-free unit (ReLU, MaxPool, Flatten, Dropout) is a
step of the forward like any other: kept on every stage, a forward that calls its
children in order re-ran it on the other stages' activations (a MaxPool of stage 0 halved
stage 1's input again). State a forward uses on every stage (rotary tables, masks) belongs
on the model itself as a buffer, which every stage keeps, not in a unit.

Units, in registration order: the children of the model, with the block list's parent
chain expanded, e.g. GPT: wte, wpe, drop, blocks.0 ... blocks.3, ln_f, lm_head.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from torch import nn

from fsdpx.config import PipelineConfig


def model_units(model: nn.Module, block_names: Sequence[str]) -> list[str]:
    """The model's split units in order (see the module docstring).

    Raises:
        ValueError: the blocks do not share one parent list, or a module on the path to
            the blocks holds parameters of its own (they would be on every stage).
    """
    if not block_names:
        raise ValueError(
            f"pipeline parallelism needs the model's block list; none was found in "
            f"{type(model).__name__}. Set zero.block_classes to the block class name"
        )
    container = block_names[0].rpartition(".")[0]
    if any(n.rpartition(".")[0] != container for n in block_names):
        raise ValueError(
            f"pipeline parallelism needs every block in one list; blocks live under "
            f"{sorted({n.rpartition('.')[0] for n in block_names})}"
        )
    path = container.split(".") if container else []
    units: list[str] = []

    def expand(prefix: str, module: nn.Module, depth: int) -> None:
        if any(True for _ in module.parameters(recurse=False)):
            raise ValueError(
                f"pipeline parallelism cannot split {prefix or type(model).__name__}: it holds "
                "parameters of its own next to the block list; move them into a submodule"
            )
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if depth < len(path) and name == path[depth]:
                if depth + 1 == len(path):
                    units.extend(f"{full}.{n}" for n, _ in child.named_children())
                else:
                    expand(full, child, depth + 1)
            else:
                units.append(full)

    if container:
        expand("", model, 0)
    else:
        units.extend(n for n, _ in model.named_children())
    return units


def plan_stages(
    model: nn.Module, block_names: Sequence[str], num_stages: int, cfg: PipelineConfig
) -> list[list[str]]:
    """Which units each stage holds: contiguous spans of the units, in order
    ([Note: every unit on one stage]).

    Args:
        model: the full model.
        block_names: its blocks in order.
        num_stages: pp * stages_per_rank.
        cfg: split_points, or the even split with first/last_stage_layers.
    Returns:
        One list of unit names per stage, in stage order.
    Raises:
        ValueError: more stages than blocks, split points that are not units or out of
            order, layer counts that do not fit.

    Example::

        plan_stages(gpt, [f"blocks.{i}" for i in range(4)], 2, PipelineConfig())
        # [["wte", "wpe", "drop", "blocks.0", "blocks.1"], ["blocks.2", ..., "lm_head"]]
    """
    units = model_units(model, block_names)
    if cfg.split_points:
        starts = _split_point_indices(units, cfg.split_points, num_stages)
    else:
        starts = _even_starts(units, list(block_names), num_stages, cfg)
    bounds = [*starts, len(units)]
    return [units[bounds[i] : bounds[i + 1]] for i in range(num_stages)]


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _split_point_indices(units: list[str], points: Sequence[str], num_stages: int) -> list[int]:
    if len(points) + 1 != num_stages:
        raise ValueError(
            f"pipeline.split_points has {len(points)} names, which make {len(points) + 1} "
            f"stages; the layout needs mesh.pp * pipeline.stages_per_rank = {num_stages} "
            f"stages ({num_stages - 1} split points)"
        )
    missing = [p for p in points if p not in units]
    if missing:
        raise ValueError(
            f"pipeline.split_points {missing} are not split units of the model; units are {units}"
        )
    idx = [units.index(p) for p in points]
    if idx != sorted(set(idx)) or idx[0] == 0:
        raise ValueError(
            f"pipeline.split_points {list(points)} must be distinct, in module order, and "
            f"not the first unit {units[0]!r}"
        )
    return [0, *idx]


def _even_starts(
    units: list[str], blocks: list[str], num_stages: int, cfg: PipelineConfig
) -> list[int]:
    n = len(blocks)
    first, last = cfg.first_stage_layers, cfg.last_stage_layers
    if num_stages > n:
        raise ValueError(
            f"pipeline: {num_stages} stages (mesh.pp * pipeline.stages_per_rank) but the model "
            f"has only {n} blocks; every stage needs at least one block. Lower mesh.pp or "
            "pipeline.stages_per_rank"
        )
    fixed = [x for x in (first, last) if x is not None]
    free_stages = num_stages - len(fixed)
    free_blocks = n - sum(fixed)
    if free_blocks < free_stages or (free_stages == 0 and free_blocks != 0):
        raise ValueError(
            f"pipeline: first_stage_layers={first} and last_stage_layers={last} leave "
            f"{free_blocks} of the {n} blocks for the other {free_stages} stages; each stage "
            "needs at least one block and every block a stage"
        )
    counts: list[int] = []
    base, extra = divmod(free_blocks, free_stages) if free_stages else (0, 0)
    for s in range(num_stages):
        if s == 0 and first is not None:
            counts.append(first)
        elif s == num_stages - 1 and last is not None:
            counts.append(last)
        else:
            counts.append(base + (1 if extra > 0 else 0))
            extra -= 1 if extra > 0 else 0
    # Stage s starts at its first block; stage 0 at unit 0 (embeddings come with it).
    starts, seen = [0], 0
    for c in counts[:-1]:
        seen += c
        starts.append(units.index(blocks[seen]))
    return starts


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int, v_style: bool) -> list[int]:
    """The stage indices one pp rank runs: loop style (r, r + pp, ...) or V style (r and
    2 * pp - 1 - r), as torch's schedules expect."""
    if v_style:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def prune_to_stage(model: nn.Module, units: Sequence[str], keep: Sequence[str]) -> nn.Module:
    """Remove from `model`, in place, every unit not in `keep` (see [Note: stage modules])."""
    keep_set = set(keep)
    for unit in units:
        if unit in keep_set:
            continue
        parent_name, _, leaf = unit.rpartition(".")
        parent = model.get_submodule(parent_name)
        if isinstance(parent, nn.ModuleList):
            # Deleting from _modules keeps the other keys (ModuleList.__delitem__ would
            # renumber them); iteration and len() still work, int indexing does not.
            del parent._modules[leaf]
        else:
            setattr(parent, leaf, None)
    return model


def stage_copies(model: nn.Module, count: int) -> list[nn.Module]:
    """`count` independent models: deep copies, the last being `model` itself."""
    return [copy.deepcopy(model) for _ in range(count - 1)] + [model]


class PipelineView(nn.Module):
    """The modules of all stages of one rank under the full model's names, for
    `engine.module`: parameters(), named_parameters() and state_dict() see every local
    parameter once, with its full-model name. Calling it is an error: under pipeline
    parallelism run the model with engine.train_batch."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "under pipeline parallelism (mesh.pp > 1) each rank holds only its stages, so "
            "engine(x) / engine.module(x) cannot run the model; use "
            "engine.train_batch(data_iter), which runs the pipeline schedule"
        )


def merged_view(parts: Sequence[nn.Module]) -> PipelineView:
    """A PipelineView over the stage modules `parts` of one rank."""
    view = PipelineView()
    _merge_into(view, parts)
    return view


def _merge_into(target: nn.Module, parts: Sequence[nn.Module]) -> None:
    names: dict[str, list[nn.Module]] = {}
    for part in parts:
        for name, child in part.named_children():
            names.setdefault(name, []).append(child)
    for name, children in names.items():
        with_params = [c for c in children if _has_params(c)]
        if len(with_params) <= 1:
            target.add_module(name, (with_params or children)[0])
        else:
            # An ancestor of the block list, present on several stages: merge its children.
            holder = nn.ModuleList() if isinstance(with_params[0], nn.ModuleList) else nn.Module()
            _merge_into(holder, with_params)
            target.add_module(name, holder)
