"""Ring attention over mesh.sp (context_parallel.mode "ring"): blockwise attention whose
key/value blocks travel around the sp ring, for when Ulysses' head constraint binds.

[Note: ring attention] Each rank keeps its own queries and starts with its own keys and
values. In sp steps every key/value block passes once around the ring (point-to-point to
the next rank, fsdpx/sequence/_ring_comm.py, started before the step's compute so the two
overlap); each step the rank attends its queries to the block it holds and merges the
result into a running output with the log-sum-exp rule (online softmax):

    lse' = logaddexp(lse, lse_b);  out' = out * exp(lse - lse') + out_b * exp(lse_b - lse')

which is exact: after the last block `out` is softmax(q k^T * scale) v over every key and
`lse` its row-wise log-sum-exp. No rank ever holds more than one remote block, so the
score matrix per step is (local tokens)^2, never local x whole sequence. Backward is
flash-attention's, by hand (a custom autograd.Function, not autograd through the loop,
which would keep every step's scores): it recomputes each block's probabilities from the
saved `lse`, accumulates dq locally and sends dk/dv around the ring with the blocks they
belong to; one last step brings each rank's dk/dv home. Blocks are plain torch math in
fp32 (public ops on every device; `aten::_scaled_dot_product_flash_attention_for_cpu`
does return a log-sum-exp, but it is a private op), so CPU/gloo runs it and tests it.

[Note: load-balanced ring] With causal attention, query chunk i needs key chunks <= i. If
rank r held the r-th contiguous 1/sp of the sequence, the last rank would attend to every
block and the first to one. So under ring mode the sequence is cut into 2 x sp chunks and
rank r holds chunks r and 2sp - 1 - r (torch's context_parallel calls this head-tail load
balancing; fsdpx.sequence.shard_batch does the split, position_ids stay global). Every
rank then computes the same number of blocks, and a block pair is skipped (key chunk after
query chunk), masked on its diagonal (the same chunk) or computed whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fsdpx.sequence._ring_comm import RingShift
from fsdpx.sequence._sdpa import SDPAMode

_KV_TAG, _GRAD_TAG = 0, 1


def ring_chunks(rank: int, size: int, *, balanced: bool) -> tuple[int, ...]:
    """The sequence chunks rank `rank` of `size` holds, in order ([Note: load-balanced ring]):
    of 2 x size chunks when balanced, else of size chunks."""
    return (rank, 2 * size - 1 - rank) if balanced else (rank,)


@dataclass(frozen=True)
class _Ring:
    group: dist.ProcessGroup
    size: int
    rank: int
    balanced: bool
    causal: bool
    scale: float

    def chunks(self, rank: int) -> tuple[int, ...]:
        return ring_chunks(rank, self.size, balanced=self.balanced)

    def pairs(self, src: int) -> Iterator[tuple[int, int, bool]]:
        """(local query chunk, key chunk of `src`'s block, diagonal?) for the block pairs
        this rank computes against `src`'s keys; causal skips keys after the queries."""
        for i, qc in enumerate(self.chunks(self.rank)):
            for j, kc in enumerate(self.chunks(src)):
                if not (self.causal and kc > qc):
                    yield i, j, self.causal and kc == qc


def _scores(q: Tensor, k: Tensor, scale: float, diagonal: bool) -> Tensor:
    s = (q @ k.transpose(-1, -2)) * scale
    if diagonal:
        n = s.shape[-1]
        future = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def _expand(t: Tensor, groups: int) -> Tensor:
    """Key/value heads repeated to one per query head (query head i reads kv head i // groups)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _reduce(t: Tensor, groups: int) -> Tensor:
    """The gradient of _expand: sum over the query heads sharing a kv head."""
    if groups == 1:
        return t
    b, h, n, d = t.shape
    return t.view(b, h // groups, groups, n, d).sum(2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, ring: _Ring) -> Tensor:  # type: ignore[override]
        groups = q.shape[1] // k.shape[1]
        n = len(ring.chunks(ring.rank))
        with torch.autocast(q.device.type, enabled=False):
            qs = q.float().chunk(n, dim=2)
            outs = [torch.zeros_like(t) for t in qs]
            lses = [torch.full(t.shape[:-1], float("-inf"), device=q.device) for t in qs]
            kv = torch.stack([k, v])  # sent in the input dtype
            for step in range(ring.size):
                src = (ring.rank - step) % ring.size
                shift = RingShift(kv, ring.group, tag=_KV_TAG) if step < ring.size - 1 else None
                ks = _expand(kv[0].float(), groups).chunk(n, dim=2)
                vs = _expand(kv[1].float(), groups).chunk(n, dim=2)
                for i, j, diagonal in ring.pairs(src):
                    s = _scores(qs[i], ks[j], ring.scale, diagonal)
                    block_lse = s.logsumexp(-1)
                    block_out = torch.exp(s - block_lse[..., None]) @ vs[j]
                    lse = torch.logaddexp(lses[i], block_lse)
                    outs[i] = (
                        outs[i] * torch.exp(lses[i] - lse)[..., None]
                        + block_out * torch.exp(block_lse - lse)[..., None]
                    )
                    lses[i] = lse
                if shift is not None:
                    kv = shift.wait()
            out, out_lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, out_lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:  # type: ignore[override]
        ring: _Ring = ctx.ring
        q, k, v, out, out_lse = ctx.saved_tensors
        groups = q.shape[1] // k.shape[1]
        n = len(ring.chunks(ring.rank))
        with torch.autocast(q.device.type, enabled=False):
            d_out = grad.float()
            qs, d_outs = q.float().chunk(n, dim=2), d_out.chunk(n, dim=2)
            lses = out_lse.chunk(n, dim=2)
            # D_i = sum_j P_ij dP_ij = rowsum(dO * O): the softmax backward's correction.
            deltas = (d_out * out).sum(-1).chunk(n, dim=2)
            d_qs = [torch.zeros_like(t) for t in qs]
            kv = torch.stack([k, v])
            pending: RingShift | None = None  # the dk/dv of the block now held, in flight
            for step in range(ring.size):
                src = (ring.rank - step) % ring.size
                shift = RingShift(kv, ring.group, tag=_KV_TAG) if step < ring.size - 1 else None
                k_full, v_full = _expand(kv[0].float(), groups), _expand(kv[1].float(), groups)
                ks, vs = k_full.chunk(n, dim=2), v_full.chunk(n, dim=2)
                d_ks = [torch.zeros_like(t) for t in ks]
                d_vs = [torch.zeros_like(t) for t in vs]
                for i, j, diagonal in ring.pairs(src):
                    p = torch.exp(_scores(qs[i], ks[j], ring.scale, diagonal) - lses[i][..., None])
                    d_vs[j] += p.transpose(-1, -2) @ d_outs[i]
                    d_s = p * (d_outs[i] @ vs[j].transpose(-1, -2) - deltas[i][..., None])
                    d_s = d_s * ring.scale
                    d_qs[i] += d_s @ ks[j]
                    d_ks[j] += d_s.transpose(-1, -2) @ qs[i]
                step_dkv = torch.stack(
                    [
                        _reduce(torch.cat(d_ks, dim=2), groups),
                        _reduce(torch.cat(d_vs, dim=2), groups),
                    ]
                )
                d_kv = step_dkv if pending is None else pending.wait() + step_dkv
                # The block moves on to the next rank, so its gradient goes with it; after
                # the last step this sends each rank's dk/dv home ([Note: ring attention]).
                if ring.size > 1:
                    pending = RingShift(d_kv, ring.group, tag=_GRAD_TAG)
                if shift is not None:
                    kv = shift.wait()
            if pending is not None:
                d_kv = pending.wait()
            d_q = torch.cat(d_qs, dim=2)
        return d_q.to(q.dtype), d_kv[0].to(k.dtype), d_kv[1].to(v.dtype), None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    balanced: bool = True,
) -> Tensor:
    """Attention over the whole sequence from this rank's tokens ([Note: ring attention]).

    Args:
        q, k, v: (batch, heads, local tokens, head_dim), this rank's tokens: chunks
            `ring_chunks(rank, sp, balanced=balanced)` of the sequence (what
            fsdpx.sequence.shard_batch gives under context_parallel.mode "ring"). k and v
            may have fewer heads than q when they divide them (grouped-query attention).
        group: the sp group (engine.mesh["sp"].get_group()).
        is_causal: causal over the global positions of the chunks.
        scale: the score scale; None: 1 / sqrt(head_dim), as SDPA.
        balanced: the load-balanced layout ([Note: load-balanced ring]); False: rank r
            holds the r-th contiguous 1/sp of the sequence.
    Returns:
        This rank's rows of the attention output, shaped and typed like q.

    Example::

        out = ring_attention(q, k, v, engine.mesh["sp"].get_group(), is_causal=True)
    """
    if k.shape != v.shape or k.shape[2] != q.shape[2] or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"ring attention takes self-attention q/k/v of this rank's tokens, shaped (batch, "
            f"heads, tokens, head_dim) with k/v heads dividing q heads; got {q.shape=}, "
            f"{k.shape=}, {v.shape=}"
        )
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    n = len(ring_chunks(rank, size, balanced=balanced))
    if q.shape[2] % n != 0:
        raise ValueError(
            f"the load-balanced ring layout gives each rank {n} equal chunks of the sequence, "
            f"but this rank holds {q.shape[2]} tokens; shard with fsdpx.sequence.shard_batch "
            "(it pads to a multiple of 2 x mesh.sp)"
        )
    ring = _Ring(
        group=group,
        size=size,
        rank=rank,
        balanced=balanced,
        causal=is_causal,
        scale=q.shape[-1] ** -0.5 if scale is None else scale,
    )
    out: Tensor = _RingAttention.apply(q, k, v, ring)
    return out


class RingSDPA(SDPAMode):
    """Runs every `F.scaled_dot_product_attention` call under it as ring attention over
    `group` (the native-model path, as UlyssesSDPA: [Note: Ulysses for native models] in
    fsdpx/sequence/ulysses.py); every other function passes through."""

    def attend(self, sdpa: Callable[..., Tensor], call: dict[str, Any]) -> Tensor:
        if call["attn_mask"] is not None:
            raise ValueError(
                "scaled_dot_product_attention got an explicit attn_mask under ring attention "
                "(context_parallel.mode 'ring'); a mask over the local tokens cannot describe "
                "the whole sequence. Use is_causal=True and mark padding with -100 labels"
            )
        if call["dropout_p"] != 0.0:
            raise ValueError(
                f"scaled_dot_product_attention got dropout_p={call['dropout_p']} under ring "
                "attention (context_parallel.mode 'ring'), which computes attention blockwise "
                "without dropout; set the model's attention dropout to 0, or use "
                "context_parallel.mode 'ulysses'"
            )
        q, k = call["query"], call["key"]
        if k.shape[1] != q.shape[1] and not call["enable_gqa"]:
            raise ValueError(
                f"scaled_dot_product_attention got {q.shape[1]} query heads and {k.shape[1]} "
                "key/value heads without enable_gqa=True"
            )
        return ring_attention(
            q, k, call["value"], self.group, is_causal=call["is_causal"], scale=call["scale"]
        )
