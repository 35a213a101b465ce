"""`moe.plan`: expert parallelism for mixture-of-experts blocks fsdpx does not recognise.

fsdpx finds `fsdpx.moe.MoE` layers and transformers' fused experts by structure
(fsdpx/moe/parallel.py, fsdpx/moe/hf_experts.py). Any other MoE block (a custom model, or a
layout with one module per expert) is described by a plan: a module-name glob -> the
block's router, experts and shared experts, and its routing rule::

    "moe": {"plan": {"layers.*.moe": {"router": "gate", "experts": "experts",
                                      "shared_experts": "shared", "top_k": 2}}}

For every block the glob matches, `apply_moe_plan`:

1. stacks the block's experts (an nn.ModuleList of one class) into `fsdpx.moe.Experts`,
   each expert's values kept (row j of each stacked tensor is expert j), in place of the
   ModuleList; parameter names change from `<experts>.<j>.<name>` to
   `<experts>.expert.<name>` of shape [num_experts, ...];
2. swaps the block's class for a subclass whose forward is fsdpx's: the router's logits
   (the block's own router module and weights), softmax or sigmoid scores, top-k, optional
   renormalisation, fsdpx's dispatch (all_to_all under mesh.ep) and the shared experts'
   output added; it returns the output, or (output, router_logits) when the plan says so.

[Note: planned blocks] The plan applies at every mesh.ep, 1 included, so a model has the
same parameter names whatever the ep size and its checkpoints reshard across ep sizes as
fsdpx.moe.MoE's do. The stacked names differ from the model's own per-expert names: a
checkpoint saved without the plan (or a `from_pretrained` file with per-expert names) does
not load into the planned model as it is. The block's own forward is not run: whatever it
computes besides routing, experts and shared experts (an auxiliary loss, a shared-expert
gate) is absent, so the plan is for blocks that are exactly that; its routing rule must be
the block's (the parity test compares the two). The block's inputs after the first
(attention masks and the like) are accepted and ignored.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from fsdpx.config import MoEPlanEntry
from fsdpx.moe.dispatch import moe_dispatch
from fsdpx.moe.experts import Experts
from fsdpx.moe.router import topk_routing


def apply_moe_plan(model: nn.Module, plan: dict[str, MoEPlanEntry] | None) -> int:
    """Convert every block `plan` matches (module docstring), in place; the number converted.

    Raises:
        ValueError: a glob that matches no module, a router / experts / shared_experts
            name the block lacks, experts that are not a ModuleList of one class of at
            least top_k modules, or a block matched by two globs.
    """
    if not plan:
        return 0
    modules = dict(model.named_modules())
    chosen: dict[str, tuple[str, MoEPlanEntry]] = {}
    for pattern, entry in plan.items():
        matched = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            sample = ", ".join(n for n in list(modules)[1:9])
            raise ValueError(
                f"moe.plan glob {pattern!r} matches no module of {type(model).__name__}; "
                f"module names look like: {sample}. Fix the glob (fnmatch, '*' spans dots)"
            )
        for name in matched:
            if name in chosen:
                raise ValueError(
                    f"module {name!r} is matched by moe.plan globs {chosen[name][0]!r} and "
                    f"{pattern!r}; make the globs match disjoint modules"
                )
            chosen[name] = (pattern, entry)
    for name, (_, entry) in chosen.items():
        _convert(name, modules[name], entry)
    return len(chosen)


def planned_blocks(model: nn.Module) -> Iterator[tuple[str, nn.Module, Experts]]:
    """Every block converted by a plan, with its name and its stacked experts."""
    for name, module in model.named_modules():
        entry = getattr(module, "_fsdpx_plan", None)
        if isinstance(entry, MoEPlanEntry):
            experts = module.get_submodule(entry.experts)
            assert isinstance(experts, Experts)
            yield name, module, experts


def _convert(name: str, block: nn.Module, entry: MoEPlanEntry) -> None:
    children = dict(block.named_modules())
    for role in ("router", "experts", "shared_experts"):
        target = getattr(entry, role)
        if target and target not in children:
            raise ValueError(
                f"moe.plan: block {name!r} ({type(block).__name__}) has no submodule "
                f"{target!r} for {role}; its submodules: {', '.join(n for n in children if n)}"
            )
    experts = block.get_submodule(entry.experts)
    if not isinstance(experts, nn.ModuleList) or len(experts) < 2:
        raise ValueError(
            f"moe.plan: {name}.{entry.experts} must be an nn.ModuleList of 2 or more expert "
            f"modules; got {type(experts).__name__}"
            + (f" of {len(experts)}" if isinstance(experts, nn.ModuleList) else "")
        )
    if entry.top_k > len(experts):
        raise ValueError(
            f"moe.plan: top_k ({entry.top_k}) exceeds the {len(experts)} experts of {name!r}"
        )
    try:
        stacked = Experts.from_modules(list(experts))
    except ValueError as exc:
        raise ValueError(f"moe.plan: {name}.{entry.experts}: {exc}") from None
    owner_name, _, leaf = entry.experts.rpartition(".")
    owner = block.get_submodule(owner_name) if owner_name else block
    setattr(owner, leaf, stacked)
    block._fsdpx_plan = entry  # type: ignore[assignment]
    block._fsdpx_ep_group = None  # type: ignore[assignment]  # set by expert parallelism
    block.__class__ = _planned_class(type(block))


_PLANNED: dict[type, type] = {}


def _planned_class(cls: type) -> type:
    if cls not in _PLANNED:
        _PLANNED[cls] = type(f"Planned{cls.__name__}", (cls,), {"forward": _planned_forward})
    return _PLANNED[cls]


def _planned_forward(self: nn.Module, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
    """Router -> top-k -> dispatch (+ shared experts), per the block's plan entry."""
    entry: MoEPlanEntry = self._fsdpx_plan  # type: ignore[assignment]
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    logits = self.get_submodule(entry.router)(x)
    if isinstance(logits, tuple):  # routers that return (logits, ...)
        logits = logits[0]
    routing = topk_routing(
        logits.float(),
        k=entry.top_k,
        score_func=entry.score_func,
        normalize_weights=entry.normalize_weights,
        z_loss_coef=0.0,
        used_token=None,
    )
    experts = self.get_submodule(entry.experts)
    assert isinstance(experts, Experts)
    out = moe_dispatch(
        x,
        routing.token,
        routing.expert,
        routing.weight,
        num_experts=experts.num_experts,
        experts=experts,
        ep_group=self._fsdpx_ep_group,  # type: ignore[arg-type]
    )
    if entry.shared_experts:
        out = out + self.get_submodule(entry.shared_experts)(x)
    out = out.reshape(shape)
    return (out, logits) if entry.return_router_logits else out
