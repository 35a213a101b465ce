"""Hang diagnosis (monitor/hangs.py, monitor/screens/hang.py): a 2-rank run where rank 0
blocks in an fsdpx.comm all-reduce that rank 1 has not reached. The monitor flags nothing
by time here; it asks (key `h`) every rank for a dump through the relay, and the ranks'
sender threads answer while rank 0's training thread is inside the gloo call: the report
shows rank 0 inside the all-reduce, rank 1's stack where it is, and names rank 1 as the
one that never arrived. Then rank 1 arrives and the run finishes normally."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from fsdpx.telemetry.wire.logfile import iter_log
from fsdpx.telemetry.wire.relay import Relay
from monitor.app import MonitorApp
from monitor.hangs import DumpBook, diagnose
from monitor.model import MonitorModel, MonitorSettings
from monitor.screens.hang import HangScreen
from monitor.state import Flag
from monitor.synthetic import SyntheticRun
from tests import telemetry_bodies
from tests.dist import run_ranks
from tests.test_monitor_app import screen_lines


def _dump(rank: int, entered: int, completed: int, where: str) -> dict[str, Any]:
    stack = f'  File "/x/train.py", line 7, in main\n  File "/x/y.py", line 3, in {where}\n'
    return {
        "rank": rank,
        "host": "node000",
        "request_id": "r1",
        "step": 2,
        "threads": [{"name": "MainThread", "main": True, "stack": stack}],
        "collectives": {
            "entered": entered,
            "completed": completed,
            "last": [
                {"seq": s, "kind": "all_reduce", "done": s < completed} for s in range(entered)
            ],
        },
    }


def test_diagnose_names_who_is_inside_and_who_never_arrived() -> None:
    report = diagnose(
        {
            0: _dump(0, 4, 3, "all_reduce"),
            1: _dump(1, 3, 3, "load"),
            2: _dump(2, 4, 3, "all_reduce"),
        },
        expected=[0, 1, 2, 3],
        request_id="r1",
    )
    assert report.stuck_in == (3, "all_reduce")
    assert report.never_arrived == [1] and report.no_answer == [3]
    assert report.ranks[1].where == "y.py:3 in load"
    assert report.lines()[0] == "stuck in all_reduce #3; never arrived: rank 1"
    assert diagnose({0: _dump(0, 2, 2, "step")}).stuck_in is None


def test_dump_book_keeps_requests_apart_and_counts_bad_dumps() -> None:
    book = DumpBook()
    book.start("a")
    assert book.add(_dump(0, 1, 0, "x")) and book.latest == "r1"  # another monitor's
    assert not book.add({"rank": "0", "request_id": "r1"})
    model = MonitorModel()
    model.add_dumps([_dump(0, 1, 0, "x"), "garbage"])
    assert model.bad_records == 1 and model.dumps.report().ranks[0].rank == 0


def test_a_rank_silent_for_many_median_steps_is_flagged_hung() -> None:
    run = SyntheticRun(n_ranks=3, stop_rank=2, stop_after_step=5)  # 0.2 s steps
    model = MonitorModel(MonitorSettings(hang_factor=10.0))
    for step in range(1, 21):
        model.add_records(run.records(step), now=run.time_of(step))
    rows = model.snapshot(run.time_of(20)).rows
    # Rank 2: silent for 15 steps (3 s) > 10 x 0.2 s; the others are fine.
    assert rows[2].flags & Flag.HUNG and not rows[0].flags & Flag.HUNG
    with pytest.raises(ValueError, match="expected hang_factor > 1, found 1.0"):
        MonitorSettings(hang_factor=1.0)


def test_dump_shows_rank_0_inside_the_collective_rank_1_never_arrived(tmp_path: Path) -> None:
    log = tmp_path / "run.tlm"
    relay = Relay(str(tmp_path / "relay.sock"), log_path=log)
    address = str(relay.bind())
    relay.start_thread()
    release = tmp_path / "release"
    results: list[Any] = []
    errors: list[BaseException] = []

    def ranks() -> None:
        try:
            results.extend(
                run_ranks(telemetry_bodies.skip_a_collective, 2, (address, str(release)))
            )
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
        finally:
            release.touch()  # never leave rank 1 waiting

    thread = threading.Thread(target=ranks)
    thread.start()
    try:
        asyncio.run(_diagnose_live(address, release, errors))
    finally:
        release.touch()
        thread.join(120)
        relay.stop()
    assert not errors, errors
    assert results == [2.0, 2.0]  # the run went on and finished after the dump
    dumps = [m for m in iter_log(log) if m["type"] == "dump"]
    assert {m["dump"]["rank"] for m in dumps} == {0, 1}  # stored in the log for replay
    asyncio.run(_replayed(log, _seq(release)))


def _seq(release: Path) -> int:
    """The comm-log number rank 0's all-reduce got (written before it entered it)."""
    return int(release.with_name("all_reduce_seq").read_text())


async def _replayed(log: Path, seq: int) -> None:
    """The log's dumps, replayed: the same verdict, no relay to ask."""
    app = MonitorApp(replay=log, speed=64.0)
    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(3000):
            if app.player is not None and app.player.finished:
                break
            await pilot.pause(0.02)
        await pilot.press("h")
        assert isinstance(app.screen, HangScreen)
        for _ in range(3000):  # a bound that only ends a failure
            if "never arrived: rank 1" in "\n".join(screen_lines(app)):
                break
            await pilot.pause(0.02)
        text = "\n".join(screen_lines(app))
        assert f"stuck in all_reduce #{seq}; never arrived: rank 1" in text


async def _diagnose_live(address: str, release: Path, errors: list[BaseException]) -> None:
    app = MonitorApp(sources=[address])
    async with app.run_test(size=(120, 40)) as pilot:

        async def until(done: Any, what: str) -> None:
            for _ in range(3000):  # a bound that only ends a failure
                if done() or errors:
                    break
                await pilot.pause(0.02)
            assert not errors, errors
            assert done(), f"never reached: {what}"

        def at_step_2() -> bool:
            rows = app.model.snapshot(0.0).rows
            return len(rows) == 2 and all(r.record["step"] == 2 for r in rows.values())

        await until(at_step_2, "both ranks at step 2")
        await pilot.press("h")
        assert isinstance(app.screen, HangScreen)

        def answered() -> bool:
            return len(app.model.dumps.requests.get(app.model.dumps.latest or "", {})) == 2

        # Rank 0 may not be inside the all-reduce yet when the first dumps are made: ask
        # again (key h) until its dump shows it there.
        for _ in range(200):
            await until(answered, "both ranks' dumps")
            if app.model.dumps.report().stuck_in is not None:
                break
            await pilot.press("h")
        report = app.model.dumps.report(expected=[0, 1])
        seq = _seq(release)
        assert report.stuck_in == (seq, "all_reduce"), report.lines()
        assert report.never_arrived == [1] and report.no_answer == []
        inside, elsewhere = report.ranks
        assert "all_reduce" in inside.stack and inside.inside == (seq, "all_reduce")
        assert elsewhere.where.endswith("in _elsewhere") and elsewhere.inside is None
        await until(lambda: "never arrived: rank 1" in "\n".join(screen_lines(app)), "shown")
        release.touch()
