"""Activation memory per rank of a Llama-style decoder as a function of sequence length,
mesh.sp, tiling and activation checkpointing, and the longest sequence that fits a device
(`fsdpx estimate --seq-len 262144 --sp 8 --shape ...`).

[Note: activation formula] Per local token (seq / sp tokens per rank; Ulysses and ring
both leave each rank its share of the tokens) a block saves for backward, in elements of
the compute dtype (h hidden, kv = kv_heads x head_dim, f the MLP's width):

    attention: norm input and output 2h; q, k before RoPE and their rotated halves
               2(h + kv); q, k, v after RoPE h + 2kv; the attention output h (o_proj's
               input is a view of it: SDPA's kernels return it token-major) -> 6h + 4kv
    MLP:       norm input and output 2h; gate, up, silu(gate), their product 4f
               -> 2h + 4f; tiled (context_parallel.mlp_tile_tokens): 2h, plus one tile's
               4f while backward recomputes it

and the loss saves the fp32 log-softmax over the vocabulary (4V bytes per token), or, with
a tiled loss, the final hidden state (h) plus one tile's logits. Full activation
checkpointing keeps each block's input (h) and recomputes one block at a time. Ring
attention (fsdpx/sequence/ring.py) also keeps its fp32 output and log-sum-exp, and its
plain-math blocks hold four (local/2)^2 fp32 score matrices per head while they run; the
Ulysses attention kernel is assumed to be a flash kernel (O(tokens) memory), as on CUDA.
The counts follow tests/sp_models.py's TinyLlama and Hugging Face's Llama; the test
(tests/test_estimate_long_context.py) compares them with the bytes autograd really saves.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

_FP32 = 4


@dataclass(frozen=True)
class TransformerShape:
    """A Llama-style decoder's shape (what the activations depend on)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    """The MLP's inner width (Hugging Face's intermediate_size)."""
    vocab: int

    @classmethod
    def parse(cls, text: str) -> TransformerShape:
        """From "layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256"."""
        names = [f.name for f in fields(cls)]
        values: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, _, value = item.partition("=")
            if key not in names or not value.strip().isdigit() or int(value) < 1:
                raise ValueError(
                    f"--shape takes comma-separated {'=, '.join(names)}= positive integers "
                    f"(e.g. layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256); "
                    f"got {item!r}"
                )
            values[key] = int(value)
        missing = [n for n in names if n not in values]
        if missing:
            raise ValueError(f"--shape is missing {', '.join(missing)}; got {text!r}")
        shape = cls(**values)
        if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
            raise ValueError(
                f"--shape needs heads dividing hidden and kv_heads dividing heads; got "
                f"hidden={shape.hidden}, heads={shape.heads}, kv_heads={shape.kv_heads}"
            )
        return shape

    @property
    def kv(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes per rank ([Note: activation formula])."""

    tokens_per_rank: int
    blocks: int
    """What every block saves for backward, all blocks together."""
    loss: int
    """What the loss saves (log-softmax, or the hidden state when tiled)."""
    transient: int
    """The largest temporary on top: one recomputed block (checkpointing), one MLP or
    loss tile, ring attention's score matrices."""

    @property
    def total(self) -> int:
        return self.blocks + self.loss + self.transient


def estimate_activations(
    shape: TransformerShape,
    *,
    seq_len: int,
    sp: int = 1,
    mode: Literal["ulysses", "ring"] = "ulysses",
    mlp_tile: int = 0,
    loss_tile: int = 0,
    checkpointing: bool = False,
    micro_batch: int = 1,
    dtype_bytes: int = 2,
) -> ActivationEstimate:
    """Activation bytes per rank for sequences of `seq_len` tokens split over `sp` ranks.

    Args:
        shape: the decoder's shape.
        seq_len: tokens per sequence; sp: mesh.sp; mode: context_parallel.mode.
        mlp_tile, loss_tile: tokens per tile (0: untiled).
        checkpointing: full activation checkpointing of every block.
        micro_batch: sequences per rank per micro-batch.
        dtype_bytes: the compute dtype's size (2 for bf16).
    Returns:
        An ActivationEstimate.

    Example::

        llama8b = TransformerShape(32, 4096, 32, 8, 14336, 128256)
        est = estimate_activations(llama8b, seq_len=262144, sp=8, mlp_tile=4096,
                                   loss_tile=4096, checkpointing=True)
        print(est.total / 2**30, "GiB per rank")
    """
    chunks = 2 * sp if mode == "ring" and sp > 1 else sp
    tokens = -(-seq_len // chunks) * chunks // sp  # shard_batch pads to a multiple
    h, kv, f, d = shape.hidden, shape.kv, shape.ffn, dtype_bytes
    attention = (6 * h + 4 * kv) * d
    if mode == "ring" and sp > 1:
        attention += (h + shape.heads) * _FP32  # fp32 output and log-sum-exp
    mlp = (2 * h + (0 if mlp_tile else 4 * f)) * d
    block = tokens * (attention + mlp)
    mlp_tile_bytes = min(mlp_tile, tokens) * 4 * f * d if mlp_tile else 0
    if checkpointing:
        blocks = shape.layers * tokens * h * d
        recompute = block + mlp_tile_bytes
    else:
        blocks = shape.layers * block
        recompute = mlp_tile_bytes
    if loss_tile:
        loss = tokens * h * d
        loss_transient = min(loss_tile, tokens) * shape.vocab * (d + 2 * _FP32)
    else:
        loss = tokens * shape.vocab * _FP32
        loss_transient = tokens * shape.vocab * d  # the logits before the fp32 cast
    ring_scores = 0
    if mode == "ring" and sp > 1:
        chunk = tokens // 2
        ring_scores = 4 * shape.heads * chunk * chunk * _FP32
    transient = max(recompute + ring_scores, loss_transient)
    return ActivationEstimate(
        tokens_per_rank=tokens,
        blocks=blocks * micro_batch,
        loss=loss * micro_batch,
        transient=transient * micro_batch,
    )


def largest_sequence(
    shape: TransformerShape,
    *,
    budget: int,
    model_states: int,
    sp: int = 1,
    mode: Literal["ulysses", "ring"] = "ulysses",
    mlp_tile: int = 0,
    loss_tile: int = 0,
    checkpointing: bool = False,
    micro_batch: int = 1,
    dtype_bytes: int = 2,
) -> int:
    """The longest sequence (a multiple of sp, or 2 x sp in ring mode) whose activations
    plus `model_states` fit `budget` bytes per rank; 0 when not even one step fits."""
    step = 2 * sp if mode == "ring" and sp > 1 else sp

    def fits(n_steps: int) -> bool:
        est = estimate_activations(
            shape,
            seq_len=n_steps * step,
            sp=sp,
            mode=mode,
            mlp_tile=mlp_tile,
            loss_tile=loss_tile,
            checkpointing=checkpointing,
            micro_batch=micro_batch,
            dtype_bytes=dtype_bytes,
        )
        return model_states + est.total <= budget

    if not fits(1):
        return 0
    hi = 2
    while fits(hi):
        hi *= 2
    lo = hi // 2  # fits(lo), not fits(hi): activations grow with the sequence
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step


def long_context_report(
    shape: TransformerShape,
    *,
    seq_len: int,
    sp: int,
    mode: Literal["ulysses", "ring"],
    mlp_tile: int,
    loss_tile: int,
    checkpointing: str,
    micro_batch: int,
    dtype_bytes: int,
    model_states: int,
    device_memory: int,
) -> str:
    """The lines `fsdpx estimate --seq-len N` adds: activations per rank at `seq_len`, and
    the longest sequence fitting `device_memory` bytes per rank with and without tiling.

    Args:
        checkpointing: activation_checkpointing.mode; only "full" is modelled, "every_n"
            and "selective" are estimated as "none" (an upper bound, said in the text).
        model_states: the bytes per rank that do not grow with the sequence (device model
            states and gathered parameters, from fsdpx.estimate.estimate_memory).
        The rest: as estimate_activations.
    """
    full = checkpointing == "full"
    common = {"sp": sp, "mode": mode, "micro_batch": micro_batch, "dtype_bytes": dtype_bytes}
    est = estimate_activations(
        shape,
        seq_len=seq_len,
        mlp_tile=mlp_tile,
        loss_tile=loss_tile,
        checkpointing=full,
        **common,  # type: ignore[arg-type]
    )
    gib = 2**30
    lines = [
        f"long context ([Note: activation formula] in fsdpx/estimate_activations.py): "
        f"{shape.layers} layers, hidden {shape.hidden}, {shape.heads}/{shape.kv_heads} heads, "
        f"ffn {shape.ffn}, vocab {shape.vocab}; {mode} over sp {sp}; MLP tiles {mlp_tile or '-'}"
        f", loss tiles {loss_tile or '-'}; checkpointing {checkpointing}; micro-batch "
        f"{micro_batch}; {dtype_bytes}-byte activations",
        f"  seq {seq_len}: {est.tokens_per_rank} tokens per rank, activations "
        f"{est.total / gib:.2f} GiB (blocks {est.blocks / gib:.2f}, loss {est.loss / gib:.2f}, "
        f"transient {est.transient / gib:.2f}) + model states {model_states / gib:.2f} GiB = "
        f"{(est.total + model_states) / gib:.2f} GiB per rank",
    ]
    if checkpointing not in ("none", "full"):
        lines.append(f"  checkpointing {checkpointing!r} is estimated as 'none' (an upper bound)")
    budget = device_memory
    for label, tiles in (("these settings", (mlp_tile, loss_tile)), ("untiled", (0, 0))):
        if label == "untiled" and tiles == (mlp_tile, loss_tile):
            break
        longest = largest_sequence(
            shape,
            budget=budget,
            model_states=model_states,
            mlp_tile=tiles[0],
            loss_tile=tiles[1],
            checkpointing=full,
            **common,  # type: ignore[arg-type]
        )
        lines.append(
            f"  largest sequence in {budget / gib:.1f} GiB per rank ({label}): {longest} tokens"
        )
    return "\n".join(lines)
