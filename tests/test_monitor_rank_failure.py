"""A rank killed mid-run and the rank it stopped are told apart (issue 13, item 5): the
killed rank disconnects without an exit event (dead, failed first); the survivor stops
with a RankFailureError naming it (exited: peer rank N failed). Not the same row twice."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from monitor.app import MonitorApp
from monitor.messages import TelemetryBatch
from monitor.model import Flag, MonitorModel, RankStatus
from monitor.screens.rank_detail import RankDetailScreen
from monitor.synthetic import SyntheticRun
from monitor.table_view import end_note, fmt_flags
from tests.test_monitor_app import screen_lines, table_lines

VANISHED = "rank 1 (pid 4242 on host node000) vanished: its process ended without recording"


def _failure_events(run: SyntheticRun, *, rank_0_first: bool) -> list[dict[str, Any]]:
    """Rank 1 SIGKILLed (the relay's disconnected event); rank 0 names it; rank 2 stopped
    too without knowing which rank failed (failed_rank nil)."""
    ev = {"host": "node000", "time": run.time_of(2), "step": 2}
    failure = {"type": "RankFailureError", "message": VANISHED, "traceback": "..."}
    killed = [{**ev, "rank": 1, "kind": "disconnected", "detail": {"reason": "closed"}}]
    stopped = [
        {**ev, "rank": 0, "kind": "exception", "detail": {**failure, "failed_rank": 1}},
        {**ev, "rank": 0, "kind": "exit", "detail": {"reason": "exception", "dropped": 0}},
        {**ev, "rank": 2, "kind": "exception", "detail": {**failure, "failed_rank": None}},
        {**ev, "rank": 2, "kind": "exit", "detail": {"reason": "exception", "dropped": 0}},
    ]
    return stopped + killed if rank_0_first else killed + stopped


@pytest.mark.parametrize("rank_0_first", [False, True])
def test_killed_rank_and_the_ranks_it_stopped_have_distinct_states(rank_0_first: bool) -> None:
    run = SyntheticRun(n_ranks=3)
    model = MonitorModel()
    for step in (1, 2):
        model.add_records(run.records(step), now=run.time_of(step))
    model.add_events(_failure_events(run, rank_0_first=rank_0_first))
    snap = model.snapshot(run.time_of(2))
    rows = snap.rows
    assert (rows[1].status, rows[1].flags) == (RankStatus.DEAD, Flag.STALE | Flag.FAILED_FIRST)
    assert (rows[0].status, rows[0].flags) == (RankStatus.EXITED, Flag.PEER_FAILED)
    assert (rows[2].status, rows[2].flags) == (RankStatus.EXITED, Flag.PEER_FAILED)
    assert (rows[0].stopped_by, rows[2].stopped_by) == (1, None)
    assert [fmt_flags(rows[r].flags) for r in range(3)] == ["P", "ZF", "P"]
    assert [end_note(rows[r]) for r in range(3)] == [
        ": peer rank 1 failed",
        " (failed first)",
        ": a peer rank failed",
    ]
    assert (snap.summary.dead, snap.summary.exited) == (1, 2)


def test_a_rank_that_raised_its_own_error_is_still_dead_and_named_first() -> None:
    run = SyntheticRun(n_ranks=2)
    model = MonitorModel()
    model.add_records(run.records(1), now=run.time_of(1))
    ev = {"host": "node000", "time": run.time_of(1), "step": 1}
    own = {"type": "ValueError", "message": "bad batch"}
    peer = {"type": "RankFailureError", "message": "rank 1 failed with ...", "failed_rank": 1}
    model.add_events(
        [
            {**ev, "rank": 1, "kind": "exception", "detail": own},
            {**ev, "rank": 1, "kind": "exit", "detail": {"reason": "exception"}},
            {**ev, "rank": 0, "kind": "exception", "detail": peer},
            {**ev, "rank": 0, "kind": "exit", "detail": {"reason": "exception"}},
        ]
    )
    rows = model.snapshot(run.time_of(1)).rows
    dead_first = Flag.STALE | Flag.ERROR | Flag.FAILED_FIRST
    assert (rows[1].status, rows[1].flags) == (RankStatus.DEAD, dead_first)
    assert (rows[0].status, rows[0].flags) == (RankStatus.EXITED, Flag.PEER_FAILED)


def test_table_and_detail_screen_show_who_failed_first() -> None:
    asyncio.run(_table_and_detail_screen())


async def _table_and_detail_screen() -> None:
    run = SyntheticRun(n_ranks=3, start_time=999.0)
    now = run.time_of(2)
    app = MonitorApp(sources=["/nonexistent/relay.sock"], clock=lambda: now)
    async with app.run_test(size=(100, 24)) as pilot:
        records = run.records(1) + run.records(2)
        events = _failure_events(run, rank_0_first=False)
        app.post_message(TelemetryBatch("test", records, events, received_at=now))
        await pilot.pause()
        app.refresh_view()
        await pilot.pause()
        rows = {int(line.split()[0]): line.split() for line in table_lines(app)[:3]}
        assert rows[0][2] == "exited" and rows[0][-1] == "P", rows[0]
        assert rows[1][2] == "dead" and rows[1][-1] == "ZF", rows[1]
        await pilot.press("enter")  # the cursor starts on rank 0
        await pilot.pause()
        assert isinstance(app.screen, RankDetailScreen) and app.screen.rank == 0
        assert "rank 0  exited: peer rank 1 failed" in "\n".join(screen_lines(app))
        await pilot.press("escape", "down", "enter")
        await pilot.pause()
        assert isinstance(app.screen, RankDetailScreen) and app.screen.rank == 1
        assert "rank 1  dead (failed first)" in "\n".join(screen_lines(app))
