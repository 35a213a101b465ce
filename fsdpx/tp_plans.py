"""Tensor-parallel plans: which module of a model gets which torch ParallelStyle.

The automatic plan recognises the usual transformer layouts by module name, inside the
blocks only (embeddings and the head stay replicated):

| role | names (last component of the module name) | style |
|------|--------------------------------------------|-------|
| attention in | q_proj k_proj v_proj query key value wq wk wv | colwise |
| MLP in | up_proj gate_proj w1 w3 c_fc fc1 fc_in | colwise |
| out | o_proj out_proj wo down_proj w2 c_proj fc2 fc_out | rowwise |

An "out" projection is sharded only next to a colwise sibling (same parent): GPT-2's
attention `c_proj` follows the fused `c_attn`, which the plan leaves replicated, while its
MLP `c_proj` follows `c_fc`. Fused q/k/v projections (`c_attn`, `qkv_proj`, `Wqkv`,
`query_key_value`) are not split: a plain column split of [q | k | v] would give rank 0
all of q instead of its share of each, so their attention runs replicated.

Hugging Face `Conv1D` (GPT-2) stores its weight transposed, (in, out): the Conv1D styles
below shard dim 1 for colwise and dim 0 for rowwise, where torch's styles assume Linear.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

COLWISE_NAMES = frozenset(
    {"q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv"}
    | {"up_proj", "gate_proj", "w1", "w3", "c_fc", "fc1", "fc_in"}
)
ROWWISE_NAMES = frozenset(
    {"o_proj", "out_proj", "wo", "down_proj", "w2", "c_proj", "fc2", "fc_out"}
)
FUSED_QKV_NAMES = frozenset({"c_attn", "qkv_proj", "Wqkv", "query_key_value"})
HEAD_ATTRS = (
    "n_head",
    "n_heads",
    "num_heads",
    "num_attention_heads",
    "n_kv_heads",
    "num_kv_heads",
    "num_key_value_heads",
)
"""Attributes holding a head count; divided by tp on modules whose projections are colwise."""


@dataclass
class TPPlan:
    """The styles of one model, by module name, and the head counts to divide."""

    styles: dict[str, str] = field(default_factory=dict)
    """Module name -> "colwise" / "rowwise" / "sequence_parallel"."""
    head_owners: list[str] = field(default_factory=list)
    """Modules with colwise children: their head-count attributes are divided by tp."""


def _is_conv1d(module: nn.Module) -> bool:
    # Hugging Face's transformers.pytorch_utils.Conv1D, recognised without importing it.
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def auto_plan(model: nn.Module, block_names: Iterable[str], *, sequence_parallel: bool) -> TPPlan:
    """The automatic plan for the blocks named `block_names` (see the module docstring).

    Args:
        model: the model (full, or one pipeline stage of it).
        block_names: names of the model's blocks, in order.
        sequence_parallel: also shard each block's direct norm children along the sequence.
    Returns:
        The plan (empty when no layout was recognised).

    Example::

        auto_plan(gpt, [f"blocks.{i}" for i in range(4)], sequence_parallel=False).styles
        # {"blocks.0.attn.q_proj": "colwise", ..., "blocks.0.mlp.down_proj": "rowwise", ...}
    """
    plan = TPPlan()
    for block_name in block_names:
        block = model.get_submodule(block_name)
        colwise_parents: dict[str, list[str]] = {}
        rowwise: list[str] = []
        for sub, module in block.named_modules():
            if not sub:
                continue
            leaf = sub.rpartition(".")[2]
            full = f"{block_name}.{sub}"
            if not isinstance(module, nn.Linear) and not _is_conv1d(module):
                continue
            if leaf in COLWISE_NAMES:
                colwise_parents.setdefault(_parent(full), []).append(full)
            elif leaf in ROWWISE_NAMES:
                rowwise.append(full)
        for parent, names in colwise_parents.items():
            plan.head_owners.append(parent)
            plan.styles.update(dict.fromkeys(names, "colwise"))
        for name in rowwise:
            if _parent(name) in colwise_parents:
                plan.styles[name] = "rowwise"
        if sequence_parallel:
            for child_name, child in block.named_children():
                if type(child).__name__.endswith("Norm"):
                    plan.styles[f"{block_name}.{child_name}"] = "sequence_parallel"
    return plan


def user_plan(model: nn.Module, patterns: dict[str, str]) -> TPPlan:
    """The plan from `tensor_parallel.plan` (module-name glob -> style name).

    Raises:
        ValueError: a pattern matches no module of `model`.

    Example::

        user_plan(model, {"layers.*.mlp.fc1": "colwise", "layers.*.mlp.fc2": "rowwise"})
    """
    names = [n for n, _ in model.named_modules() if n]
    plan = TPPlan()
    for pattern, style in patterns.items():
        matched = fnmatch.filter(names, pattern)
        if not matched:
            raise ValueError(
                f"tensor_parallel.plan pattern {pattern!r} matches no module of "
                f"{type(model).__name__}; module names look like {names[:6]}"
            )
        plan.styles.update(dict.fromkeys(matched, style))
    owners = {_parent(n) for n, s in plan.styles.items() if s == "colwise"}
    plan.head_owners = sorted(owners)
    return plan


class Conv1DColwise(ColwiseParallel):
    """ColwiseParallel for Hugging Face Conv1D, whose weight is (in, out): shard dim 1."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                dim = 1 if pname == "weight" else 0
                dist = distribute_tensor(param, mesh, [Shard(dim)])
                mod.register_parameter(pname, nn.Parameter(dist, param.requires_grad))

        return distribute_module(
            module,
            device_mesh,
            partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class Conv1DRowwise(RowwiseParallel):
    """RowwiseParallel for Hugging Face Conv1D: weight (in, out) sharded on dim 0."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                placement = Shard(0) if pname == "weight" else Replicate()
                dist = distribute_tensor(param, mesh, [placement])
                mod.register_parameter(pname, nn.Parameter(dist, param.requires_grad))

        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


def torch_style(style: str, module: nn.Module, *, sequence_parallel: bool) -> ParallelStyle:
    """The torch ParallelStyle for one planned module.

    Under sequence parallelism a rowwise output is reduce-scattered to sequence shards
    (Shard(1)) instead of all-reduced, and norms take sequence-sharded inputs.
    """
    out = Shard(1) if sequence_parallel else Replicate()
    conv = _is_conv1d(module)
    if style == "colwise":
        return Conv1DColwise() if conv else ColwiseParallel()
    if style == "rowwise":
        return Conv1DRowwise(output_layouts=out) if conv else RowwiseParallel(output_layouts=out)
    if style == "sequence_parallel":
        return SequenceParallel()
    if style == "colwise_logits":
        # Loss parallel: logits stay sharded over the vocabulary, as a DTensor.
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    raise ValueError(f"unknown tensor-parallel style {style!r}")


def gather_sequence_input() -> ParallelStyle:
    """For a module whose colwise projections need the whole sequence under SP."""
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))


def fused_qkv_modules(model: nn.Module) -> list[str]:
    """Names of fused q/k/v projections (left replicated by the automatic plan)."""
    return [n for n, _ in model.named_modules() if n.rpartition(".")[2] in FUSED_QKV_NAMES]


HEAD_NAMES = ("lm_head", "output", "head", "embed_out")


def find_output_head(model: nn.Module, block_names: Iterable[str]) -> str:
    """The output projection (a Linear named lm_head / output / head / embed_out outside
    the blocks), split over the vocabulary for loss parallelism.

    Raises:
        ValueError: no such module.
    """
    blocks = tuple(f"{b}." for b in block_names)
    for name, module in model.named_modules():
        if (
            name.rpartition(".")[2] in HEAD_NAMES
            and isinstance(module, nn.Linear)
            and not name.startswith(blocks)
        ):
            return name
    raise ValueError(
        f"tensor_parallel.loss_parallel needs the output projection: an nn.Linear named one "
        f"of {', '.join(HEAD_NAMES)} outside the blocks; none in {type(model).__name__}"
    )
