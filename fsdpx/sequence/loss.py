"""Cross-entropy losses for sequence-sharded causal LMs: each rank's share of the globally
normalised loss ([Note: pre-shifted labels] in fsdpx/sequence/batch.py), whole or in tiles."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fsdpx.sequence.batch import IGNORE_INDEX
from fsdpx.sequence.tiled import tiled_apply


def loss_fn(
    logits: Tensor,
    labels: Tensor,
    *,
    num_items_in_batch: Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """Sum of the cross-entropy over this rank's valid tokens / num_items_in_batch.

    Args:
        logits: (batch, seq, vocab), this rank's tokens.
        labels: (batch, seq), aligned with logits (pre-shifted: shard_batch's `target` or
            `shift_labels`); ignore_index marks tokens without a target.
        num_items_in_batch: valid tokens of the whole sequence(s) (shard_batch's
            `num_items_in_batch`); None: this rank's own count (the plain mean, sp = 1).
    Returns:
        A scalar: this rank's share; the shares of an sp group sum to the loss of the
        whole sequence.

    Example::

        shard = fsdpx.sequence.shard_batch((x, y), engine)
        logits = engine(shard["input"], position_ids=shard["position_ids"])
        loss = fsdpx.sequence.loss_fn(logits, shard["target"],
                                      num_items_in_batch=shard["num_items_in_batch"])
    """
    total = F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=ignore_index, reduction="sum"
    )
    return total / _denominator(labels, num_items_in_batch, ignore_index)


def tiled_loss_fn(
    hidden: Tensor,
    head_weight: Tensor,
    labels: Tensor,
    *,
    tile_tokens: int,
    num_items_in_batch: Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """loss_fn(hidden @ head_weight.T, labels, ...) without the logits of the whole local
    sequence: tiles of `tile_tokens` tokens, each recomputed in backward
    ([Note: tiles with recomputation] in fsdpx/sequence/tiled.py).

    Args:
        hidden: (batch, seq, dim) final hidden states (after the last norm).
        head_weight: (vocab, dim) the output projection's weight (no bias).
        labels, num_items_in_batch, ignore_index: as loss_fn.
        tile_tokens: tokens per tile along seq.
    Returns:
        The same value as loss_fn on the full logits (to fp32 tolerance).

    Example::

        loss = tiled_loss_fn(hidden, model.lm_head.weight, shard["target"], tile_tokens=4096,
                             num_items_in_batch=shard["num_items_in_batch"])
    """

    def tile_loss(h: Tensor, lab: Tensor) -> Tensor:
        logits = (h @ head_weight.T).float()
        return F.cross_entropy(
            logits.flatten(0, -2), lab.flatten(), ignore_index=ignore_index, reduction="sum"
        )

    total = tiled_apply(
        tile_loss,
        hidden,
        [head_weight],
        tile_tokens=tile_tokens,
        seq_dim=1,
        reduce_sum=True,
        aux=labels,
    )
    return total / _denominator(labels, num_items_in_batch, ignore_index)


def _denominator(labels: Tensor, num_items: Tensor | int | None, ignore_index: int) -> Tensor:
    if num_items is None:
        num_items = (labels != ignore_index).sum()
    # clamp: a sequence without a valid target gives 0 / 1 = 0, not NaN.
    return torch.as_tensor(num_items, device=labels.device).clamp(min=1).float()
