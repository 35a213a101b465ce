"""Nodes: per-node aggregates of a snapshot, and the event when a node's relay is lost.

A node is the `node` field of its ranks' records (fsdpx/telemetry/node.py [Note: node
identity]): the launcher's / torchrun's node rank, not the host name.

[Note: unreachable nodes] One relay runs per node, and the monitor follows each
(`fsdpx-monitor host1:port host2:port`). When a relay's connection drops, the monitor
hears nothing from any rank behind it, but that says nothing about the ranks: the node
(or the network to it) is what is unknown. So the model remembers, per rank, the relay
connection its last record came through (`source`); while that connection is down, those
ranks show one status, UNREACHABLE, instead of ageing into stale and then dead one by one,
and the events log gets one line for the node ("relay node-1:7077 unreachable (node 1, 4
ranks)"). When the relay is back, its history and live records refresh the ranks and they
recover. Exited or dead ranks (an exit or disconnect event arrived first) keep that
status: it is known.

Cost: `node_rows` is one pass over the snapshot's rows (dict lookups and compares), run
at the refresh rate like the rest of `snapshot`, never per record.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from monitor.state import NodeRow, RankRow, RankStatus


@dataclass
class _NodeAcc:
    ranks: int = 0
    unreachable: int = 0
    slowest: float | None = None
    mem: float | None = None


def _real(value: object) -> bool:
    t = type(value)
    return t is float or t is int


def node_rows(rows: Iterable[RankRow]) -> list[NodeRow]:
    """Per-node aggregates: unreachable nodes first, then the slowest step time first.

    Ranks that name no node are left out unless their relay is lost (then they form the
    `node=None` row: something unreachable must show). Empty when no rank names a node
    and nothing is unreachable (a single-node run shows no node line).

    Example::

        assert node_rows([]) == []
    """
    unreachable = RankStatus.UNREACHABLE
    acc: dict[int | None, _NodeAcc] = {}
    for row in rows:
        rec = row.record
        node = rec.get("node")
        lost = row.status is unreachable
        if type(node) is not int:
            if not lost:
                continue
            node = None
        a = acc.get(node)
        if a is None:
            a = acc[node] = _NodeAcc()
        a.ranks += 1
        if lost:
            a.unreachable += 1
        st = rec.get("step_time_s")
        if _real(st) and (a.slowest is None or st > a.slowest):  # type: ignore[operator]
            a.slowest = float(st)  # type: ignore[arg-type]
        mem = rec.get("mem_reserved")
        if not _real(mem):
            mem = rec.get("host_rss")
        if _real(mem) and (a.mem is None or mem > a.mem):  # type: ignore[operator]
            a.mem = float(mem)  # type: ignore[arg-type]
    out = [NodeRow(n, a.ranks, a.unreachable, a.slowest, a.mem) for n, a in acc.items()]
    out.sort(key=lambda r: -1 if r.node is None else r.node)
    out.sort(key=lambda r: -(r.slowest_step_s or 0.0))
    out.sort(key=lambda r: -r.unreachable)
    return out


def nodes_text(nodes: Iterable[int | None]) -> str:
    """`node 1`, `nodes 0, 1` or `node unknown` for an event line."""
    nodes = list(nodes)
    known = sorted({n for n in nodes if n is not None})
    unknown = any(n is None for n in nodes)
    if not known:
        return "node unknown"
    text = ("node " if len(known) == 1 else "nodes ") + ", ".join(map(str, known))
    return text + (" and ranks naming no node" if unknown else "")


def relay_event(source: str, records: list[dict[str, Any]], *, lost: bool) -> dict[str, Any]:
    """The event of a relay lost or back, from the latest records of the ranks behind it
    (see [Note: unreachable nodes]): one line for the node, no rank."""
    nodes = [r.get("node") for r in records]
    where = nodes_text([n if type(n) is int else None for n in nodes])
    what = "unreachable" if lost else "reachable again"
    count = f"{len(records)} rank{'' if len(records) == 1 else 's'}"
    return {
        "rank": None,
        "step": None,
        "kind": "node_unreachable" if lost else "node_reachable",
        "detail": {"message": f"relay {source} {what} ({where}, {count})", "relay": source},
    }
