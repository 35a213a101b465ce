"""Export a relay log to CSV (one row per rank-step) and TensorBoard event files.

Both stream the log (a long run's log need not fit in memory) and keep the first record
of each (run, rank, step): a publisher that resends after a reconnect must not double
rows, and a second run in the same log (a resume, or another job on a relay that
outlived the first) is kept apart by its `run_id` (fsdpx/telemetry/wire/runs.py [Note: run
identity]); `run=` picks one run.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpx.telemetry.wire.logfile import iter_log
from fsdpx.telemetry.wire.protocol import EVENT_FIELDS, RECORD_FIELDS
from fsdpx.telemetry.wire.runs import run_of

_RUN_FIRST = ("run_id", "job")
RECORD_COLUMNS = _RUN_FIRST + tuple(k for k in RECORD_FIELDS if k not in _RUN_FIRST)
"""records.csv columns: the run first (the key rows are told apart by), then the rest."""
EVENT_COLUMNS = ("run_id",) + tuple(k for k in EVENT_FIELDS if k != "run_id")

TENSORBOARD_MISSING = (
    "TensorBoard export needs the optional `tensorboard` package, which is not installed: "
    "`pip install tensorboard`, then run the export again (CSV export works without it)"
)


class MissingDependency(ImportError):
    """An optional package an export needs is not installed."""


@dataclass
class RunInfo:
    """One run of a log, as `log_runs` lists it."""

    run_id: str | None
    job: str | None = None
    ranks: int = 0
    first_step: int | None = None
    last_step: int | None = None

    def describe(self) -> str:
        name = "'' (records without a run id)" if self.run_id is None else repr(self.run_id)
        steps = (
            "no records"
            if self.first_step is None
            else (f"steps {self.first_step}-{self.last_step}, {self.ranks} ranks")
        )
        job = "" if self.job is None else f"job {self.job!r}, "
        return f"{name} ({job}{steps})"


def _items(messages: Iterable[dict[str, Any]], key: str) -> Iterator[dict[str, Any]]:
    kinds = ("records", "history") if key == "records" else ("events", "history")
    for message in messages:
        if message.get("type") in kinds:
            yield from (i for i in message.get(key) or () if isinstance(i, dict))


def log_runs(log: str | os.PathLike[str]) -> list[RunInfo]:
    """The runs of a relay log in order of first appearance (one pass over the log).

    Example::

        [r.run_id for r in log_runs("run.tlm")]  # ['20261125-175500-3fa2c1', ...]
    """
    runs: dict[str | None, RunInfo] = {}
    ranks: dict[str | None, set[Any]] = {}
    for message in iter_log(log):
        for key in ("records", "events"):
            for item in _items([message], key):
                run_id = run_of(item)
                info = runs.get(run_id)
                if info is None:
                    info = runs[run_id] = RunInfo(run_id)
                    ranks[run_id] = set()
                job = item.get("job") if key == "records" else None
                if info.job is None and type(job) is str:
                    info.job = job
                step = item.get("step")
                if key == "records" and type(step) is int:
                    ranks[run_id].add(item.get("rank"))
                    info.ranks = len(ranks[run_id])
                    info.first_step = (
                        step if info.first_step is None else min(info.first_step, step)
                    )
                    info.last_step = step if info.last_step is None else max(info.last_step, step)
    return list(runs.values())


def check_run(log: str | os.PathLike[str], run: str | None) -> None:
    """Raise a ValueError naming the log's runs when `run` is none of them (None: all)."""
    if run is None:
        return
    runs = log_runs(log)
    if any(r.run_id == (run or None) for r in runs):
        return
    listing = "; ".join(r.describe() for r in runs) or "none (the log has no records)"
    raise ValueError(f"no run {run!r} in {log}; its runs: {listing}")


def _in_run(item: dict[str, Any], run: str | None) -> bool:
    # "" names the records without a run id (an older publisher's); None: every run.
    return run is None or run_of(item) == (run or None)


def iter_rank_steps(
    messages: Iterable[dict[str, Any]], *, run: str | None = None
) -> Iterator[dict[str, Any]]:
    """Records of `messages` in log order, the first of each (run, rank, step) only.

    Args:
        messages: a log's messages (`iter_log`).
        run: keep only this run id ("": the records without one); None: every run.
    """
    seen: set[tuple[str | None, int, int]] = set()
    for rec in _items(messages, "records"):
        rank, step = rec.get("rank"), rec.get("step")
        if type(rank) is not int or type(step) is not int or not _in_run(rec, run):
            continue
        key = (run_of(rec), rank, step)
        if key in seen:
            continue
        seen.add(key)
        yield rec


def _events(messages: Iterable[dict[str, Any]], run: str | None) -> Iterator[dict[str, Any]]:
    yield from (e for e in _items(messages, "events") if _in_run(e, run))


def _json_safe(value: Any) -> Any:
    """`value` with NaN/inf floats as strings: strict JSON (jq, JavaScript) has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def to_json(value: Any) -> str:
    """A detail value as one line of strict JSON (double quotes, null/true/false), not a
    Python repr: any tool (pandas, jq, a spreadsheet) can read it back."""
    return json.dumps(_json_safe(value), ensure_ascii=False, allow_nan=False, default=str)


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, dict | list):
        return to_json(value)
    return value


def _event_row(event: dict[str, Any]) -> list[Any]:
    # `detail` is always JSON (a plain string detail too), so one parser reads the column.
    return [
        to_json(event[k]) if k == "detail" and event.get(k) is not None else _cell(event.get(k))
        for k in EVENT_COLUMNS
    ]


def export_csv(
    log: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, run: str | None = None
) -> tuple[Path, Path]:
    """Write `records.csv` (one row per run-rank-step, columns RECORD_COLUMNS: run_id
    and job first, empty where unknown) and `events.csv` (EVENT_COLUMNS; `detail` as JSON) into `out_dir`.

    Args:
        log: a relay log (`*.tlm`).
        out_dir: output folder, created if missing.
        run: export only this run id ("": the records without one); None: every run.
    Returns:
        (records.csv path, events.csv path).
    Raises:
        ValueError: `log` is not a telemetry log, or has no run `run` (the message lists
            its runs). OSError: unreadable/unwritable files.

    Example::

        records_csv, events_csv = export_csv("run.tlm", "out/")
    """
    check_run(log, run)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records_path, events_path = out / "records.csv", out / "events.csv"
    with open(records_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(RECORD_COLUMNS)
        for rec in iter_rank_steps(iter_log(log), run=run):
            writer.writerow([_cell(rec.get(k)) for k in RECORD_COLUMNS])
    with open(events_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(EVENT_COLUMNS)
        for event in _events(iter_log(log), run):
            writer.writerow(_event_row(event))
    return records_path, events_path


def export_tensorboard(
    log: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, run: str | None = None
) -> list[Path]:
    """Write TensorBoard event files: one run folder per rank (`rank00000/`, ...), one
    scalar per numeric record field, at the record's step and wall time. A log of several
    runs exported whole gets a folder per run (`<run_id>/rank00000/`; `no-run-id/` for
    records without one), so two runs' step 1 never land in one curve.

    Args:
        log: a relay log (`*.tlm`).
        out_dir: the TensorBoard log dir (`tensorboard --logdir out_dir`).
        run: export only this run id ("": the records without one); None: every run.
    Returns:
        The per-rank folders written.
    Raises:
        MissingDependency: the optional `tensorboard` package is not installed.
        ValueError: the log has no run `run` (the message lists its runs).

    Example::

        export_tensorboard("run.tlm", "tb/")
    """
    try:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError as exc:
        raise MissingDependency(TENSORBOARD_MISSING) from exc

    check_run(log, run)
    out = Path(out_dir)
    per_run = run is None and len(log_runs(log)) > 1
    writers: dict[Path, Any] = {}
    skip = {"rank", "local_rank", "pid", "step", "time", "host"}
    try:
        for rec in iter_rank_steps(iter_log(log), run=run):
            folder = out / f"rank{rec['rank']:05d}"
            if per_run:
                name = (run_of(rec) or "no-run-id").replace(os.sep, "_")  # a set id may hold "/"
                folder = out / name / folder.name
            if folder not in writers:
                writers[folder] = EventFileWriter(str(folder))
            values = [
                Summary.Value(tag=k, simple_value=float(v))
                for k, v in rec.items()
                if k not in skip and isinstance(v, int | float) and not isinstance(v, bool)
            ]
            t = rec.get("time")
            writers[folder].add_event(
                Event(
                    wall_time=float(t) if isinstance(t, int | float) else 0.0,
                    step=rec["step"],
                    summary=Summary(value=values),
                )
            )
    finally:
        for w in writers.values():
            w.close()
    return sorted(writers)
