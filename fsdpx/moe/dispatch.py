"""Token dispatch: sort the kept assignments by expert, run the experts, combine.

Without expert parallelism the experts of every token are local. Under mesh.ep each rank
holds num_experts / ep consecutive experts (rank r: experts [r * E_local, (r + 1) * E_local))
and tokens travel to their expert's rank and back with `all_to_all`:

1. per-expert counts of this rank's assignments [E] are exchanged (one all_to_all of E
   ints), so every rank knows how many rows it receives from each peer for each of its
   experts: the uneven split sizes of step 2;
2. the rows, sorted by expert (so by owner rank), go out with all_to_all_single and
   uneven splits; they arrive ordered (source rank, local expert) and are regrouped to
   (local expert, source rank) for the grouped expert compute;
3. the outputs take the reverse path; each token sums its experts' outputs times the
   gate weights.

The three exchanges go through fsdpx's comm layer (fsdpx/comm/counted.py), so they are
numbered in hang dumps and their bytes land in the telemetry record's `sent_all_to_all`
(forward and backward: per MoE layer and micro-step, the count exchange sends
(ep - 1) / ep * E * 8 bytes and each of the four row exchanges the bytes of the rows
bound for other ranks).

[Note: no hang in all_to_all] Every rank calls the same collectives in the same order
whatever its routing: the count exchange, then the two row exchanges, even with zero rows
to send or receive. A rank that routes no token still runs its experts on an empty batch
(fsdpx/moe/experts.py keeps their parameters in the graph), so FSDP's gradient
reduce-scatter, which every rank of the expert-data-parallel group joins, is reached by
all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fsdpx.comm import counted
from fsdpx.telemetry.moe_load import moe_load

ExpertFn = Callable[[Tensor, list[int]], Tensor]


def moe_dispatch(
    x: Tensor,
    token: Tensor,
    expert: Tensor,
    weight: Tensor,
    *,
    num_experts: int,
    experts: ExpertFn,
    ep_group: dist.ProcessGroup | None,
) -> Tensor:
    """out[t] = sum over t's kept assignments of weight * expert(x[t]), shape of `x` [S, d].

    Args:
        x: the tokens [S, d].
        token, expert, weight: the kept assignments [A] (fsdpx.moe.router.Routing, or a
            Hugging Face router's top-k indices and weights, flattened).
        num_experts: experts in the whole layer.
        experts: runs this rank's experts on rows sorted by local expert, given per-expert
            row counts (fsdpx.moe.experts.Experts.forward).
        ep_group: the expert-parallel group, or None when every expert is local.
    """
    order = torch.argsort(expert, stable=True)
    sorted_token = token[order]
    rows = x.index_select(0, sorted_token)
    counts = torch.bincount(expert, minlength=num_experts)
    counts_list = counts.tolist()  # split sizes; also the expert load of telemetry
    moe_load().add_routing(counts_list)
    if ep_group is None or dist.get_world_size(ep_group) == 1:
        moe_load().add_computed(len(sorted_token))
        out_rows = experts(rows, counts_list)
    else:
        out_rows = _expert_parallel(rows, counts, counts_list, experts=experts, group=ep_group)
    weighted = out_rows * weight[order].unsqueeze(1).to(out_rows.dtype)
    return torch.zeros_like(x).index_add(0, sorted_token, weighted.to(x.dtype))


def _expert_parallel(
    rows: Tensor,
    counts: Tensor,
    counts_list: list[int],
    *,
    experts: ExpertFn,
    group: dist.ProcessGroup,
) -> Tensor:
    """Steps 1-3 of the module docstring for rows sorted by (global) expert."""
    ep = dist.get_world_size(group)
    local = counts.numel() // ep
    # 1. recv[r * local + j]: rows rank r sends for this rank's local expert j.
    recv = torch.empty_like(counts)
    counted.all_to_all_single(recv, counts, group=group)
    send_splits = [sum(counts_list[r * local : (r + 1) * local]) for r in range(ep)]
    recv_by_rank = recv.view(ep, local)
    recv_splits = recv_by_rank.sum(1).tolist()
    moe_load().add_computed(sum(recv_splits))
    # 2. Rows out, then regroup (source rank, expert) -> (expert, source rank).
    arrived = _all_to_all(rows, recv_splits, send_splits, group)
    by_expert = _regroup(recv_by_rank)
    out = experts(arrived.index_select(0, by_expert), recv_by_rank.sum(0).tolist())
    back = torch.empty_like(out).index_copy(0, by_expert, out)
    # 3. Rows back to their tokens' ranks.
    return _all_to_all(back, send_splits, recv_splits, group)


def _all_to_all(
    x: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> Tensor:
    """Rows of `x` exchanged with uneven splits; differentiable (its backward is the
    reverse exchange)."""
    out: Tensor = _AllToAll.apply(x, output_splits, input_splits, group)
    return out


class _AllToAll(torch.autograd.Function):
    """Uneven all_to_all of rows through the counted comm layer; backward: the reverse."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
    ) -> Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None


def _exchange(
    x: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    counted.all_to_all_uneven(out, x.contiguous(), output_splits, input_splits, group)
    return out


def _regroup(counts: Tensor) -> Tensor:
    """Indices that reorder rows laid out as counts [ranks, experts] (row-major blocks)
    into expert-major order (all of expert 0 from every rank, then expert 1, ...)."""
    ranks, local = counts.shape
    flat = counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # start of block (r, j) in arrival order
    blocks = starts.view(ranks, local).t().reshape(-1)
    lengths = counts.t().reshape(-1)
    total = int(flat.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=counts.device)
    offs = torch.cumsum(lengths, 0) - lengths
    block_of = torch.repeat_interleave(torch.arange(lengths.numel(), device=counts.device), lengths)
    within = torch.arange(total, device=counts.device) - offs[block_of]
    return blocks[block_of] + within
