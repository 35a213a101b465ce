"""Runs are kept apart (fsdpx/telemetry/wire/runs.py [Note: run identity]): two launches into
one relay log export as two runs with all their rows, every rank of a launch shares its
run id, the relay's history and the monitor's state never mix runs, old logs still read."""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Any

import pytest

from fsdpx.telemetry.wire.history import History
from fsdpx.telemetry.wire.logfile import iter_log, open_log_writer
from fsdpx.telemetry.wire.relay import Relay
from fsdpx.telemetry.wire.runs import RunIdentity, default_job, new_run_id
from fsdpx.telemetry.wire.transport import connect
from monitor.cli import main as monitor_main
from monitor.export import export_csv
from monitor.runs import RunBook
from monitor.state import Flag, MonitorSettings, RankStatus
from tests import telemetry_bodies
from tests.dist import run_ranks

OLD_LOG = Path(__file__).parent / "data" / "monitor" / "run.tlm"  # written before run ids


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_two_launches_into_one_log_are_two_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "job.tlm"
    relay = Relay(str(tmp_path / "relay.sock"), log_path=log)
    address = relay.bind()
    relay.start_thread()
    try:
        results = run_ranks(telemetry_bodies.two_runs_into_one_relay, 2, (str(address),))
    finally:
        relay.stop()
    # Both ranks of a launch agreed on its id; the second launch got a new one.
    assert results[0] == results[1]
    first, second = results[0]
    assert first != second

    # 2 launches x 2 ranks x 4 steps: every record is exported, none dropped as a duplicate.
    assert monitor_main(["export", str(log), "--csv", str(tmp_path / "all")]) == 0
    rows = read_csv(tmp_path / "all" / "records.csv")
    assert list(rows[0])[:3] == ["run_id", "job", "rank"]
    assert len(rows) == 2 * 2 * telemetry_bodies.RUNS_STEPS
    assert {r["run_id"] for r in rows} == {first, second}
    assert {r["job"] for r in rows} == {"nightly"}
    by_run = {run: [r for r in rows if r["run_id"] == run] for run in (first, second)}
    assert [float(r["loss"]) for r in by_run[second] if r["rank"] == "0"] == [11, 12, 13, 14]
    events = read_csv(tmp_path / "all" / "events.csv")
    starts = [(e["run_id"], e["rank"]) for e in events if e["kind"] == "start"]
    assert sorted(starts) == sorted([(first, "0"), (first, "1"), (second, "0"), (second, "1")])

    # --run picks one run; an unknown run is an error naming the runs there are.
    out = tmp_path / "second"
    assert monitor_main(["export", str(log), "--csv", str(out), "--run", second]) == 0
    picked = read_csv(out / "records.csv")
    assert len(picked) == 8 and {r["run_id"] for r in picked} == {second}
    assert {e["run_id"] for e in read_csv(out / "events.csv")} == {second}
    capsys.readouterr()
    assert monitor_main(["export", str(log), "--csv", str(out), "--run", "nope"]) == 2
    err = capsys.readouterr().err
    assert f"no run 'nope' in {log}; its runs: '{first}' (job 'nightly', steps 1-4, 2 ranks)" in err
    assert f"'{second}' (job 'nightly', steps 1-4, 2 ranks)" in err

    # The monitor, fed the whole log: two runs; the second starts clean (no error flag
    # from the failed first launch, its own loss curve) and is shown as a resume.
    book = RunBook(MonitorSettings())
    for message in iter_log(log):
        book.add_records(message.get("records") or [], now=None)
        book.add_events(message.get("events") or [])
    assert book.run_ids == [first, second] and book.newest == second
    old, new = book.model(first).snapshot(1e10), book.model(second).snapshot(1e10)
    assert all(Flag.ERROR in row.flags for row in old.rows.values())
    assert all(row.status is RankStatus.DEAD for row in old.rows.values())
    assert not any(Flag.ERROR in row.flags for row in new.rows.values())
    assert all(row.status is RankStatus.EXITED for row in new.rows.values())
    assert new.loss_curve == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 14.0)]
    assert book.label(second) == f"run 2/2 {second} job nightly (resume)"
    assert book.label(first) == f"run 1/2 {first} job nightly"


def test_run_identity_defaults() -> None:
    made = RunIdentity.for_launch(None, None, env={})
    assert made.job is None and made.run_id != RunIdentity.for_launch(None, None, env={}).run_id
    assert new_run_id(0.0).startswith("19700101-000000-")
    assert RunIdentity.for_launch("a", "j", env={"TORCHELASTIC_RUN_ID": "x"}) == RunIdentity(
        "a", "j"
    )
    # torchrun's rendezvous id names the job (the same for every restart); "none" is
    # what torchrun writes when no --rdzv-id was given, and names nothing.
    assert default_job({"TORCHELASTIC_RUN_ID": "slurm-42"}) == "slurm-42"
    assert default_job({"TORCHELASTIC_RUN_ID": "none"}) is None


def _record(run: str | None, rank: int, step: int, **kw: Any) -> dict[str, Any]:
    rec = {"rank": rank, "host": "h", "step": step, "time": 100.0 + step, "loss": 1.0, **kw}
    if run is not None:
        rec["run_id"] = run
    return rec


def test_relay_names_the_run_of_a_rank_that_disconnected(tmp_path: Path) -> None:
    relay = Relay(str(tmp_path / "r.sock"), log_path=tmp_path / "r.tlm")
    address = relay.bind()
    relay.start_thread()
    try:
        rank = connect(
            address, role="rank", secret=None, timeout_s=5, rank=3, host="h", pid=1, run_id="r1"
        )
        rank.close()  # gone without an exit event
        deadline = time.monotonic() + 60  # (only turns a hang into a failure)
        while relay.stats.accepted < 1 or relay._conns:
            assert time.monotonic() < deadline, relay.stats
            time.sleep(0.01)
    finally:
        relay.stop()
    events = [e for m in iter_log(tmp_path / "r.tlm") if m["type"] == "events" for e in m["events"]]
    assert [(e["kind"], e["rank"], e["run_id"]) for e in events] == [("disconnected", 3, "r1")]


def test_relay_history_keeps_runs_apart_and_bounded() -> None:
    history = History(recent=2, sparse=0, max_events=10, max_ranks=100, max_runs=2)
    history.add_records([_record("a", 0, s) for s in (1, 2)])
    history.add_records([_record("b", 0, s) for s in (1, 2)])
    # A rank's two runs have a history each: run b's steps do not push out run a's.
    assert history.num_ranks == 2 and history.runs == ["a", "b"]
    history.add_records([_record(None, 0, 1), _record("c", 0, 1)])
    assert history.runs == [None, "c"]  # the oldest runs are forgotten beyond max_runs


def test_monitor_runs_reset_state_and_old_records_are_one_run() -> None:
    book = RunBook(MonitorSettings())
    book.add_events([{"rank": 0, "kind": "start", "time": 10.0, "run_id": "a", "detail": {}}])
    book.add_records([_record("a", 0, s, time=10.0 + s) for s in (1, 2)], now=None)
    book.add_events([{"rank": 0, "kind": "exception", "time": 13.0, "run_id": "a"}])
    book.add_events([{"rank": 0, "kind": "start", "time": 50.0, "run_id": "b", "detail": {}}])
    book.add_records([_record("b", 0, 5, time=51.0, loss=3.0)], now=None)
    snap = book.model("b").snapshot(52.0)
    assert Flag.ERROR not in snap.rows[0].flags
    assert snap.loss_curve == [(5, 3.0)]
    assert snap.summary.elapsed_s == pytest.approx(2.0)  # from run b's start, not run a's
    assert Flag.ERROR in book.model("a").snapshot(14.0).rows[0].flags
    assert book.label("b") == "run 2/2 b (resume, from step 5)"

    legacy = RunBook(MonitorSettings())
    legacy.add_records([_record(None, r, 1) for r in range(3)] + [None], now=1.0)
    long_job = RunBook(MonitorSettings())
    long_job.add_records([_record("c", 0, 1, job="cd623b4b-6c8f-454f-8a0d-9330c874da62")], None)
    assert long_job.label("c") == "run 1/1 c job cd623b4b…"

    assert legacy.run_ids == [None] and legacy.model(None).bad_records == 1
    assert len(legacy.model(None).snapshot(1.0).rows) == 3


def test_old_log_exports_as_one_unnamed_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = read_csv(export_csv(OLD_LOG, tmp_path / "all")[0])
    assert len(rows) == 12 * 80 - 60 and {r["run_id"] for r in rows} == {""}
    assert len(read_csv(export_csv(OLD_LOG, tmp_path / "one", run="")[0])) == len(rows)
    with pytest.raises(
        ValueError, match=r"no run 'x' in .*; its runs: '' \(records without a run id\)"
    ):
        export_csv(OLD_LOG, tmp_path / "none", run="x")


def test_mixed_log_tensorboard_gets_a_folder_per_run(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from monitor.export import export_tensorboard

    log = tmp_path / "mixed.tlm"
    with open_log_writer(log) as w:
        w.write_message({"type": "records", "records": [_record(None, 0, 1), _record("b", 0, 1)]})
    dirs = export_tensorboard(log, tmp_path / "tb")
    assert dirs == [
        tmp_path / "tb" / "b" / "rank00000",
        tmp_path / "tb" / "no-run-id" / "rank00000",
    ]
    assert export_tensorboard(log, tmp_path / "tb1", run="b") == [tmp_path / "tb1" / "rank00000"]
