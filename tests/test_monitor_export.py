"""`fsdpx-monitor export`: CSV (one row per rank-step) and TensorBoard event files."""

from __future__ import annotations

import csv
import importlib.util
import math
from pathlib import Path

import pytest

from fsdpx.telemetry.wire.logfile import open_log_writer
from fsdpx.telemetry.wire.protocol import EVENT_FIELDS, RECORD_FIELDS
from monitor.cli import main as monitor_main
from monitor.export import (
    EVENT_COLUMNS,
    RECORD_COLUMNS,
    TENSORBOARD_MISSING,
    MissingDependency,
    export_csv,
    export_tensorboard,
)
from monitor.synthetic import SyntheticRun

LOG = Path(__file__).parent / "data" / "monitor" / "run.tlm"
HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_csv_has_one_row_per_rank_step(tmp_path: Path) -> None:
    records_csv, events_csv = export_csv(LOG, tmp_path / "out")
    rows = read_csv(records_csv)
    # The run first (the key rows are told apart by), then every other record field.
    assert list(rows[0]) == list(RECORD_COLUMNS) and set(RECORD_COLUMNS) == set(RECORD_FIELDS)
    # 12 ranks x 80 steps, minus rank 9's steps 21..80 (it stopped publishing).
    assert len(rows) == 12 * 80 - 60
    assert len({(r["rank"], r["step"]) for r in rows}) == len(rows)
    run = SyntheticRun(n_ranks=12, seed=0, straggler=3)
    by_key = {(int(r["rank"]), int(r["step"])): r for r in rows}
    expected = run.record(3, 33)
    got = by_key[(3, 33)]
    assert float(got["step_time_s"]) == expected["step_time_s"]  # exact: repr round trip
    assert float(got["loss"]) == expected["loss"] and got["host"] == "node000"
    assert got["loss_scale"] == "" and got["skipped"] == "False"
    assert math.isnan(float(by_key[(7, 40)]["loss"]))
    events = read_csv(events_csv)
    assert list(events[0]) == list(EVENT_COLUMNS) and set(EVENT_COLUMNS) == set(EVENT_FIELDS)
    kinds = [e["kind"] for e in events]
    assert kinds.count("start") == 12 and kinds.count("exit") == 11
    assert kinds.count("checkpoint_saved") == 1


def test_csv_drops_resent_duplicates_and_reads_history(tmp_path: Path) -> None:
    run = SyntheticRun(n_ranks=2)
    log = tmp_path / "dup.tlm"
    with open_log_writer(log) as w:
        w.write_message({"type": "history", "records": run.records(1), "events": []})
        w.write_message({"type": "records", "records": run.records(1) + run.records(2)})
        w.write_message({"type": "records", "records": [{"rank": "x"}, run.record(0, 3)]})
    rows = read_csv(export_csv(log, tmp_path)[0])
    assert [(r["rank"], r["step"]) for r in rows] == [
        ("0", "1"), ("1", "1"), ("0", "2"), ("1", "2"), ("0", "3"),
    ]  # fmt: skip


def test_cli_export_csv_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert monitor_main(["export", str(LOG), "--csv", str(tmp_path / "csv")]) == 0
    assert "records.csv" in capsys.readouterr().out
    assert (tmp_path / "csv" / "events.csv").exists()
    assert monitor_main(["export", str(LOG)]) == 2
    err = capsys.readouterr().err
    assert "nothing to export: give --csv DIR, --tensorboard DIR, --jsonl FILE" in err
    assert monitor_main(["export", str(tmp_path / "nope.tlm"), "--csv", str(tmp_path)]) == 2
    assert "nope.tlm: No such file or directory" in capsys.readouterr().err


@pytest.mark.skipif(HAVE_TENSORBOARD, reason="tensorboard is installed")
def test_tensorboard_missing_gives_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(MissingDependency, match=r"needs the optional `tensorboard` package"):
        export_tensorboard(LOG, tmp_path)
    assert monitor_main(["export", str(LOG), "--tensorboard", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err
    assert TENSORBOARD_MISSING in err and "pip install tensorboard" in err


@pytest.mark.skipif(not HAVE_TENSORBOARD, reason="needs the optional tensorboard package")
def test_tensorboard_event_files_round_trip(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dirs = export_tensorboard(LOG, tmp_path)
    assert [d.name for d in dirs] == [f"rank{r:05d}" for r in range(12)]
    acc = EventAccumulator(str(tmp_path / "rank00003"))
    acc.Reload()
    step_times = acc.Scalars("step_time_s")
    assert [s.step for s in step_times] == list(range(1, 81))
    expected = SyntheticRun(n_ranks=12, seed=0, straggler=3).record(3, 10)["step_time_s"]
    assert step_times[9].value == pytest.approx(expected, rel=1e-6)
