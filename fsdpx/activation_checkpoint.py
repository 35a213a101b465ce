"""Activation checkpointing of blocks, applied before sharding.

Uses the composable `checkpoint` (hooks on the block itself, no wrapper module), so
parameter names, and with them checkpoints and state dicts, stay the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fsdpx.config import ActivationCheckpointConfig

# Outputs worth keeping under selective checkpointing: the expensive ops. Everything else
# (norms, activations, adds) is recomputed in backward. The policy sees ops after autograd,
# where nn.Linear is addmm/mm and SDPA is one backend kernel per device: CPU runs
# `_scaled_dot_product_flash_attention_for_cpu`, which a CUDA-only list misses (its
# attention would then be recomputed on CPU). Names absent from a torch build are skipped.
_SAVE_OP_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
)
_SAVE_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in _SAVE_OP_NAMES
    if hasattr(torch.ops.aten, name)
)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts(
    selective: bool,
    recompute_context: Callable[[], contextlib.AbstractContextManager[Any]] | None,
) -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
    """checkpoint's (forward, recompute) contexts: the selective policy's and/or ours."""
    forward: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    recompute: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if selective:
        forward, recompute = create_selective_checkpoint_contexts(_save_matmuls)
    if recompute_context is None:
        return forward, recompute
    stack = contextlib.ExitStack()
    inner = recompute
    outer = recompute_context

    class _Both(contextlib.AbstractContextManager[Any]):
        def __enter__(self) -> Any:
            stack.enter_context(outer())
            return stack.enter_context(inner)

        def __exit__(self, *exc: Any) -> Any:
            return stack.__exit__(*exc)

    return forward, _Both()


def apply_activation_checkpointing(
    blocks: Sequence[nn.Module],
    cfg: ActivationCheckpointConfig,
    *,
    recompute_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> list[nn.Module]:
    """Checkpoint the blocks `cfg.mode` selects, in place; returns the checkpointed blocks.

    Args:
        blocks: the model's blocks in order (fsdpx.blocks.find_blocks).
        cfg: full: every block; every_n: blocks 0, n, 2n, ...; selective: every block,
            keeping matmul and attention outputs; none: nothing.
        recompute_context: makes a context entered around each recompute in backward.
            Torch function modes active in forward are not active there (autograd runs
            the recompute outside them), so Ulysses' UlyssesSDPA comes back this way.
    Returns:
        The blocks that were checkpointed.

    Example::

        apply_activation_checkpointing(list(gpt.blocks), ActivationCheckpointConfig("full"))
    """
    if cfg.mode == "none":
        return []
    if not blocks:
        # Checkpointing nothing would silently ignore the option.
        raise ValueError(
            f"activation_checkpointing.mode is {cfg.mode!r} but the model has no blocks to "
            "checkpoint (no nn.ModuleList / nn.Sequential of two or more same-class modules); "
            "name the block classes in zero.block_classes, or set the mode to 'none'"
        )
    chosen = list(blocks[:: cfg.every_n] if cfg.mode == "every_n" else blocks)
    apply: Callable[[nn.Module], Any] = checkpoint
    if cfg.mode == "selective" or recompute_context is not None:
        selective = cfg.mode == "selective"
        apply = partial(checkpoint, context_fn=partial(_contexts, selective, recompute_context))
    for block in chosen:
        apply(block)
    return chosen
