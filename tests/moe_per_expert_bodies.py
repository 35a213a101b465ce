"""Tiny Mixtral / Qwen-MoE models whose MoE blocks keep one module per expert, written as
the hub's remote code and transformers 4 write them (`experts.N.w1 / w2 / w3` with a Linear
router; `experts.N.gate_proj / up_proj / down_proj` with `norm_topk_prob` and a gated shared
expert), in the decoder of transformers' own tiny models (tests/moe_hf_bodies.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

D, FFN, E, TOP_K = 16, 12, 4, 2


class Top2MLP(nn.Module):
    """Mixtral's MixtralBlockSparseTop2MLP (w1: gate, w3: up, w2: down)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(D, FFN, bias=False)
        self.w2 = nn.Linear(FFN, D, bias=False)
        self.w3 = nn.Linear(D, FFN, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class QwenMLP(nn.Module):
    """Qwen2MoeMLP (gate_proj, up_proj, down_proj; act_fn a function, as ACT2FN gives)."""

    def __init__(self, ffn: int = FFN) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(D, ffn, bias=False)
        self.up_proj = nn.Linear(D, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, D, bias=False)
        self.act_fn = F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class PerExpertBlock(nn.Module):
    """transformers 4's MixtralSparseMoeBlock / Qwen2MoeSparseMoeBlock loop over experts;
    returns the hidden states alone (the decoder layer of transformers 5 takes that) or,
    with `tuple_out`, (hidden states, router logits) as transformers 4's blocks did."""

    def __init__(self, qwen: bool, tuple_out: bool = False) -> None:
        super().__init__()
        self.top_k = TOP_K
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList([QwenMLP() if qwen else Top2MLP() for _ in range(E)])
        if qwen:
            self.norm_topk_prob = False  # Qwen2-MoE's default: weights not renormalised
            self.shared_expert = QwenMLP(ffn=8)
            self.shared_expert_gate = nn.Linear(D, 1, bias=False)
        self.qwen, self.tuple_out = qwen, tuple_out

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        batch, seq, dim = hidden_states.shape
        x = hidden_states.view(-1, dim)
        router_logits = self.gate(x)
        weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        weights, selected = torch.topk(weights, self.top_k, dim=-1)
        if not self.qwen or self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        final = torch.zeros_like(x)
        mask = F.one_hot(selected, num_classes=E).permute(2, 1, 0)
        for e in range(E):
            idx, top_x = torch.where(mask[e])
            out = self.experts[e](x[None, top_x].reshape(-1, dim)) * weights[top_x, idx, None]
            final.index_add_(0, top_x, out.to(x.dtype))
        if self.qwen:
            shared = self.shared_expert(x)
            final = final + torch.sigmoid(self.shared_expert_gate(x)) * shared
        final = final.reshape(batch, seq, dim)
        return (final, router_logits) if self.tuple_out else final


def per_expert_model(base: nn.Module, qwen: bool) -> nn.Module:
    """`base` (a tiny transformers MoE model, hidden D) with every MoE block replaced by
    a PerExpertBlock, all parameters drawn from a fixed generator."""
    for layer in base.model.layers:  # type: ignore[union-attr]
        layer.mlp = PerExpertBlock(qwen)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return base.float()


def ckpt_body(
    rank: int,
    world_size: int,
    kind: str,
    save_cfg: dict[str, Any],
    load_cfg: dict[str, Any],
    root: str,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One AdamW step of the per-expert model `kind` under save_cfg, saved; a fresh engine
    under load_cfg (after a step of its own, so its optimizer state exists) loads it.
    Both engines' parameters and Adam moments, gathered, by name."""
    import fsdpx
    from tests import moe_hf_bodies as hb
    from tests.moe_bodies import _state

    base = {"optimizer": {"type": "adamw", "lr": hb.LR, "weight_decay": 0.0}}
    engines = []
    for cfg in (save_cfg, load_cfg):
        engine = fsdpx.shard(hb.make_model(kind), fsdpx.Config.from_dict({**base, **cfg}))
        ids = hb.batches(world_size)[0][rank]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        engines.append(engine)
    engines[0].save_checkpoint(root)
    saved = _state(engines[0])
    engines[1].load_checkpoint(root)
    loaded = _state(engines[1])
    torch.distributed.barrier()
    return saved, loaded
