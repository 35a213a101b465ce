"""Automatic expert parallelism for Hugging Face MoE blocks with one module per expert.

Older transformers versions and many hub checkpoints (remote code) store the experts of
Mixtral and Qwen2/3-MoE as an nn.ModuleList of gated MLPs, `experts.N.w1 / w2 / w3`
(Mixtral: gate, down, up) or `experts.N.gate_proj / up_proj / down_proj` (Qwen-MoE), next
to a Linear router `gate`, `top_k`, and for Qwen `norm_topk_prob` and an optional
`shared_expert` with a sigmoid `shared_expert_gate`. Under mesh.ep > 1 fsdpx.shard finds
such blocks by that structure and replaces the block's per-expert loop with fsdpx's
routing (the families' own rule: softmax over the router's logits in fp32, top-k, the
weights renormalised for Mixtral and where `norm_topk_prob` is set) and the all_to_all
dispatch (fsdpx/moe/dispatch.py).

[Note: per-expert names under expert parallelism] The parameter names stay the model's
(`...experts.3.w1.weight`, shape [ffn, hidden]), so hub files and fsdpx checkpoints load
by name, and every rank holds every name: each expert's weights are DTensors `Shard(0)`
over mesh.ep (each ep rank keeps 1 / ep of every expert's rows at rest, the memory of
expert parallelism) and FSDP shards them further over the expert-data-parallel ranks.
For the expert compute, a rank gathers the full weights of only its own E / ep experts
with one all_to_all per weight kind (each rank sends the rows it holds of expert N to N's
owner), computes its experts on the tokens dispatched to it, and the reverse all_to_all
returns each weight-row gradient to the rank that holds it. That is one more exchange than
the stacked and fused layouts (per layer and step, each rank receives (ep - 1) / ep of
its E / ep experts' weights, and sends as many gradient bytes back) in exchange for
unchanged names; checkpoints reshard across ep sizes like any DTensor (pieces of [ffn,
hidden] per expert). Expert weights whose rows ep does not divide are split unevenly
(torch.chunk's rule, as DTensor does).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fsdpx.moe.dispatch import _all_to_all, moe_dispatch
from fsdpx.moe.experts import scale_grad
from fsdpx.moe.grouped_mlp import as_module, gated_mlp

# (gate, up, down) Linear names of one expert, per naming family.
NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


def _expert_names(expert: nn.Module) -> tuple[str, str, str] | None:
    children = dict(expert.named_children())
    for names in NAMES:
        if all(isinstance(children.get(n), nn.Linear) for n in names):
            return names
    return None


def per_expert_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every block with a Linear `gate`, an nn.ModuleList `experts` of gated MLPs named as
    in NAMES, and `top_k`: the per-expert layout (module docstring)."""
    found = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        gate = getattr(module, "gate", None)
        if (
            isinstance(experts, nn.ModuleList)
            and len(experts) >= 2
            and isinstance(gate, nn.Linear)
            and isinstance(getattr(module, "top_k", None), int)
            and _expert_names(experts[0]) is not None
        ):
            found.append((name, module))
    return found


def check_per_expert(name: str, block: nn.Module, ep: int) -> None:
    """Refuse a per-expert block fsdpx would compute wrongly, or experts not divisible by ep."""
    experts = block.get_submodule("experts")
    assert isinstance(experts, nn.ModuleList)
    names = _expert_names(experts[0])
    for j, expert in enumerate(experts):
        if _expert_names(expert) != names or not hasattr(expert, "act_fn"):
            raise ValueError(
                f"{name}.experts.{j} ({type(expert).__name__}) is not a gated MLP like "
                f"expert 0 (Linear {names} and act_fn); fsdpx's expert parallelism for "
                "per-expert layouts computes down(act_fn(gate(x)) * up(x)). Set mesh.ep to 1 "
                "or describe the block in moe.plan"
            )
        extra = sorted(
            n for n, _ in expert.named_parameters() if n.split(".")[0] not in (names or ())
        )
        biased = [n for n in (names or ()) if expert.get_submodule(n).bias is not None]
        if extra or biased:
            raise ValueError(
                f"{name}.experts.{j} has parameters fsdpx's expert parallelism does not "
                f"compute ({extra + [f'{n}.bias' for n in biased]}); it knows bias-free "
                f"{list(names or ())} only. Set mesh.ep to 1"
            )
    gate = block.get_submodule("gate")
    assert isinstance(gate, nn.Linear)
    if gate.out_features != len(experts) or gate.bias is not None:
        raise ValueError(
            f"{name}.gate must be a bias-free Linear with one output per expert "
            f"({len(experts)}); got {gate}. Set mesh.ep to 1"
        )
    if getattr(block, "jitter_noise", 0):
        raise ValueError(
            f"{name} multiplies its inputs by router jitter noise "
            f"({block.jitter_noise}) in training; fsdpx's routing for per-expert blocks "
            "does not, so set the model's router_jitter_noise to 0 or mesh.ep to 1"
        )
    if block.top_k > len(experts):  # type: ignore[operator]
        raise ValueError(f"{name}: top_k ({block.top_k}) exceeds the {len(experts)} experts")
    if len(experts) % ep != 0:
        raise ValueError(
            f"experts of {name!r} number {len(experts)}, not divisible by mesh.ep ({ep}); "
            "choose an ep that divides the number of experts"
        )


def enable_per_expert_ep(block: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Split every expert weight Shard(0) over ep_mesh (names kept) and switch the block
    to the dispatching forward."""
    block._fsdpx_returns_tuple = _returns_tuple(block)  # type: ignore[assignment]
    experts = block.get_submodule("experts")
    assert isinstance(experts, nn.ModuleList)
    for expert in experts:
        for lname in _expert_names(expert) or ():
            linear = expert.get_submodule(lname)
            p = linear.get_parameter("weight")
            # Every rank holds rank 0's values already: cut the local rows, no scatter.
            sharded = distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None)
            linear.weight = nn.Parameter(sharded, requires_grad=p.requires_grad)
    block._fsdpx_ep_group = ep_mesh.get_group()  # type: ignore[assignment]
    experts._fsdpx_ep_group = ep_mesh.get_group()  # type: ignore[assignment]
    # [Note: expert gradient scale] in fsdpx/moe/parallel.py.
    experts._fsdpx_grad_scale = 1.0 / ep_mesh.size()  # type: ignore[assignment]
    # A forward of its own, so the FSDP unit over the expert-data-parallel ranks (the
    # list: fsdpx/moe/parallel.py shard_experts) gathers and reduces around the compute.
    experts.__class__ = _ExpertList
    block.__class__ = _ep_class(type(block))


def _returns_tuple(block: nn.Module) -> bool:
    """Whether the block returns (hidden_states, router_logits), as transformers 4's
    Mixtral / Qwen-MoE blocks do, or the hidden states alone (transformers 5's): its own
    forward on zero tokens, before any weight is split (no collective, equal on every rank)."""
    w = block.get_parameter("gate.weight")
    with torch.no_grad():
        out = block(torch.zeros(1, 0, w.shape[1], device=w.device, dtype=w.dtype))
    return isinstance(out, tuple)


_EP_CLASSES: dict[type, type] = {}


def _ep_class(cls: type) -> type:
    if cls not in _EP_CLASSES:
        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (cls,), {"forward": _ep_forward})
    return _EP_CLASSES[cls]


def _ep_forward(self: nn.Module, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
    """The block's routing (module docstring), the dispatch, the shared expert."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    experts = self.get_submodule("experts")
    num_experts = len(experts)  # type: ignore[arg-type]
    logits = self.get_submodule("gate")(x)
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    weight, expert = torch.topk(probs, int(self.top_k), dim=-1)  # type: ignore[arg-type]
    if getattr(self, "norm_topk_prob", True):  # Mixtral always renormalises
        weight = weight / weight.sum(dim=-1, keepdim=True)
    weight = weight.to(x.dtype)
    token = torch.arange(x.shape[0], device=x.device).repeat_interleave(int(self.top_k))  # type: ignore[arg-type]

    out = moe_dispatch(
        x,
        token,
        expert.reshape(-1),
        weight.reshape(-1),
        num_experts=num_experts,
        experts=experts,
        ep_group=self._fsdpx_ep_group,  # type: ignore[arg-type]
    )
    shared = getattr(self, "shared_expert", None)
    if shared is not None:
        gate = getattr(self, "shared_expert_gate", None)
        s = shared(x)
        out = out + (torch.sigmoid(gate(x)) * s if gate is not None else s)
    out = out.reshape(shape)
    return (out, logits) if self._fsdpx_returns_tuple else out


class _ExpertList(nn.ModuleList):
    """The experts ModuleList (names unchanged) with a forward: this rank's experts on
    their rows, full weights gathered (module docstring), then one fused gated MLP over
    them (fsdpx/moe/grouped_mlp.py)."""

    def forward(self, rows: Tensor, counts: list[int]) -> Tensor:
        g, u, d = _expert_names(self[0])  # type: ignore[misc]
        group: dist.ProcessGroup = self._fsdpx_ep_group  # type: ignore[assignment]
        scale = float(self._fsdpx_grad_scale)  # type: ignore[arg-type]
        gate = _gather_owned([e.get_parameter(f"{g}.weight") for e in self], group, scale)
        up = _gather_owned([e.get_parameter(f"{u}.weight") for e in self], group, scale)
        down = _gather_owned([e.get_parameter(f"{d}.weight") for e in self], group, scale)
        act = as_module(getattr(self[0], "act_fn"))  # noqa: B009
        out = gated_mlp(rows, torch.cat([gate, up], dim=1), down, counts, act)
        # Keep every gathered weight in the graph on every rank: the reverse all_to_all of
        # their gradients is a collective ([Note: no hang in all_to_all] in dispatch.py).
        return out + (gate.sum() + up.sum() + down.sum()) * 0.0


def _gather_owned(weights: list[Tensor], group: dist.ProcessGroup, scale: float) -> Tensor:
    """The full weights [E / ep, rows, cols] of this rank's experts, from every rank's
    Shard(0) rows of all E experts' weights (each a DTensor over ep)."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    num = len(weights)
    local = num // ep
    rows = weights[0].shape[0]  # global rows of one expert's weight
    sizes = [len(c) for c in torch.arange(rows).chunk(ep)]
    sizes += [0] * (ep - len(sizes))
    mine = torch.stack(
        [w.to_local() if isinstance(w, DTensor) else w for w in weights]
    )  # [E, sizes[rank], cols]
    mine = scale_grad(mine, scale)
    cols = mine.shape[-1]
    send = [local * sizes[rank]] * ep  # to rank r: its experts' rows I hold
    recv = [local * s for s in sizes]  # from rank q: my experts' rows q holds
    got = _all_to_all(mine.reshape(-1, cols), recv, send, group)
    blocks = got.split(recv)
    return torch.cat([b.view(local, sizes[q], cols) for q, b in enumerate(blocks)], dim=1)
