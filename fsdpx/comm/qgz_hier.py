"""qgZ's hierarchical gradient reduction (ZeRO++): two quantized all-to-alls, within each
node and then across nodes, on a 2-D (node, local rank) layout of FSDP's shard group.

With ``W = N * L`` ranks in the shard group (``N`` nodes of ``L`` ranks each, group rank
``r = n * L + l``), each rank's reduce-scatter input is ``W`` pieces of ``m`` elements,
piece ``r`` destined to group rank ``r``:

1. Every piece is quantized on its own (blocks of ``b`` elements, one fp32 scale each) and
   one all-to-all over the node's ``L`` ranks sends local rank ``l`` the ``N`` pieces
   destined to local rank ``l`` of every node.
2. Each rank dequantizes the ``L * N`` pieces it got to fp32 and sums them per destination
   node, in local-rank order: ``N`` node-partial sums.
3. The ``N`` partial sums are re-quantized and one all-to-all over the ``N`` ranks that
   share this local index (one per node) sends node ``n``'s partial to node ``n``.
4. The ``N`` pieces received are dequantized and summed in node order; AVG divides by
   ``W``.

Bytes sent by a rank (``P = qbytes(m) + 4 * ceil(m / b)``, qbytes as in fsdp_slot.py):
``(L - 1) * N * P`` within the node and ``(N - 1) * P`` across nodes, ``(W - 1) * P`` in
all, the same total as the one-level all-to-all, but only ``(N - 1) * P`` of it crosses
nodes where the one-level scheme sends ``(W - L) * P`` across: 1 / L of it.

[Note: qgZ across nodes] Nodes are consecutive global ranks, ``node_size`` each (torchrun's
numbering: ``rank = node_rank * LOCAL_WORLD_SIZE + local_rank``); ``node_size`` comes from
``zero.quantized_gradients_node_size`` or, when that is 0, from the launcher's
``LOCAL_WORLD_SIZE``. FSDP's shard group must then be a whole 2-D layout: at least two
nodes, the same number ``L >= 2`` of its ranks on each, its group ranks numbered node by
node. Anything else (the whole group on one node, as HSDP's shard groups usually are; one
rank per node, as under TP within a node; uneven nodes) is refused by name, never run as the
one-level scheme: the two differ in error bound and in what crosses the network. The two
sub-groups are made with ``use_local_synchronization`` (only their members call
``new_group``), at the first reduce-scatter of a shard group, once per process for that
group, so every FSDP unit over the same shard group shares them.

Error bound (``qmax`` = 127 for int8, 7 for int4; ``A_r`` = the absmax of the block of
rank ``r``'s piece holding element ``j``; blocks cover the same element indices at both
levels, since both quantize whole ``m``-element pieces)::

    d1 = 1 / (2 * qmax) + 2**-22 + L * 2**-24      (within the node: quantize, L-term sum)
    d2 = 1 / (2 * qmax) + 2**-22 + N * 2**-24      (across nodes: re-quantize, N-term sum)
    SUM:  |g_hat_j - sum_r g_rj| <= (d1 + d2 * (1 + d1)) * sum_r A_r
    AVG:  the SUM bound / W, plus 2**-24 * |g_hat_j| for the division

The first level's error on node ``n``'s partial is at most ``d1 * sum_{r in n} A_r`` (the
one-level bound of fsdp_slot.py over ``L`` ranks), so the partial's block absmax is at most
``(1 + d1) * sum_{r in n} A_r``, and re-quantizing it adds at most ``d2`` times that. About
twice the one-level bound: the price of quantizing twice.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from fsdpx.comm import counted

if TYPE_CHECKING:
    from fsdpx.comm.fsdp_slot import QuantizedReduceScatter


def resolve_node_size(node_size: int) -> int:
    """``zero.quantized_gradients_node_size``, or LOCAL_WORLD_SIZE when it is 0."""
    if node_size > 0:
        return node_size
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not env.isdigit() or int(env) < 1:
        raise ValueError(
            "hierarchical qgZ (zero.quantized_gradients_hierarchical) needs the ranks per "
            f"node: LOCAL_WORLD_SIZE is {env or 'unset'!r} (torchrun sets it). Launch with "
            "torchrun or set zero.quantized_gradients_node_size"
        )
    return int(env)


@dataclass(frozen=True)
class Layout:
    """FSDP's shard group as ``nodes`` x ``local`` ranks, and this rank's two sub-groups
    (as global ranks)."""

    nodes: int
    local: int
    intra: tuple[int, ...]
    """The shard group's ranks on this rank's node, in group order."""
    inter: tuple[int, ...]
    """The shard group's ranks with this rank's local index, one per node, in node order."""


def plan(ranks: Sequence[int], node_size: int, rank: int) -> Layout:
    """The 2-D layout of the shard group ``ranks`` (global ranks in group-rank order), or
    an error saying why it has none ([Note: qgZ across nodes])."""
    node_of = [r // node_size for r in ranks]
    order: list[int] = []  # nodes in group order, each once
    for n in node_of:
        if not order or order[-1] != n:
            if n in order:
                raise ValueError(
                    f"hierarchical qgZ needs the shard group's ranks numbered node by node; "
                    f"the group {list(ranks)} with {node_size} ranks per node visits node "
                    f"{n} twice. Use the one-level qgZ "
                    "(zero.quantized_gradients_hierarchical = false) for this mesh"
                )
            order.append(n)
    counts = [node_of.count(n) for n in order]
    where = f"the shard group {list(ranks)} with {node_size} ranks per node"
    fix = "use the one-level qgZ (zero.quantized_gradients_hierarchical = false)"
    if len(order) < 2:
        raise ValueError(
            f"hierarchical qgZ needs a shard group spanning at least 2 nodes; {where} lies "
            f"on node {order[0]} only (there is no cross-node step): {fix}, or check "
            "zero.quantized_gradients_node_size / LOCAL_WORLD_SIZE"
        )
    if len(set(counts)) != 1:
        raise ValueError(
            f"hierarchical qgZ needs the same number of shard-group ranks on every node; "
            f"{where} has {counts} on nodes {order}: {fix}"
        )
    if counts[0] < 2:
        raise ValueError(
            f"hierarchical qgZ needs at least 2 shard-group ranks per node; {where} has one "
            f"on each of nodes {order} (e.g. TP or the replicate axis fills the node), so "
            f"there is no within-node step: {fix}"
        )
    local = counts[0]
    me = list(ranks).index(rank)
    n, lr = divmod(me, local)
    return Layout(
        nodes=len(order),
        local=local,
        intra=tuple(ranks[n * local : (n + 1) * local]),
        inter=tuple(ranks[k * local + lr] for k in range(len(order))),
    )


@dataclass(frozen=True)
class _Groups:
    layout: Layout
    intra: dist.ProcessGroup
    inter: dist.ProcessGroup


# (default group, shard group name, node size) -> its sub-groups; the default group is
# part of the key so that a re-initialised world never reuses stale groups.
_GROUPS: dict[tuple[int, str, int], tuple[object, _Groups]] = {}


def groups_for(group: dist.ProcessGroup, node_size: int) -> _Groups:
    """This rank's within-node and across-node sub-groups of ``group``, made once."""
    world = dist.distributed_c10d._get_default_group()
    key = (id(world), group.group_name, node_size)
    hit = _GROUPS.get(key)
    if hit is not None and hit[0] is world:
        return hit[1]
    ranks = [dist.get_global_rank(group, i) for i in range(group.size())]  # group order
    layout = plan(ranks, node_size, dist.get_rank())
    # Only the members call new_group (local synchronization): every member of each
    # sub-group is in `group` and is inside this same reduce-scatter now.
    intra = dist.new_group(list(layout.intra), use_local_synchronization=True)
    inter = dist.new_group(list(layout.inter), use_local_synchronization=True)
    assert intra is not None and inter is not None
    made = _Groups(layout, intra, inter)
    _GROUPS[key] = (world, made)
    return made


def reduce_two_level(
    slot: QuantizedReduceScatter,
    output: Tensor,
    input_tensor: Tensor,
    group: dist.ProcessGroup,
    avg: bool,
) -> None:
    """The module docstring's four steps, into ``output`` (FSDP's reduce-scatter output)."""
    g = groups_for(group, slot.node_size)
    n_nodes, local, m = g.layout.nodes, g.layout.local, output.numel()
    # (N, L, m) by destination (node, local rank) -> (L, N, m): row l goes to local rank l.
    by_local = input_tensor.reshape(n_nodes, local, m).transpose(0, 1).reshape(-1)
    send = slot.payloads(by_local, local * n_nodes)  # (L * N, P)
    recv = torch.empty_like(send)
    counted.all_to_all_single(recv.view(-1), send.view(-1), group=g.intra)
    rows = recv.view(local, n_nodes, -1)
    partial = torch.zeros(n_nodes, m, dtype=torch.float32, device=output.device)
    for src in range(local):  # sum in local-rank order
        for node in range(n_nodes):
            slot.accumulate_row(partial[node], rows[src, node])
    send2 = slot.payloads(partial.view(-1), n_nodes)  # (N, P)
    recv2 = torch.empty_like(send2)
    counted.all_to_all_single(recv2.view(-1), send2.view(-1), group=g.inter)
    acc = torch.zeros(m, dtype=torch.float32, device=output.device)
    for node in range(n_nodes):  # sum in node order
        slot.accumulate_row(acc, recv2[node])
    if avg:
        acc /= n_nodes * local
    output.copy_(acc)
