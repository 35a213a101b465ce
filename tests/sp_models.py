"""A tiny Llama-style native model for the sequence-parallel tests: RoPE from position_ids,
grouped-query attention through SDPA's enable_gqa, a SwiGLU `mlp` per block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q_proj = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


def _rope(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = t.shape[-1] // 2
    rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
    return t * cos[:, None] + rotated * sin[:, None]


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, 2 * dim, bias=False)
        self.up_proj = nn.Linear(dim, 2 * dim, bias=False)
        self.down_proj = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(dim)
        self.attn = Attention(dim, heads, kv_heads)
        self.norm2 = nn.RMSNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class TinyLlama(nn.Module):
    """forward(input_ids, position_ids=None) -> logits. A pipeline stage of it (embed,
    norm or lm_head None: fsdpx/pipeline_split.py) takes and returns hidden states."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(2))
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.head_dim = dim // heads

    def forward(self, input_ids: Tensor, *, position_ids: Tensor | None = None) -> Tensor:
        x = self.hidden(input_ids, position_ids=position_ids)
        return x if self.lm_head is None else self.lm_head(x)

    def hidden(self, input_ids: Tensor, *, position_ids: Tensor | None = None) -> Tensor:
        """The final hidden states (after the last norm), for a tiled loss."""
        if position_ids is None:
            batch, seq = input_ids.shape[:2]
            position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
        half = torch.arange(0, self.head_dim, 2, device=position_ids.device).float()
        inv = 1.0 / (10000 ** (half / self.head_dim))
        angles = position_ids[..., None].float() * inv
        angles = torch.cat([angles, angles], dim=-1)  # (batch, seq, head_dim)
        cos, sin = angles.cos(), angles.sin()
        # On a later pipeline stage the input is the previous stage's hidden states.
        x = input_ids if self.embed is None else self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        return x if self.norm is None else self.norm(x)
