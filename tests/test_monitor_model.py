"""The monitor's state store, outlier rules, replay player and table rules (no terminal)."""

from __future__ import annotations

import math
import random

import pytest

from monitor.model import Flag, MonitorModel, MonitorSettings, RankStatus
from monitor.replay import ReplayPlayer
from monitor.synthetic import SyntheticRun
from monitor.table_view import fit_columns, format_row, make_filter, order_rows


def feed(model: MonitorModel, run: SyntheticRun, steps: range) -> None:
    """Feed whole steps, each received at the step's own time."""
    for step in steps:
        model.add_records(run.records(step), now=run.time_of(step))


def test_latest_record_per_rank_and_summary() -> None:
    run = SyntheticRun(n_ranks=4, seed=1)
    model = MonitorModel()
    feed(model, run, range(1, 11))
    snap = model.snapshot(now=run.time_of(10))
    assert sorted(snap.rows) == [0, 1, 2, 3]
    assert all(row.record["step"] == 10 for row in snap.rows.values())
    s = snap.summary
    assert (s.step, s.min_step, s.alive, s.stale, s.dead) == (10, 10, 4, 0, 0)
    expected_loss = sum(run.record(r, 10)["loss"] for r in range(4)) / 4
    assert s.loss == pytest.approx(expected_loss)
    assert s.tokens_per_s == pytest.approx(sum(run.record(r, 10)["tokens_per_s"] for r in range(4)))
    assert s.elapsed_s == pytest.approx(run.time_of(10) - run.time_of(1))
    # The curves hold one point per step: the mean loss and the summed throughput.
    assert [p[0] for p in snap.loss_curve] == list(range(1, 11))
    assert snap.loss_curve[-1][1] == pytest.approx(expected_loss)
    assert snap.throughput_curve[-1][1] == pytest.approx(s.tokens_per_s)


def test_stale_then_dead_within_the_configured_time() -> None:
    settings = MonitorSettings(stale_after_s=3.0, dead_after_s=8.0)
    run = SyntheticRun(n_ranks=3, seed=0, step_time_s=1.0, stop_rank=2, stop_after_step=5)
    model = MonitorModel(settings)
    feed(model, run, range(1, 6))
    last_seen = run.time_of(5)
    for offset, expected in ((0.0, RankStatus.ALIVE), (2.9, RankStatus.ALIVE)):
        assert model.snapshot(last_seen + offset).rows[2].status is expected
    # The others keep publishing; rank 2 went silent after step 5.
    feed(model, run, range(6, 20))
    assert model.snapshot(last_seen + 3.1).rows[2].status is RankStatus.STALE
    snap = model.snapshot(last_seen + 3.1)
    assert snap.rows[2].flags & Flag.STALE and snap.summary.stale == 1
    assert model.snapshot(last_seen + 8.1).rows[2].status is RankStatus.DEAD
    # A record from it again makes it alive.
    model.add_records([run.record(2, 20)], now=last_seen + 9.0)
    assert model.snapshot(last_seen + 9.0).rows[2].status is RankStatus.ALIVE


def test_outliers_flag_only_the_injected_ranks() -> None:
    run = SyntheticRun(n_ranks=16, seed=3, straggler=4, memory_hog=9, nan_rank=12)
    model = MonitorModel()
    feed(model, run, range(1, 6))
    snap = model.snapshot(run.time_of(5))
    flagged = {rank: row.flags for rank, row in snap.rows.items() if row.flags}
    assert flagged == {4: Flag.STRAGGLER, 9: Flag.MEMORY, 12: Flag.NAN_LOSS}
    assert snap.summary.outliers == 3
    assert snap.rows[9].mem_fraction == pytest.approx((0.96 * run.capacity + 2**29) / run.capacity)
    # The NaN rank's loss is left out of the mean, not poisoning it.
    assert snap.summary.loss is not None and math.isfinite(snap.summary.loss)


def test_exit_exception_and_disconnect_events() -> None:
    run = SyntheticRun(n_ranks=3)
    model = MonitorModel()
    feed(model, run, range(1, 3))
    ev = {"host": "node000", "time": run.time_of(2), "step": 2}
    model.add_events(
        [
            {**ev, "rank": 0, "kind": "exit", "detail": {"reason": "finished"}},
            {**ev, "rank": 1, "kind": "exception", "detail": {"type": "RuntimeError"}},
            {**ev, "rank": 1, "kind": "exit", "detail": {"reason": "exception"}},
            {**ev, "rank": 2, "kind": "disconnected", "detail": "closed"},
        ]
    )
    rows = model.snapshot(run.time_of(2)).rows
    assert rows[0].status is RankStatus.EXITED and not rows[0].flags
    assert rows[1].status is RankStatus.DEAD and rows[1].flags & Flag.ERROR
    assert rows[2].status is RankStatus.DEAD
    assert [e["kind"] for e in model.rank_events(1)] == ["exception", "exit"]


def test_eta_and_missing_ranks_from_the_start_events() -> None:
    run = SyntheticRun(n_ranks=3, step_time_s=0.5)
    model = MonitorModel()
    model.add_events(run.start_events(total_steps=100))
    assert model.snapshot(run.time_of(0)).summary.missing == 3
    for step in range(1, 41):
        model.add_records(run.records(step)[:2], now=run.time_of(step))  # rank 2 never
    summary = model.snapshot(run.time_of(40)).summary
    assert summary.eta_s == pytest.approx(60 * 0.5, rel=0.05)
    assert summary.missing == 1


def test_malformed_records_are_counted_never_raised() -> None:
    rng = random.Random(0)
    junk: list[object] = [None, 3, "x", [], {}, {"rank": "0", "step": 1}, {"rank": 0}]
    fields = ("loss", "step_time_s", "mem_reserved", "device_mem_total", "tokens_per_s", "time")
    odd: dict[str, object] = {k: rng.choice([None, "x", [], {}, True]) for k in fields}
    junk.append({"rank": 1, "step": 2, **odd})
    model = MonitorModel()
    model.add_records(junk, now=1.0)
    model.add_events([None, "x", {"rank": "a"}, {"kind": "exit", "rank": 99}])
    snap = model.snapshot(2.0)
    assert model.bad_records == 7
    assert list(snap.rows) == [1]
    format_row(snap.rows[1], fit_columns(200))  # formats unknown types as "-"


def test_out_of_order_steps_keep_curves_sorted() -> None:
    run = SyntheticRun(n_ranks=2)
    model = MonitorModel(MonitorSettings(history_steps=5))
    for step in (1, 2, 4, 3, 5, 6, 7, 8, 2):
        model.add_records([run.record(0, step)], now=float(step))
    steps = [s for s, _ in model.snapshot(9.0).loss_curve]
    assert steps == [4, 5, 6, 7, 8]  # bounded, sorted, the late step 2 dropped


def test_settings_validation_messages() -> None:
    with pytest.raises(ValueError, match="stale_after_s <= dead_after_s"):
        MonitorSettings(stale_after_s=10, dead_after_s=5)
    with pytest.raises(ValueError, match="straggler_factor > 1"):
        MonitorSettings(straggler_factor=1.0)
    with pytest.raises(ValueError, match="0 < memory_fraction <= 1"):
        MonitorSettings(memory_fraction=1.5)


# --- replay player ----------------------------------------------------------------------


def test_replay_advance_pause_speed_and_seek() -> None:
    run = SyntheticRun(n_ranks=2, step_time_s=1.0)
    player = ReplayPlayer(run.messages(steps=10))
    assert player.duration == pytest.approx(10.0)
    first = player.seek(player.start)  # start events and nothing else at t=0
    assert [e["kind"] for e in first.events] == ["start", "start"] and not first.records
    step = player.advance(2.5)
    assert sorted({r["step"] for r in step.records}) == [1, 2]
    player.toggle_pause()
    assert player.advance(5.0).records == []
    player.toggle_pause()
    assert player.faster() == 2.0
    assert {r["step"] for r in player.advance(1.0).records} == {3, 4}
    back = player.seek(player.start + 1.5)
    assert back.reset and {r["step"] for r in back.records} == {1}
    forward = player.seek_relative(100.0)
    assert not forward.reset and player.finished
    assert max(r["step"] for r in forward.records) == 10
    assert forward.events[-1]["kind"] == "exit"
    with pytest.raises(ValueError, match="replay speed must be > 0"):
        ReplayPlayer([], speed=0)


# --- table rules ------------------------------------------------------------------------


def test_sort_filter_and_columns() -> None:
    run = SyntheticRun(n_ranks=16, seed=3, straggler=4, memory_hog=9, nan_rank=12)
    model = MonitorModel()
    feed(model, run, range(1, 4))
    rows = model.snapshot(run.time_of(3)).rows
    assert order_rows(rows, sort_key="step_time", descending=True, query="")[0] == 4
    assert order_rows(rows, sort_key="mem", descending=True, query="")[0] == 9
    assert order_rows(rows, sort_key="loss", descending=True, query="")[0] == 12
    assert order_rows(rows, sort_key="rank", descending=False, query="outliers") == [4, 9, 12]
    assert order_rows(rows, sort_key="rank", descending=False, query="8-11") == [8, 9, 10, 11]
    assert order_rows(rows, sort_key="rank", descending=False, query="node001 memory") == [9]
    assert not make_filter("stale")(rows[0])
    assert [c.key for c in fit_columns(80)] == [
        "rank", "node", "host", "status", "step", "step_time", "loss", "reserved", "mem", "age", "flags",
    ]  # fmt: skip
    assert len(fit_columns(200)) == 16
    with pytest.raises(ValueError, match="unknown sort key 'speed'"):
        order_rows(rows, sort_key="speed", descending=False, query="")


def test_elapsed_is_monotone_when_ranks_die_of_silence() -> None:
    """Stale, then dead by age: the clock stops when the monitor declared the last rank
    dead, never back at its last record (elapsed used to drop by dead_after)."""
    settings = MonitorSettings(stale_after_s=2.0, dead_after_s=5.0)
    model = MonitorModel(settings)
    model.add_records([{"rank": 0, "step": 1, "time": 0.0}], now=0.0)
    model.add_records([{"rank": 0, "step": 2, "time": 1.0}], now=1.0)
    elapsed = [model.snapshot(t / 2).summary.elapsed_s for t in range(0, 30)]
    assert elapsed == sorted(elapsed), elapsed
    assert model.snapshot(14.0).summary.dead == 1
    assert model.snapshot(14.0).summary.elapsed_s == 6.0  # last record + dead_after
