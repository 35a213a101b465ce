"""Tensor and sequence parallelism (mesh.tp > 1), applied to a model before FSDP.

The recipe follows torchtitan: a plan maps module names to torch ParallelStyles
(fsdpx/tp_plans.py), `parallelize_module` turns the planned parameters into DTensors on
the tp mesh, head counts of the split attention modules are divided by tp, and FSDP then
shards the same parameters over the data axes (2D DTensors).

[Note: sequence parallel region] With `sequence_parallel` the activations between
blocks are sharded along the sequence (dim 1). The region is the block list: the first
block splits its (replicated) input into sequence shards, a cheap local slice whose
backward all-gathers; the last block gathers its output back. Inside a block, norms run
on sequence shards, the attention / MLP input is all-gathered, and rowwise projections
reduce-scatter instead of all-reducing. Pipeline stages pass sequence shards between
them, each tp rank to the same tp rank of the next stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    loss_parallel,
    parallelize_module,
)

from fsdpx.config import TensorParallelConfig
from fsdpx.tp_plans import (
    HEAD_ATTRS,
    TPPlan,
    _is_conv1d,
    auto_plan,
    find_output_head,
    gather_sequence_input,
    torch_style,
    user_plan,
)


def build_plan(model: nn.Module, cfg: TensorParallelConfig, block_names: Sequence[str]) -> TPPlan:
    """The plan for `model`: cfg.plan if given, else the automatic one.

    Raises:
        ValueError: the plan is empty (nothing would be split), or a user pattern matches
            no module.

    Example::

        plan = build_plan(gpt, TensorParallelConfig(), ["blocks.0", "blocks.1"])
    """
    if cfg.plan is not None:
        plan = user_plan(model, cfg.plan)
    else:
        plan = auto_plan(model, block_names, sequence_parallel=cfg.sequence_parallel)
    if cfg.loss_parallel:
        plan.styles[find_output_head(model, block_names)] = "colwise_logits"
    if not any(s in ("colwise", "rowwise") for s in plan.styles.values()):
        raise ValueError(
            f"tensor parallelism found no projection to split in {type(model).__name__}: the "
            "automatic plan knows attention q_proj/k_proj/v_proj/o_proj and MLP "
            "up_proj/gate_proj/down_proj (and c_fc/c_proj, fc1/fc2, wq/wk/wv/wo, w1/w2/w3) "
            "inside the blocks; set tensor_parallel.plan, e.g. "
            '{"layers.*.mlp.fc_a": "colwise", "layers.*.mlp.fc_b": "rowwise"}'
        )
    return plan


def check_plan(model: nn.Module, plan: TPPlan, tp: int) -> None:
    """Check that tp divides every split dimension and head count, before anything changes.

    Raises:
        ValueError: naming the module, the size and tp.
    """
    for name, style in plan.styles.items():
        module = model.get_submodule(name)
        weight = getattr(module, "weight", None)
        if style not in ("colwise", "rowwise", "colwise_logits"):
            continue
        if not isinstance(module, nn.Linear) and not _is_conv1d(module):
            raise ValueError(
                f"tensor_parallel: {name} is a {type(module).__name__}; {style} splits "
                "nn.Linear (or Hugging Face Conv1D) layers only"
            )
        assert weight is not None
        # Linear weight is (out, in); Conv1D's is (in, out).
        out_dim, in_dim = (1, 0) if _is_conv1d(module) else (0, 1)
        dim, what = (in_dim, "input") if style == "rowwise" else (out_dim, "output")
        size = int(weight.shape[dim])
        if size % tp != 0:
            raise ValueError(
                f"tensor_parallel: mesh.tp = {tp} does not divide the {size} {what} features "
                f"of {name} ({style}); choose a tp that divides the hidden sizes"
            )
    for owner in plan.head_owners:
        module = model.get_submodule(owner)
        for attr in HEAD_ATTRS:
            heads = getattr(module, attr, None)
            if isinstance(heads, int) and heads % tp != 0:
                raise ValueError(
                    f"tensor_parallel: {owner}.{attr} = {heads} attention heads are not "
                    f"divisible by mesh.tp = {tp}; choose a tp that divides the head count"
                )


def apply_tensor_parallel(
    model: nn.Module,
    plan: TPPlan,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    first_block: str | None = None,
    last_block: str | None = None,
) -> None:
    """Split `model` in place over `tp_mesh` as `plan` says (entries for modules that
    `model` does not hold, e.g. on another pipeline stage, are skipped).

    Args:
        model: the model or one pipeline stage of it (still unsharded by FSDP).
        plan: from build_plan on the full model, checked with check_plan.
        tp_mesh: the 1D tp mesh.
        sequence_parallel: see [Note: sequence parallel region].
        first_block / last_block: the model's first and last block names (the SP region's
            edges), when this model holds them.

    Example::

        plan = build_plan(gpt, cfg.tensor_parallel, names)
        check_plan(gpt, plan, tp=2)
        apply_tensor_parallel(gpt, plan, mesh["tp"], sequence_parallel=False)
    """
    tp = tp_mesh.size()
    present = {n for n, _ in model.named_modules()}
    styles: dict[str, ParallelStyle] = {}
    for name, style in plan.styles.items():
        if name in present:
            module = model.get_submodule(name)
            styles[name] = torch_style(style, module, sequence_parallel=sequence_parallel)
    for owner in plan.head_owners:
        if owner not in present:
            continue
        module = model.get_submodule(owner)
        for attr in HEAD_ATTRS:
            heads = getattr(module, attr, None)
            if isinstance(heads, int):
                setattr(module, attr, heads // tp)
        if sequence_parallel:
            styles[owner] = gather_sequence_input()
    if sequence_parallel:
        styles.update(_sequence_region_edges(present, first_block, last_block))
    parallelize_module(model, tp_mesh, styles)


def _sequence_region_edges(
    present: set[str], first_block: str | None, last_block: str | None
) -> dict[str, ParallelStyle]:
    into = {"input_layouts": (Replicate(),), "desired_input_layouts": (Shard(1),)}
    out = {"output_layouts": (Shard(1),), "desired_output_layouts": (Replicate(),)}
    first = first_block if first_block in present else None
    last = last_block if last_block in present else None
    # Blocks add their input to their branches' local outputs: hand them local tensors.
    if first is not None and first == last:
        return {first: PrepareModuleInputOutput(**into, **out, use_local_input=True)}  # type: ignore[arg-type]
    edges: dict[str, ParallelStyle] = {}
    if first is not None:
        edges[first] = PrepareModuleInput(**into, use_local_output=True)  # type: ignore[arg-type]
    if last is not None:
        edges[last] = PrepareModuleOutput(**out)  # type: ignore[arg-type]
    return edges


@contextlib.contextmanager
def loss_context(enabled: bool) -> Iterator[None]:
    """torch's loss_parallel() when `enabled` (vocabulary-sharded logits: cross-entropy
    and its backward must both run inside it), else nothing.

    Example (a manual loop with tensor_parallel.loss_parallel)::

        with loss_context(True):
            loss = F.cross_entropy(engine(x).flatten(0, 1), y.flatten())
        engine.backward(loss)      # enters the context itself
    """
    if not enabled:
        yield
        return
    with loss_parallel():
        yield


def plain_loss(loss: torch.Tensor) -> torch.Tensor:
    """A loss computed by loss parallelism is a replicated DTensor: its local value."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
