"""The one communication primitive of Ulysses sequence parallelism: an all-to-all that
scatters one tensor dim over the sp group and gathers another, with its own inverse as
its backward (picotron's split of `*_comm.py` from the wrappers that use it)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def all_to_all(x: Tensor, *, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> Tensor:
    """Split `x` into `group`-size chunks along `scatter_dim`, send chunk j to rank j, and
    concatenate what arrives along `gather_dim` (in rank order). Differentiable: the
    backward is the same exchange with the two dims swapped.

    Example (sp = 2; q is (batch, heads, seq/2, head_dim) on each rank)::

        q_full = all_to_all(q, scatter_dim=1, gather_dim=2, group=sp_group)
        # (batch, heads/2, seq, head_dim): half the heads, the whole sequence
    """
    out: Tensor = _AllToAll.apply(x, scatter_dim, gather_dim, group)
    return out


def _exchange(x: Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> Tensor:
    world = dist.get_world_size(group)
    if x.shape[scatter_dim] % world != 0:
        # Callers check the sizes with user-facing errors first; this guards the invariant.
        raise AssertionError(f"{x.shape=} dim {scatter_dim} is not divisible by {world}")
    # Chunk j (for rank j) goes to the front so that one all_to_all_single moves them all.
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup
    ) -> Tensor:
        ctx.dims = (scatter_dim, gather_dim)
        ctx.group = group
        return _exchange(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad.contiguous(), gather_dim, scatter_dim, ctx.group), None, None, None
