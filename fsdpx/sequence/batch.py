"""Splitting a batch by sequence for the sp ranks (`fsdpx.sequence.shard_batch`).

[Note: pre-shifted labels] A causal LM predicts token t+1 at position t. If each rank
shifted its own labels, the last token of every shard would have no target (its next token
lives on the next rank) and the first would be dropped: sp - 1 tokens lost per sequence. So
the labels are shifted once, on the whole sequence, before splitting (`shift_labels`, what
Hugging Face's loss takes), and the count of valid targets of the whole sequence travels
with the shard (`num_items_in_batch`), so that each rank's loss is its share of the
globally normalised loss: sum over its valid tokens / the sequence's valid-token count.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fsdpx.sequence.ring import ring_chunks

IGNORE_INDEX = -100
"""The label that marks a token without a target (padding, prompts): PyTorch's default."""


def shard_sequence(
    batch: Mapping[str, Any] | tuple[Tensor, Tensor],
    *,
    rank: int,
    size: int,
    pad: bool = True,
    pad_token_id: int = 0,
    balanced: bool = False,
) -> dict[str, Any]:
    """This sp rank's share of a batch; the engine-free form of `shard_batch`.

    Args:
        batch: a dict in Hugging Face's shape (`input_ids` or `inputs_embeds`, optional
            `labels` equal to the inputs (shifted here, [Note: pre-shifted labels]),
            `position_ids`, an all-ones `attention_mask`), or a tuple `(inputs, targets)`
            whose targets are already aligned with the inputs (targets[t] is the target of
            inputs[t]), as fsdpx.demo.gpt.batches makes them.
        rank, size: this rank's index in the sp group and the group's size.
        pad: pad a sequence whose length `size` does not divide (inputs with
            `pad_token_id`, labels with -100), with a warning; False raises instead.
        balanced: ring attention's load-balanced layout: the sequence is cut into
            2 x size chunks and this rank takes chunks rank and 2 x size - 1 - rank
            ([Note: load-balanced ring] in fsdpx/sequence/ring.py); lengths are then
            padded to a multiple of 2 x size. False: the rank-th contiguous 1/size.
    Returns:
        A dict. From a dict batch: the same keys, sharded along dim 1, plus `position_ids`
        (global positions), and with labels: `shift_labels` (= `labels`, pre-shifted) and
        `num_items_in_batch`. From a tuple: `input`, `target`, `position_ids`,
        `num_items_in_batch`.
    Raises:
        ValueError: a sequence length `size` does not divide with pad False, or an
            attention_mask with zeros (padding must be -100 labels at the end).

    Example::

        shard = shard_sequence({"input_ids": ids, "labels": ids}, rank=1, size=2)
        shard["input_ids"].shape   # (batch, seq / 2): tokens seq/2 ... seq-1
    """
    if isinstance(batch, tuple):
        inputs, targets = batch
        out = _shard(
            {"input": inputs, "target": targets}, "input", rank, size, pad, pad_token_id, balanced
        )
        out["num_items_in_batch"] = _count(targets)
        return out
    data = dict(batch)
    key = "input_ids" if "input_ids" in data else "inputs_embeds"
    if key not in data:
        raise ValueError(
            f"shard_batch needs 'input_ids' or 'inputs_embeds' in a dict batch; got keys "
            f"{sorted(data)}"
        )
    mask = data.pop("attention_mask", None)
    if mask is not None and not bool(mask.all()):
        raise ValueError(
            "shard_batch got an attention_mask with zeros; under sequence parallelism "
            "(mesh.sp > 1) attention is causal over the whole sequence, so mark padding with "
            "label -100 at the end of each sequence (right padding) and drop the mask"
        )
    if "labels" in data:
        labels = data.pop("labels")
        ignore = torch.full_like(labels[:, :1], IGNORE_INDEX)
        data["shift_labels"] = torch.cat([labels[:, 1:], ignore], dim=1)
    out = _shard(data, key, rank, size, pad, pad_token_id, balanced)
    if "shift_labels" in out:
        # Hugging Face computes a loss only when `labels` is given; with shift_labels
        # present it reads those ([Note: pre-shifted labels]).
        out["labels"] = out["shift_labels"]
        if "num_items_in_batch" not in out:
            out["num_items_in_batch"] = _count(data["shift_labels"])
    return out


def _shard(
    data: dict[str, Any],
    key: str,
    rank: int,
    size: int,
    pad: bool,
    pad_token_id: int,
    balanced: bool,
) -> dict[str, Any]:
    seq = data[key].shape[1]
    if "position_ids" not in data:
        batch = data[key].shape[0]
        data["position_ids"] = torch.arange(seq, device=data[key].device).expand(batch, seq)
    n_chunks, padded = _layout(seq, size, balanced)
    what = (
        f"2 x mesh.sp = {n_chunks} (ring attention's load-balanced layout)"
        if balanced
        else f"mesh.sp = {size}"
    )
    if padded != seq:
        if not pad:
            raise ValueError(
                f"sequence length {seq} is not divisible by {what}; pad the batch to a "
                f"multiple of {n_chunks} (e.g. {padded}), or set context_parallel.pad true"
            )
        warnings.warn(
            f"sequence length {seq} is not divisible by {what}: padded to {padded} "
            "(inputs with the pad token, labels with -100)",
            stacklevel=3,
        )
    mine = ring_chunks(rank, size, balanced=balanced)
    out: dict[str, Any] = {}
    for name, value in data.items():
        if not isinstance(value, Tensor) or value.dim() < 2 or value.shape[1] != seq:
            out[name] = value  # not sequence-shaped: every rank keeps it whole
            continue
        if padded != seq:
            value = _pad(value, name, padded - seq, pad_token_id)
        chunks = value.chunk(n_chunks, dim=1)
        out[name] = torch.cat([chunks[c] for c in mine], dim=1).contiguous()
    return out


def _layout(seq: int, size: int, balanced: bool) -> tuple[int, int]:
    """How a sequence of `seq` tokens is cut: (chunks, padded length). Ring attention's
    load-balanced layout takes 2 x size chunks, the contiguous one size."""
    n_chunks = 2 * size if balanced else size
    return n_chunks, -(-seq // n_chunks) * n_chunks


def unshard_sequence(
    value: Tensor, *, seq: int, size: int, group: Any, balanced: bool = False
) -> Tensor:
    """The inverse of shard_sequence for one tensor: every sp rank's shard of a
    sequence-shaped tensor (dim 1) gathered over `group` and put back in sequence order,
    without the padding shard_sequence added. A tensor not shaped like a shard of a
    `seq`-token sequence is returned as it is (collective: every rank of `group` calls it
    with the same shapes)."""
    n_chunks, padded = _layout(seq, size, balanced)
    if value.dim() < 2 or value.shape[1] != padded // size:
        return value
    parts = [torch.empty_like(value) for _ in range(size)]
    dist.all_gather(parts, value.contiguous(), group=group)
    chunks: dict[int, Tensor] = {}
    for rank, part in enumerate(parts):
        mine = ring_chunks(rank, size, balanced=balanced)
        for index, piece in zip(mine, part.chunk(len(mine), dim=1), strict=True):
            chunks[index] = piece
    return torch.cat([chunks[i] for i in range(n_chunks)], dim=1)[:, :seq]


def _pad(value: Tensor, name: str, extra: int, pad_token_id: int) -> Tensor:
    if name == "position_ids":
        last = value[:, -1:]
        tail = last + torch.arange(1, extra + 1, device=value.device)
    else:
        fill = IGNORE_INDEX if name in ("shift_labels", "target") else pad_token_id
        shape = (value.shape[0], extra, *value.shape[2:])
        tail = torch.full(shape, fill, dtype=value.dtype, device=value.device)
    return torch.cat([value, tail], dim=1)


def _count(labels: Tensor) -> Tensor:
    # Counted on the whole, unpadded sequence: padding adds only -100 labels.
    return (labels != IGNORE_INDEX).sum()


def shard_batch(batch: Mapping[str, Any] | tuple[Tensor, Tensor], engine: Any) -> dict[str, Any]:
    """This rank's share of `batch` under `engine`'s mesh.sp (see shard_sequence).

    `engine.train_batch` and fsdpx's Hugging Face integration call it for you; call it
    yourself in your own loop, before `engine(...)`.

    Example (a Hugging Face causal LM)::

        shard = fsdpx.sequence.shard_batch({"input_ids": ids, "labels": ids}, engine)
        loss = engine(**shard).loss          # this rank's share of the global loss
        engine.backward(loss)
    """
    from fsdpx.parallel_dims import Axis

    sp = engine.mesh[Axis.SP.value]
    cp = engine.config.context_parallel
    return shard_sequence(
        batch,
        rank=sp.get_local_rank(),
        size=sp.size(),
        pad=cp.pad,
        balanced=cp.mode == "ring" and sp.size() > 1,
    )
