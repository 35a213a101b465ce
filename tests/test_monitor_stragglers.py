"""Straggler scores from a synthetic record stream (monitor/stragglers.py [Note: straggler
scoring]): a 4-rank run where rank 1 waits for its data loader, rank 2 is slow in forward
and rank 3 is slow in backward for 3 steps only. Ranks 1 and 2 become chronic stragglers
with the right phase (one event each), rank 3 is a one-off while slow and nothing after,
rank 0 never. Then the same stream through the app (Pilot), replayed and live."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fsdpx.telemetry.wire.protocol import PHASE_FIELDS
from monitor.app import MonitorApp
from monitor.messages import TelemetryBatch
from monitor.model import MonitorModel
from monitor.screens.stragglers import StragglersScreen, heat_strip
from monitor.stragglers import ScoreSettings, StragglerScores, compare_text
from monitor.synthetic import SlowPhase, SyntheticRun
from monitor.widgets.rank_table import RankTable
from tests.test_monitor_app import screen_lines, table_lines

STEPS = 30
ONE_OFF = range(10, 13)


def _run() -> SyntheticRun:
    return SyntheticRun(
        n_ranks=4,
        slow_phases=(
            SlowPhase(1, "data_wait_s", 0.15),
            SlowPhase(2, "forward_s", 0.2),
            SlowPhase(3, "backward_s", 0.3, steps=ONE_OFF),
        ),
    )


def _states(model: MonitorModel) -> dict[int, tuple[str, bool] | None]:
    rows = {r: model.stragglers.row(r) for r in range(4)}
    return {r: None if row is None else (row.phase, row.chronic) for r, row in rows.items()}


def test_chronic_and_one_off_stragglers_with_their_phase() -> None:
    run = _run()
    model = MonitorModel()
    seen_rank_3: list[tuple[str, bool] | None] = []
    for step in range(1, STEPS + 1):
        model.add_records(run.records(step), now=run.time_of(step))
        seen_rank_3.append(_states(model)[3])
    # Rank 3 was a one-off straggler in backward while slow, never chronic, then fine.
    assert ("backward", False) in seen_rank_3
    assert ("backward", True) not in seen_rank_3
    assert _states(model) == {0: None, 1: ("data_wait", True), 2: ("forward", True), 3: None}
    top = model.snapshot(run.time_of(STEPS)).stragglers
    assert [(r.rank, r.phase, r.chronic) for r in top] == [
        (1, "data_wait", True),
        (2, "forward", True),
    ]
    assert top[0].text().startswith("rank 1 on node000: data wait ")
    assert top[0].text().endswith(f"median, chronic for {top[0].chronic_steps} steps")
    assert top[0].relative is not None and top[0].relative < 1.0
    made = [e for e in model.events if e["kind"] == "straggler"]
    assert [(e["rank"], e["detail"]["phase"]) for e in made] == [(1, "data_wait"), (2, "forward")]
    assert model.take_made_events() == made and model.take_made_events() == []


def test_scores_are_fractions_and_waiting_is_not_a_cause() -> None:
    run = _run()
    scores = StragglerScores(ScoreSettings())
    for step in range(1, STEPS + 1):
        for rec in run.records(step):
            scores.add(rec["rank"], step, rec)
    for rank in range(4):
        for relative, individual in scores.scores(rank).values():
            for value in (relative, individual):
                assert value is None or 0.0 <= value <= 1.0
    # Rank 0 waited for the others in every step (its comm wait is the largest): that
    # is an effect, never named as its cause.
    assert scores.row(0) is None
    assert scores.heat("comm_wait")[0] is not None
    assert scores.heat("h2d") == dict.fromkeys(range(4))  # no offload: no h2d times


def _named(run: SyntheticRun, steps: int = STEPS) -> dict[int, tuple[str, bool] | None]:
    model = MonitorModel()
    model.add_events(run.start_events())
    for step in range(1, steps + 1):
        model.add_records(run.records(step), now=run.time_of(step))
    return _states(model)


def test_a_rank_slow_at_the_start_of_forward_is_named_by_its_compute_time() -> None:
    # Rank 2 computes 0.25 s more before its forward's first all-gather; the others wait
    # for it there, inside their own forward: every rank's forward_s is the same (the
    # slow rank sits at the median), only where the waits happened tells them apart.
    run = SyntheticRun(n_ranks=4, slow_phases=(SlowPhase(2, "forward_s", 0.25),))
    recs = run.records(5)
    forward = sorted(r["forward_s"] for r in recs)
    assert forward[-1] < 1.1 * forward[0]  # (the fixture is what a real run sends)
    assert _named(run) == {0: None, 1: None, 2: ("forward", True), 3: None}
    # The same records from an older publisher (no split): scored by forward time, as
    # before, the rank is not found; nor is a waiting rank named instead.
    old = SyntheticRun(n_ranks=4, slow_phases=(SlowPhase(2, "forward_s", 0.25),), comm_split=False)
    assert "comm_wait_forward_s" not in old.records(5)[0]
    assert _named(old) == dict.fromkeys(range(4))
    # Such records still name what they always did: a late data loader.
    loader = SyntheticRun(
        n_ranks=4, slow_phases=(SlowPhase(1, "data_wait_s", 0.15),), comm_split=False
    )
    assert _named(loader) == {0: None, 1: ("data_wait", True), 2: None, 3: None}


def test_a_wait_in_backward_makes_no_forward_straggler() -> None:
    # Rank 1 is slow in backward; the others wait for it in backward. Subtracting the
    # step's whole comm wait from forward (the reverted heuristic) would make the waiting
    # ranks' forward look fast and name rank 1 in forward; the split keeps the wait where
    # it happened.
    run = SyntheticRun(n_ranks=4, slow_phases=(SlowPhase(1, "backward_s", 0.3),))
    recs = run.records(5)
    heuristic = [r["forward_s"] - r["comm_wait_s"] for r in recs]
    assert heuristic[1] > 1.5 * max(h for i, h in enumerate(heuristic) if i != 1)
    assert _named(run) == {0: None, 1: ("backward", True), 2: None, 3: None}
    # A slow *end* of forward (after its last all-gather): the others wait in backward,
    # and the slow rank is named in forward, the waiting ranks in nothing.
    late_end = SlowPhase(3, "forward_s", 0.3, waited_in="backward_s")
    run = SyntheticRun(n_ranks=4, slow_phases=(late_end,))
    assert _named(run) == {0: None, 1: None, 2: None, 3: ("forward", True)}


def test_a_rank_without_the_split_is_not_named_for_waiting() -> None:
    # Rank 2 is slow at the start of its forward; the other 7 wait for it inside their
    # forward. Rank 5's records carry no usable comm wait for forward (an older publisher,
    # or a value that is not a time): its forward *time*, which holds the wait, must not be
    # compared with the others' forward *compute* times, or the rank that waited is named
    # a chronic forward straggler beside the one it waited for (review rev6).
    for missing in ("absent", None, float("nan"), "0.1", -1.0):
        run = SyntheticRun(n_ranks=8, slow_phases=(SlowPhase(2, "forward_s", 0.25),))
        model = MonitorModel()
        model.add_events(run.start_events())
        for step in range(1, STEPS + 1):
            records = run.records(step)
            for rec in records:
                if rec["rank"] == 5:
                    if missing == "absent":
                        del rec["comm_wait_forward_s"]
                    else:
                        rec["comm_wait_forward_s"] = missing
            model.add_records(records, now=run.time_of(step))
        named = {r: (row.phase, row.chronic) for r in range(8) if (row := model.stragglers.row(r))}
        assert 5 not in named, (missing, named)
        assert all(e["rank"] != 5 for e in model.events if e["kind"] == "straggler"), missing


def test_split_values_that_are_not_times_fall_back_to_the_phase_time() -> None:
    # A hostile or partial record: a split that is nil, negative or a string leaves the
    # phase scored by its time (every rank's, that step); a wait larger than the phase
    # makes its compute 0, not < 0.
    scores = StragglerScores(ScoreSettings())
    for step in range(1, 9):
        for rank in range(4):
            rec: dict[str, Any] = {f: 0.1 for f in PHASE_FIELDS}
            rec.update(comm_wait_forward_s=0.0, comm_wait_backward_s=0.0, comm_wait_optimizer_s=0.0)
            rec["step_time_s"] = 0.8
            if rank == 1:
                rec.update(forward_s=0.5, comm_wait_forward_s="0.4")  # not a time: 0.5
            if rank == 2:
                rec.update(backward_s=0.5, comm_wait_backward_s=-1.0)  # not a time: 0.5
            if rank == 3:
                rec.update(optimizer_s=0.1, comm_wait_optimizer_s=0.7)  # compute 0
            scores.add(rank, step, rec)
    assert {r: getattr(scores.row(r), "phase", None) for r in range(4)} == {
        0: None,
        1: "forward",
        2: "backward",
        3: None,
    }
    assert scores.heat("optimizer")[3] == 0.0


def test_records_without_phase_times_score_nothing() -> None:
    run = SyntheticRun(n_ranks=4, straggler=1)  # an old publisher: no phase fields
    model = MonitorModel()
    for step in range(1, 10):
        model.add_records(run.records(step), now=run.time_of(step))
    assert model.snapshot(run.time_of(9)).stragglers == []
    # Scored (with nothing to score) through step 8: without start events (no world
    # size) step 9 is complete only once a later step begins.
    assert model.stragglers.last_scored_step == 8
    model.add_events(run.start_events())
    model.add_records(run.records(10), now=run.time_of(10))
    assert model.stragglers.last_scored_step == 10


def test_a_rank_that_stops_reporting_does_not_hold_scoring_back() -> None:
    run = SyntheticRun(n_ranks=3, phases=True, stop_rank=2, stop_after_step=2)
    scores = StragglerScores(ScoreSettings())
    for step in range(1, 9):
        for rec in run.records(step):
            scores.add(rec["rank"], step, rec)
    assert scores.last_scored_step == 8 - 3  # CLOSE_LAG steps behind the newest


def test_a_phase_whose_median_is_near_zero_shows_the_excess_in_seconds() -> None:
    # Three ranks' loaders are instant (5 us), rank 1's takes 0.3 s: as a ratio that is
    # 60,000x median, which says nothing; the row and the event give +0.300 s instead.
    scores = StragglerScores(ScoreSettings())
    for step in range(1, 9):
        for rank in range(4):
            rec = {f: 0.1 for f in PHASE_FIELDS}
            rec["data_wait_s"] = 0.3 if rank == 1 else 5e-6
            rec["step_time_s"] = 0.8
            scores.add(rank, step, rec)
    row = scores.row(1)
    assert row is not None and row.phase == "data_wait" and row.chronic
    assert row.ratio is not None and row.ratio > 50_000
    assert row.text().startswith("rank 1: data wait +0.300 s over median, chronic for ")
    (event,) = scores.take_events()
    assert event["detail"]["message"] == "chronic straggler: data wait +0.300 s over median"
    # A ratio within RATIO_SHOWN_UP_TO stays a ratio.
    assert compare_text(2.25, 0.5) == "2.2x median"
    assert compare_text(None, None) == "- median"


def test_heat_strip_keeps_the_worst_rank_of_a_bucket() -> None:
    ratios: dict[int, float | None] = {r: 1.0 for r in range(100)}
    ratios[57] = 4.0
    ratios[3] = None
    strip = heat_strip(ratios, 10)
    assert len(strip.plain) == 10
    assert strip.plain[5] == "█" and strip.plain.count("█") == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"factor": 1.0}, "expected a straggler factor > 1, found 1.0"),
        ({"alpha": 0.0}, "expected 0 < straggler alpha <= 1, found 0.0"),
        ({"chronic_level": 1.5}, "expected 0 < chronic level <= 1, found 1.5"),
        ({"min_excess": -1.0}, "expected min_excess >= 0, found -1.0"),
    ],
)
def test_bad_score_settings_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ScoreSettings(**kwargs)


def _messages(run: SyntheticRun) -> list[dict[str, Any]]:
    return run.messages(STEPS)


async def _until(pilot: Any, done: Any, what: str, limit: int = 3000) -> None:
    """Let the app run until `done()` holds (a state, never a duration)."""
    for _ in range(limit):
        if done():
            return
        await pilot.pause(0.02)
    raise AssertionError(f"the app never reached the state: {what}")


def _shows(app: MonitorApp, text: str) -> bool:
    return isinstance(app.screen, StragglersScreen) and text in "\n".join(screen_lines(app))


def test_stragglers_screen_in_a_replay() -> None:
    async def scenario() -> None:
        app = MonitorApp(replay_messages=_messages(_run()), speed=1000.0)
        async with app.run_test(size=(100, 30)) as pilot:
            await _until(pilot, lambda: app.player is not None and app.player.finished, "end")
            await pilot.press("w")
            await _until(pilot, lambda: _shows(app, "rank 1 on node000: data wait"), "rank 1")
            lines = "\n".join(screen_lines(app))
            assert "rank 2 on node000: forward" in lines and "chronic for" in lines
            assert "chronic straggler: data wait" in lines  # the event
            assert "rank 3" not in lines.split("phase time")[0]  # the one-off is over
            assert "data wait      " in lines  # the heat strip's row
            await pilot.press("escape")
            await _until(pilot, lambda: not isinstance(app.screen, StragglersScreen), "back")

    asyncio.run(scenario())


def test_stragglers_screen_live() -> None:
    run = _run()
    now = run.time_of(STEPS)

    async def scenario() -> None:
        app = MonitorApp(sources=["/nonexistent/relay.sock"], clock=lambda: now)
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.press("w")
            await _until(pilot, lambda: _shows(app, "stragglers"), "the screen")
            for step in range(1, STEPS + 1):
                app.post_message(TelemetryBatch("test", run.records(step), [], received_at=now))
            await _until(pilot, lambda: _shows(app, "rank 2 on node000: forward"), "rank 2")
            assert "chronic straggler: forward" in "\n".join(screen_lines(app))

    asyncio.run(scenario())


def test_the_screen_opens_on_the_model_as_it_is_not_the_last_timer_snapshot() -> None:
    # The refresh timer never fires here (refresh_hz is tiny): records posted after the
    # app's first snapshot must still be on the screen when it opens. It used to draw
    # the timer's last snapshot beside the live model's events, so under load (a replay
    # ending between two timer ticks) the top list could lack a straggler whose event
    # was already shown.
    run = _run()
    now = run.time_of(STEPS)

    async def scenario() -> None:
        app = MonitorApp(sources=["/nonexistent/relay.sock"], clock=lambda: now, refresh_hz=1e-6)
        async with app.run_test(size=(100, 30)) as pilot:
            for step in range(1, STEPS + 1):
                app.post_message(TelemetryBatch("test", run.records(step), [], received_at=now))
            # (app.model is the shown run's: read it when asked, not before records came)
            await _until(pilot, lambda: 2 in {r.rank for r in app.model.stragglers.top(9)}, "2")
            await pilot.press("w")
            await _until(pilot, lambda: _shows(app, "scored through step"), "the screen")
            lines = "\n".join(screen_lines(app))
            assert "rank 1 on node000: data wait" in lines
            assert "rank 2 on node000: forward" in lines

    asyncio.run(scenario())


def test_outliers_key_lists_the_phase_stragglers() -> None:
    # In synchronous training a straggler's step time is everyone's (no rank's step time
    # is an outlier here), so the table's S flag also marks the ranks the straggler
    # scores list, and `o` shows them: ranks 1 (data wait) and 2 (forward), not the
    # one-off rank 3 once it is fast again.
    run = _run()
    now = run.time_of(STEPS)

    async def scenario() -> None:
        app = MonitorApp(sources=["/nonexistent/relay.sock"], clock=lambda: now)
        async with app.run_test(size=(100, 30)) as pilot:
            app.post_message(TelemetryBatch("test", [], run.start_events(), received_at=now))
            for step in range(1, STEPS + 1):
                app.post_message(TelemetryBatch("test", run.records(step), [], received_at=now))
            scored = lambda: app.model.stragglers.last_scored_step == STEPS  # noqa: E731
            await _until(pilot, scored, "every step scored")
            table = app.query_one(RankTable)
            await pilot.press("o")
            await _until(pilot, lambda: table.order == [1, 2], "the outliers only")
            rows = {int(line.split()[0]): line for line in table_lines(app)[:2]}
            assert rows[1].rstrip().endswith("S") and rows[2].rstrip().endswith("S")

    asyncio.run(scenario())
