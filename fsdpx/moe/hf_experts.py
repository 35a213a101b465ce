"""Automatic expert parallelism for Hugging Face MoE models (transformers' fused experts).

transformers 5 stores the experts of Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and their
relatives fused: one module with 3-D `gate_up_proj` [E, 2 * ffn, hidden] and `down_proj`
[E, hidden, ffn] parameters, called by the MoE block as `experts(hidden_states,
top_k_index, top_k_weights)` after the block's own router. Under mesh.ep > 1, fsdpx.shard
finds every such module (by that structure, not by class name), splits both parameters
`Shard(0)` over mesh.ep, and swaps the module's class for a subclass whose forward sends
each token's rows to its experts' ranks (fsdpx/moe/dispatch.py) instead of looping over
all experts. Router, shared experts and the rest of the block are untouched, and the
parameter names stay the model's, so `from_pretrained` files and checkpoints still match.

[Note: fused layouts fsdpx runs] The experts' `_apply_gate` (transformers' hook for the
gate activation) is honoured: transformers' default (act_fn on the gate half times the up
half) runs as one fused gated node over the local experts (fsdpx/moe/grouped_mlp.py),
any other as a per-expert loop calling it; layouts transformers marks as transposed, interleaved,
biased, gate-less or with a post-expert norm (GPT-OSS and others) are refused with an
error rather than computed wrongly. A model whose experts are neither fsdpx.moe.MoE nor
this fused layout gets the error of check_expert_parallel (fsdpx/moe/parallel.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fsdpx.moe.dispatch import moe_dispatch
from fsdpx.moe.experts import scale_grad
from fsdpx.moe.grouped_mlp import as_module, gated_mlp

FUSED = ("gate_up_proj", "down_proj")
# transformers' layout flags (use_experts_implementation) and the value fsdpx computes.
_LAYOUT = {
    "is_transposed": False,
    "is_concatenated": True,
    "has_bias": False,
    "has_gate": True,
    "has_post_expert_norm": False,
}


def fused_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module holding 3-D `gate_up_proj` and `down_proj` parameters, with its name."""
    found = []
    for name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if all(n in params and params[n].ndim == 3 for n in FUSED):
            found.append((name, module))
    return found


def check_fused(name: str, module: nn.Module, ep: int) -> None:
    """Refuse a fused layout fsdpx does not compute, or experts not divisible by ep."""
    for flag, wanted in _LAYOUT.items():
        if getattr(module, flag, wanted) != wanted:
            raise ValueError(
                f"experts {name!r} ({type(module).__name__}) have {flag}={not wanted}; "
                f"fsdpx's expert parallelism computes the layout with {flag}={wanted} "
                "(Mixtral / Qwen-MoE / DeepSeek-V3). Set mesh.ep to 1 for this model"
            )
    extra = sorted(set(dict(module.named_parameters()).keys()) - set(FUSED))
    if extra:
        raise ValueError(
            f"experts {name!r} ({type(module).__name__}) hold parameters {extra} besides "
            f"{list(FUSED)}; fsdpx's expert parallelism knows only those two. Set mesh.ep to 1"
        )
    experts = module.get_parameter("gate_up_proj").shape[0]
    if experts % ep != 0:
        raise ValueError(
            f"experts {name!r} number {experts}, not divisible by mesh.ep ({ep}); choose an "
            "ep that divides the number of experts"
        )


def enable_fused_ep(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Split the fused parameters over ep_mesh and switch the module to the EP forward."""
    for pname in FUSED:
        p = module.get_parameter(pname)
        # Every rank holds rank 0's values already: cut the local block, no scatter.
        sharded = distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None)
        setattr(module, pname, nn.Parameter(sharded, requires_grad=p.requires_grad))
    module._fsdpx_ep_group = ep_mesh.get_group()  # type: ignore[assignment]
    # [Note: expert gradient scale] in fsdpx/moe/parallel.py.
    module._fsdpx_grad_scale = 1.0 / ep_mesh.size()  # type: ignore[assignment]
    module.__class__ = _ep_class(type(module))


_EP_CLASSES: dict[type, type] = {}


def _ep_class(cls: type) -> type:
    if cls not in _EP_CLASSES:
        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (cls,), {"forward": _ep_forward})
    return _EP_CLASSES[cls]


def _ep_forward(
    self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """transformers' experts forward, with the tokens dispatched to their experts' ranks."""
    num_experts = self.get_parameter("gate_up_proj").shape[0]  # the global count
    tokens, k = top_k_index.shape
    token = torch.arange(tokens, device=hidden_states.device).repeat_interleave(k)
    expert = top_k_index.reshape(-1)
    weight = top_k_weights.reshape(-1)
    # transformers marks a masked route with the index num_experts: no expert runs it.
    keep = expert < num_experts
    if not bool(keep.all()):
        token, expert, weight = token[keep], expert[keep], weight[keep]

    def run(rows: Tensor, counts: list[int]) -> Tensor:
        return _fused_compute(self, rows, counts)

    return moe_dispatch(
        hidden_states,
        token,
        expert,
        weight,
        num_experts=num_experts,
        experts=run,
        ep_group=self._fsdpx_ep_group,  # type: ignore[arg-type]
    )


def _local(module: nn.Module, name: str) -> Tensor:
    p = module.get_parameter(name)
    local = p.to_local() if isinstance(p, DTensor) else p
    return scale_grad(local, float(module._fsdpx_grad_scale))  # type: ignore[arg-type]


def _apply_gate(module: Any, gate_up_out: Tensor) -> Tensor:
    apply = getattr(module, "_apply_gate", None)
    if apply is not None:
        return apply(gate_up_out)
    gate, up = gate_up_out.chunk(2, dim=-1)  # transformers' default, for undecorated classes
    return module.act_fn(gate) * up


def _default_gate(module: Any) -> bool:
    """Whether the module's gate is transformers' default, act_fn(gate) * up on the halves
    of gate_up's output (then fsdpx's fused gated node computes it)."""
    apply = getattr(type(module), "_apply_gate", None)
    default = apply is None or getattr(apply, "__name__", "") == "_default_apply_gate"
    return default and callable(getattr(module, "act_fn", None))


def _fused_compute(module: Any, rows: Tensor, counts: list[int]) -> Tensor:
    """Local expert j on the next counts[j] rows: down(apply_gate(gate_up(x))): one fused
    gated node for transformers' default gate (fsdpx/moe/grouped_mlp.py), else a loop."""
    gate_up, down = _local(module, "gate_up_proj"), _local(module, "down_proj")
    if _default_gate(module):
        out = gated_mlp(rows, gate_up, down, counts, as_module(module.act_fn))
        # Both parameters stay in the graph on a rank without rows ([Note: no hang in
        # all_to_all]: FSDP's reduce-scatter waits for every rank of the group).
        return out if sum(counts) else out + (gate_up.sum() + down.sum()) * 0.0
    outs = []
    start = 0
    for j, n in enumerate(counts):
        if n == 0:
            continue
        h = F.linear(rows[start : start + n], gate_up[j])
        outs.append(F.linear(_apply_gate(module, h), down[j]))
        start += n
    if not outs:
        # No rows here: keep both parameters in the graph (FSDP's reduce-scatter waits
        # for every rank of the group; [Note: no hang in all_to_all]).
        return rows + (gate_up.sum() + down.sum()) * 0.0
    return torch.cat(outs)
