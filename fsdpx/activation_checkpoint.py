"""Activation checkpointing of blocks, applied before sharding.

Uses the composable `checkpoint` (hooks on the block itself, no wrapper module), so
parameter names, and with them checkpoints and state dicts, stay the same.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fsdpx.config import ActivationCheckpointConfig

# Outputs worth keeping under selective checkpointing: the expensive ops. Everything else
# (norms, activations, adds) is recomputed in backward.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> Any:
    return create_selective_checkpoint_contexts(_save_matmuls)


def apply_activation_checkpointing(
    blocks: list[nn.Module], cfg: ActivationCheckpointConfig
) -> list[nn.Module]:
    """Checkpoint the blocks `cfg.mode` selects, in place; returns the checkpointed blocks.

    Example::

        apply_activation_checkpointing(list(gpt.blocks), ActivationCheckpointConfig("full"))
    """
    if cfg.mode == "none":
        return []
    chosen = blocks[:: cfg.every_n] if cfg.mode == "every_n" else list(blocks)
    apply: Callable[[nn.Module], Any] = checkpoint
    if cfg.mode == "selective":
        apply = partial(checkpoint, context_fn=_selective_context)
    for block in chosen:
        apply(block)
    return chosen
