"""Bodies of the ring-attention tests (fsdpx/sequence/ring.py), importable by spawned ranks:
this rank's output rows and q/k/v gradients on its shard of a sequence, and the same rows
of one process's SDPA on the whole sequence."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdpx.sequence.ring import RingSDPA, ring_attention, ring_chunks
from tests import sp_bodies


def local_rows(t: torch.Tensor, rank: int, size: int, *, balanced: bool, dim: int) -> torch.Tensor:
    """This rank's tokens of a whole-sequence tensor in the ring layout."""
    n = 2 * size if balanced else size
    chunks = t.chunk(n, dim=dim)
    return torch.cat([chunks[c] for c in ring_chunks(rank, size, balanced=balanced)], dim=dim)


def attention_check(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One attention call, ring vs whole-sequence SDPA. case: causal, balanced, heads,
    kv_heads, seq, and `sdpa` (through RingSDPA intercepting F.scaled_dot_product_attention
    rather than calling ring_attention)."""
    size, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(7)
    b, d = 2, 8
    q = torch.randn(b, case["heads"], case["seq"], d, generator=g)
    k, v = (torch.randn(b, case["kv_heads"], case["seq"], d, generator=g) for _ in range(2))
    d_out = torch.randn(b, case["heads"], case["seq"], d, generator=g)
    balanced = case["balanced"]
    gqa = case["kv_heads"] != case["heads"]

    def rows(t: torch.Tensor) -> torch.Tensor:
        return local_rows(t, rank, size, balanced=balanced, dim=2)

    local = [rows(t).requires_grad_() for t in (q, k, v)]
    if case.get("sdpa"):
        with RingSDPA(dist.group.WORLD):
            out = F.scaled_dot_product_attention(*local, is_causal=case["causal"], enable_gqa=gqa)
    else:
        out = ring_attention(*local, dist.group.WORLD, is_causal=case["causal"], balanced=balanced)
    out.backward(rows(d_out))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=case["causal"], enable_gqa=gqa)
    ref.backward(d_out)
    return {
        "out": out.detach(),
        "ref": rows(ref.detach()),
        **{f"d{n}": t.grad for n, t in zip("qkv", local, strict=True)},  # type: ignore[misc]
        **{f"ref_d{n}": rows(t.grad) for n, t in zip("qkv", full, strict=True)},  # type: ignore[arg-type]
    }


def ring_body(
    rank: int,
    world_size: int,
    attention: dict[str, dict[str, Any]],
    training: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The attention cases, then the training cases (tests/sp_bodies.py's fsdpx_run with
    context_parallel.mode "ring"), in one spawn."""
    del rank, world_size
    return {
        "attention": {name: attention_check(case) for name, case in attention.items()},
        "training": {
            name: sp_bodies.fsdpx_run({**case, "mode": "ring"}) for name, case in training.items()
        },
    }


def one_rank_kernel(rank: int, world_size: int, device: str) -> dict[str, Any]:
    """ring_attention on a one-rank group (no communication: the kernel alone, load-balanced
    so that skipped, diagonal and whole block pairs all occur) against SDPA on `device`, in
    fp32 and under bf16 autocast. Returns the largest differences (output, gradients)."""
    del rank, world_size
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 64, 16, generator=g).to(device) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # GQA: 2 kv heads
    d_out = torch.randn(2, 4, 64, 16, generator=g).to(device)
    out: dict[str, Any] = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        results = []
        for use_ring in (True, False):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype is not None):
                if use_ring:
                    y = ring_attention(*inputs, dist.group.WORLD, is_causal=True)
                else:
                    y = F.scaled_dot_product_attention(*inputs, is_causal=True, enable_gqa=True)
            y.float().backward(d_out)
            results.append([y.detach().float(), *(t.grad for t in inputs)])
        out[name] = {
            "diffs": [float((a - b).abs().max()) for a, b in zip(*results, strict=True)],
            "scales": [float(b.abs().max()) for b in results[1]],
        }
    return out
