"""Ulysses for Hugging Face `transformers` models, through their attention registry
(fsdpx/sequence applies it to a model that `fsdpx.sequence.hf_model.is_hf_model` recognises;
it lives in fsdpx.hf, the only importer of transformers).

[Note: Hugging Face attention under Ulysses] transformers looks each layer's attention
function up by `config._attn_implementation` in `AttentionInterface` (sdpa, flash, flex, or a
registered name). Under mesh.sp fsdpx registers one more name,
`fsdpx_ulysses:<implementation>:<sp group>`, whose function exchanges q/k/v around the
model's own implementation (fsdpx/sequence/ulysses.py), and points the model's config at
it: no model code is copied or patched. The name carries the group because the registry
is transformers' process-wide table; registering the same name again is a no-op. The name
has no mask function in `AttentionMaskInterface`, so transformers builds no mask over the
local tokens and the implementation runs causal over the whole gathered sequence (padding
is -100 labels, never a mask: fsdpx.sequence.shard_batch enforces it). Hugging Face's
functions group kv heads by `module.num_key_value_groups`; with fewer kv heads than sp
([Note: GQA under Ulysses]) the call sees a view of the module with the grouping of the
heads it got.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from fsdpx.sequence.ulysses import check_heads, gather_sequence, scatter_sequence


class _GroupsView:
    """The attention module as the wrapped function sees it: its own attributes, except
    the kv grouping of the heads this rank holds."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _wrap(original: Callable[..., Any], group: dist.ProcessGroup) -> Callable[..., Any]:
    def attention(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        if attention_mask is not None:
            raise ValueError(
                "a Hugging Face attention layer got an attention mask under Ulysses sequence "
                "parallelism (mesh.sp > 1); pass batches through fsdpx.sequence.shard_batch, "
                "which drops all-ones masks and refuses padding masks (use -100 labels)"
            )
        q, k, v = gather_sequence(query, key, value, group)
        groups = q.shape[1] // k.shape[1]
        target: Any = module
        if getattr(module, "num_key_value_groups", groups) != groups:
            target = _GroupsView(module, groups)
        out, _ = original(target, q, k, v, None, **kwargs)
        # Hugging Face returns (batch, seq, heads, head_dim).
        return scatter_sequence(out, group, head_dim=2, seq_dim=1), None

    return attention


def patch_hf_attention(
    model: nn.Module, group: dist.ProcessGroup, *, tp: int = 1, ring: bool = False
) -> str:
    """Route `model`'s attention through Ulysses on `group` ([Note: Hugging Face attention
    under Ulysses]), or with `ring` through ring attention ([Note: Hugging Face attention
    under ring] in fsdpx/hf/ring.py); returns the registered implementation name.

    Raises:
        ValueError: Ulysses only: heads that sp (after tp) cannot split, or the "eager"
            implementation (not in transformers' registry: choose "sdpa").
    """
    from transformers import AttentionInterface

    config: Any = model.config
    impl: str = config._attn_implementation
    if impl.startswith(("fsdpx_ulysses:", "fsdpx_ring:")):
        return impl
    registry = AttentionInterface._global_mapping
    if ring:
        from fsdpx.hf.ring import ring_hf_attention

        name = f"fsdpx_ring:{group.group_name}"
        if name not in registry:
            AttentionInterface.register(name, ring_hf_attention(group))
    else:
        check_hf_heads(model, sp=dist.get_world_size(group), tp=tp)
        if impl not in registry:
            raise ValueError(
                f"the model's attention implementation {impl!r} is not in transformers' "
                "AttentionInterface, so fsdpx cannot wrap it for sequence parallelism; load "
                "the model with attn_implementation='sdpa' (or a flash / flex implementation)"
            )
        name = f"fsdpx_ulysses:{impl}:{group.group_name}"
        if name not in registry:
            original: Any = registry[impl]
            AttentionInterface.register(name, _wrap(original, group))
    set_impl: Callable[[str], None] = model.set_attn_implementation  # type: ignore[assignment]
    set_impl(name)
    return name


def check_hf_heads(model: nn.Module, *, sp: int, tp: int = 1) -> None:
    """check_heads on a Hugging Face model's config (heads per tensor-parallel rank)."""
    config: Any = model.config
    heads: int = config.num_attention_heads
    kv_heads: int = getattr(config, "num_key_value_heads", None) or heads
    check_heads(heads // tp, max(kv_heads // tp, 1), sp)
