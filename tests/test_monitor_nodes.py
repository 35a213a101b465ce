"""Monitor across nodes: one relay per node, one monitor following all of them; ranks in
one table with their node, per-node aggregates, and a lost relay shown as its node being
unreachable (monitor/nodes.py [Note: unreachable nodes]), not as its ranks dying."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from fsdpx.telemetry.wire.relay import Relay
from fsdpx.telemetry.wire.transport import Connection, connect
from monitor.app import MonitorApp
from monitor.model import MonitorModel
from monitor.nodes import node_rows
from monitor.state import Flag, MonitorSettings, RankStatus
from monitor.synthetic import SyntheticRun
from monitor.table_view import fit_columns, format_row, make_filter

RUN = SyntheticRun(n_ranks=4, step_time_s=0.1, ranks_per_host=2)
SECRET = b"nodes-secret"


def record(rank: int, step: int) -> dict[str, Any]:
    return {**RUN.record(rank, step), "node": rank // 2}


def test_model_marks_a_lost_relay_s_ranks_unreachable_not_dead() -> None:
    settings = MonitorSettings(stale_after_s=2.0, dead_after_s=5.0)
    model = MonitorModel(settings)
    model.add_records([record(0, 1), record(1, 1)], now=0.0, source="node-0:7077")
    model.add_records([record(2, 1), record(3, 1)], now=0.0, source="node-1:7077")
    model.add_events(
        [{"rank": 3, "kind": "exit", "detail": {"reason": "finished"}, "time": 0.0}], now=0.0
    )
    model.set_reachable("node-1:7077", False, now=1.0)
    model.set_reachable("node-1:7077", False, now=1.5)  # a failed reconnect: no new event
    model.add_records([record(0, 2), record(1, 2)], now=100.0, source="node-0:7077")
    snap = model.snapshot(100.0)  # far past dead_after for node 1's ranks
    assert [snap.rows[r].status for r in range(4)] == [
        RankStatus.ALIVE,
        RankStatus.ALIVE,
        RankStatus.UNREACHABLE,
        RankStatus.EXITED,  # its exit arrived before the relay was lost: known
    ]
    assert snap.rows[2].flags & Flag.UNREACHABLE and not snap.rows[2].flags & Flag.STALE
    assert (snap.summary.unreachable, snap.summary.dead, snap.summary.stale) == (1, 0, 0)
    messages = [e["detail"]["message"] for e in model.take_made_events()]
    assert messages == ["relay node-1:7077 unreachable (node 1, 2 ranks)"]
    assert make_filter("unreachable")(snap.rows[2]) and not make_filter("unreachable")(snap.rows[0])
    assert [r for r in range(4) if make_filter("node:1")(snap.rows[r])] == [2, 3]
    node_row = next(n for n in snap.nodes if n.node == 1)
    assert snap.nodes[0] is node_row and (node_row.ranks, node_row.unreachable) == (2, 1)
    assert "unrch" in format_row(snap.rows[2], fit_columns(200)).split()

    model.set_reachable("node-1:7077", True, now=101.0)
    messages = [e["detail"]["message"] for e in model.take_made_events()]
    assert messages == ["relay node-1:7077 reachable again (node 1, 2 ranks)"]
    model.add_records([record(2, 2)], now=101.0, source="node-1:7077")
    assert model.snapshot(101.0).rows[2].status is RankStatus.ALIVE


def test_node_aggregates() -> None:
    model = MonitorModel()
    model.add_records([record(r, 1) for r in range(4)], now=0.0, source="a")
    model.add_records([{**RUN.record(3, 1), "rank": 4}], now=0.0, source="a")  # names no node
    nodes = {n.node: n for n in model.snapshot(0.0).nodes}
    assert set(nodes) == {0, 1}  # a rank naming no node is in no node's line
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        recs = [record(r, 1) for r in ranks]
        assert nodes[node].ranks == 2 and nodes[node].unreachable == 0
        assert nodes[node].slowest_step_s == max(r["step_time_s"] for r in recs)
        assert nodes[node].max_mem == max(r["mem_reserved"] for r in recs)
    assert node_rows([]) == []
    assert MonitorModel().snapshot(0.0).nodes == []  # single-node runs: no node line


def test_non_loopback_relay_requires_the_secret() -> None:
    with pytest.raises(ValueError, match="refusing to listen on .* without a shared secret"):
        Relay("0.0.0.0:0").bind()


class Node:
    """A relay bound on every interface (so it needs the secret) and its two ranks, each
    connected as a publisher would be."""

    def __init__(self, node: int, port: int = 0) -> None:
        self.node = node
        self.relay = Relay(f"0.0.0.0:{port}", secret=SECRET)
        bound = self.relay.bind().port
        assert bound is not None
        self.port: int = bound
        self.relay.start_thread()
        self.address = f"127.0.0.1:{self.port}"
        self.ranks = [2 * node, 2 * node + 1]
        self.conns: list[Connection] = [
            connect(
                self.address,
                role="rank",
                secret=SECRET,
                timeout_s=5.0,
                rank=r,
                host=RUN.record(r, 1)["host"],
                pid=1,
            )
            for r in self.ranks
        ]

    def publish(self, step: int) -> None:
        for rank, conn in zip(self.ranks, self.conns, strict=True):
            conn.send({"type": "records", "records": [record(rank, step)]})

    def stop(self) -> None:
        # The relay goes first, as when its node is lost: ranks closing their connections
        # to a live relay would be reported as disconnected (dead) instead.
        self.relay.stop()
        for conn in self.conns:
            conn.close()


def test_monitor_follows_two_relays_and_shows_a_lost_node() -> None:
    nodes = [Node(0), Node(1)]
    now = [RUN.time_of(1)]  # the monitor's clock (the events log shows run-relative times)
    try:
        for node in nodes:
            node.publish(1)

        async def scenario() -> None:
            app = MonitorApp(
                sources=[n.address for n in nodes], secret=SECRET, clock=lambda: now[0]
            )
            async with app.run_test(size=(100, 30)) as pilot:

                async def wait_for(state: Callable[[], bool]) -> None:
                    deadline = time.monotonic() + 60
                    while not state() and time.monotonic() < deadline:
                        await pilot.pause(0.05)
                    assert state()

                def statuses() -> list[RankStatus | None]:
                    rows = app.snapshot.rows
                    return [rows[r].status if r in rows else None for r in range(4)]

                await wait_for(lambda: statuses() == [RankStatus.ALIVE] * 4)
                snap = app.snapshot
                assert {r: row.record["node"] for r, row in snap.rows.items()} == {
                    0: 0, 1: 0, 2: 1, 3: 1,
                }  # fmt: skip
                assert [(n.node, n.ranks) for n in snap.nodes] in (
                    [(0, 2), (1, 2)],
                    [(1, 2), (0, 2)],
                )
                header = app.table.render_line(0).text.split()
                assert header[:3] == ["rank↑", "node", "host"]
                assert "nodes 2" in app.summary_bar.render().plain  # type: ignore[union-attr]

                lost = nodes[1]
                lost.stop()  # node 1's relay is gone
                await wait_for(lambda: statuses()[2:] == [RankStatus.UNREACHABLE] * 2)
                now[0] += 3600.0  # long past dead_after: still unreachable, not dead
                nodes[0].publish(2)
                await wait_for(lambda: app.snapshot.summary.step == 2)
                await wait_for(
                    lambda: statuses() == [RankStatus.ALIVE] * 2 + [RankStatus.UNREACHABLE] * 2
                )
                assert (app.snapshot.summary.dead, app.snapshot.summary.stale) == (0, 0)
                events = [e for e in app.model.events if e.get("kind") == "node_unreachable"]
                assert [e["detail"]["message"] for e in events] == [
                    f"relay {lost.address} unreachable (node 1, 2 ranks)"
                ]
                # (the log's width crops the line: the model's event has it whole, above)
                line = f"node_unreachable  relay {lost.address} unreachable"
                await wait_for(lambda: any(line in s.text for s in app.events_log.lines))
                assert "unreachable (2/2 ranks)" in app.summary_bar.render().plain  # type: ignore[union-attr]

                back = Node(1, port=lost.port)  # the relay restarts, its ranks reconnect
                nodes.append(back)
                await wait_for(lambda: app._connections[back.address] == "connected")
                back.publish(2)
                await wait_for(lambda: statuses() == [RankStatus.ALIVE] * 4)
                kinds = [e.get("kind") for e in app.model.events]
                assert kinds.count("node_reachable") == 1

        asyncio.run(scenario())
    finally:
        for node in nodes:
            node.stop()
