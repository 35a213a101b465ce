"""Parameter groups (and a DeepSpeed script's optimizer instance) carried across sharding.

[Note: parameters across sharding]
FSDP2's `fully_shard` (and tensor parallelism) replace every parameter of the model with
a new DTensor parameter. Whatever a script built *before* `initialize` — the
`model_parameters` list, parameter groups with their own weight decay, an optimizer
instance, a scheduler wrapping that optimizer — refers to the old tensors. DeepSpeed
accepts them because its ZeRO optimizer wraps the client optimizer and flattens the very
tensors it was given. Here they are carried by *name*: before sharding each given tensor
is named by the model's `named_parameters()`; after sharding the names find the new
parameters. An optimizer instance keeps its identity (the script's variable, and a
scheduler that wraps it, stay valid): only the tensors in its `param_groups` are swapped,
which is sound only while it holds no state, so one that has stepped is refused. Under
pipeline parallelism a rank holds its stages' parameters only, and names it does not hold
are dropped from its groups. A parameter the model reaches under several names (a tied
embedding) is carried by all of them: the pipeline split gives each stage that uses it a
copy under one of those names ([Note: tied parameters across stages] in
fsdpx/pipeline_tied.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# Name parts added by wrappers (activation checkpointing, torch.compile) that the model the
# script built does not have.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod")


def plain_name(name: str) -> str:
    """`name` without the parts wrappers insert ("a._checkpoint_wrapped_module.w" -> "a.w")."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


@dataclass(frozen=True)
class NamedGroup:
    """One parameter group, its tensors named: `names` plus the group's own options."""

    names: tuple[str, ...]
    options: Mapping[str, Any]


def name_groups(model: nn.Module, model_parameters: Any) -> list[NamedGroup]:
    """Name the tensors of `model_parameters` (DeepSpeed's argument: None, an iterable of
    tensors, or an iterable of group dicts with "params") by `model`'s parameter names.

    Raises:
        ValueError: a tensor that is not a parameter of `model`, or a malformed group.
    """
    names = _aliases(model)
    if model_parameters is None:
        return [NamedGroup(tuple(n for p in model.parameters() for n in names[id(p)]), {})]
    if isinstance(model_parameters, torch.Tensor):
        raise ValueError(
            "model_parameters must be an iterable of tensors or of parameter-group dicts "
            "(as for a torch optimizer); got a single tensor: wrap it in a list"
        )
    items = list(model_parameters)
    if not items:
        raise ValueError("model_parameters is empty: pass model.parameters() or groups")
    if all(isinstance(item, Mapping) for item in items):
        groups = []
        for i, group in enumerate(items):
            if "params" not in group:
                raise ValueError(f"model_parameters[{i}] has no 'params' key: {sorted(group)}")
            options = {k: v for k, v in group.items() if k != "params"}
            groups.append(NamedGroup(_names_of(group["params"], names, f"[{i}]"), options))
        return groups
    if any(isinstance(item, Mapping) for item in items):
        raise ValueError("model_parameters mixes tensors and group dicts; use one or the other")
    return [NamedGroup(_names_of(items, names, ""), {})]


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter of `model`, by id (a shared one has several)."""
    out: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(plain_name(n))
    return out


def _names_of(params: Any, names: dict[int, list[str]], where: str) -> tuple[str, ...]:
    tensors = [params] if isinstance(params, torch.Tensor) else list(params)
    out = []
    for j, p in enumerate(tensors):
        if id(p) not in names:
            shape = tuple(p.shape) if isinstance(p, torch.Tensor) else None
            raise ValueError(
                f"model_parameters{where}[{j}] (shape {shape}) is not a parameter of the model "
                "passed to initialize: fsdpx shards the model's own parameters, so the "
                "optimizer can only hold those"
            )
        out.extend(names[id(p)])
    return tuple(out)


def optimizer_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[NamedGroup]:
    """Name the tensors of an optimizer built on `model`'s parameters before sharding."""
    if any(optimizer.state.values()):
        raise ValueError(
            f"the optimizer passed to initialize ({type(optimizer).__name__}) already holds "
            "state (it has stepped): its state belongs to tensors that sharding replaces. "
            "Pass a fresh optimizer, or a callable `params -> optimizer`"
        )
    names = _aliases(model)
    return [
        NamedGroup(
            _names_of(group["params"], names, f" (optimizer.param_groups[{i}])"),
            {k: v for k, v in group.items() if k != "params"},
        )
        for i, group in enumerate(optimizer.param_groups)
    ]


def resolve_groups(
    sharded: nn.Module, groups: list[NamedGroup], *, partial: bool
) -> list[dict[str, Any]]:
    """Groups of `sharded`'s parameters, found by name (groups left empty are dropped).

    Args:
        partial: the rank holds part of the model (pipeline stages): names it does not
            hold are dropped instead of raising.
    """
    by_name = {plain_name(n): p for n, p in sharded.named_parameters(remove_duplicate=False)}
    out = []
    for group in groups:
        missing = [n for n in group.names if n not in by_name]
        if missing and not partial:
            raise AssertionError(f"parameters lost in sharding: {missing[:5]}")
        # A shared parameter comes once, under whichever of its names this rank holds.
        found = {id(by_name[n]): by_name[n] for n in group.names if n in by_name}
        params = list(found.values())
        if params:
            out.append({**group.options, "params": params})
    return out


def rebind_optimizer_(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Swap the tensors in `optimizer.param_groups` for the sharded ones, in place."""
    optimizer.param_groups.clear()
    optimizer.state.clear()
    for group in groups:
        optimizer.add_param_group(dict(group))  # torch's checks (leaf tensors, no repeats)
