"""Ring attention for Hugging Face `transformers` models, through their attention registry
(fsdpx/hf/ulysses.py's patch_hf_attention registers it under context_parallel.mode "ring").

[Note: Hugging Face attention under ring] Unlike Ulysses, which exchanges q/k/v around the
model's own implementation, the ring replaces the kernel: the registered function computes
attention blockwise itself (fsdpx/sequence/ring.py), whatever `_attn_implementation` the
model was loaded with, on the tokens fsdpx.sequence.shard_batch gave this rank in the
load-balanced layout. So what only the model's kernel could do is refused by name rather
than dropped: an attention mask, attention dropout, soft-capping, a sliding window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from fsdpx.sequence.ring import ring_attention


def ring_hf_attention(group: dist.ProcessGroup) -> Callable[..., tuple[Tensor, None]]:
    """A transformers attention function (AttentionInterface's signature) running ring
    attention over `group` ([Note: Hugging Face attention under ring])."""

    def attention(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        if attention_mask is not None:
            raise ValueError(
                "a Hugging Face attention layer got an attention mask under ring attention "
                "(context_parallel.mode 'ring'); pass batches through "
                "fsdpx.sequence.shard_batch, which drops all-ones masks and refuses padding "
                "masks (use -100 labels)"
            )
        unsupported = {
            name: kwargs[name]
            for name in ("softcap", "sliding_window")
            if kwargs.get(name) is not None
        }
        if dropout != 0.0:
            unsupported["dropout"] = dropout
        if unsupported:
            raise ValueError(
                f"ring attention (context_parallel.mode 'ring') computes plain softmax "
                f"attention blockwise; this model's attention asks for {unsupported}. Use "
                "context_parallel.mode 'ulysses' (it runs the model's own kernel), or turn "
                "these off (attention_dropout 0 for training)"
            )
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        out = ring_attention(query, key, value, group, is_causal=bool(causal), scale=scaling)
        # Hugging Face returns (batch, seq, heads, head_dim).
        return out.transpose(1, 2).contiguous(), None

    return attention
