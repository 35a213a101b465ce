"""Export a relay log to CSV (one row per rank-step) and TensorBoard event files.

Both stream the log (a long run's log need not fit in memory) and keep the first record
of each (rank, step): a publisher that resends after a reconnect must not double rows.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from fsdpx.telemetry.logfile import iter_log
from fsdpx.telemetry.protocol import EVENT_FIELDS, RECORD_FIELDS

TENSORBOARD_MISSING = (
    "TensorBoard export needs the optional `tensorboard` package, which is not installed: "
    "`pip install tensorboard`, then run the export again (CSV export works without it)"
)


class MissingDependency(ImportError):
    """An optional package an export needs is not installed."""


def iter_rank_steps(messages: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Records of `messages` in log order, the first of each (rank, step) only."""
    seen: set[tuple[int, int]] = set()
    for message in messages:
        if message.get("type") not in ("records", "history"):
            continue
        for rec in message.get("records") or ():
            if not isinstance(rec, dict):
                continue
            key = (rec.get("rank"), rec.get("step"))
            if type(key[0]) is not int or type(key[1]) is not int or key in seen:
                continue
            seen.add(key)  # type: ignore[arg-type]
            yield rec


def _events(messages: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for message in messages:
        if message.get("type") in ("events", "history"):
            yield from (e for e in message.get("events") or () if isinstance(e, dict))


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
        for k in EVENT_FIELDS
    ]


def export_csv(log: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write `records.csv` (one row per rank-step, columns RECORD_FIELDS, empty where
    unknown) and `events.csv` (EVENT_FIELDS; `detail` as JSON) into `out_dir`.

    Args:
        log: a relay log (`*.tlm`).
        out_dir: output folder, created if missing.
    Returns:
        (records.csv path, events.csv path).
    Raises:
        ValueError: `log` is not a telemetry log. OSError: unreadable/unwritable files.

    Example::

        records_csv, events_csv = export_csv("run.tlm", "out/")
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records_path, events_path = out / "records.csv", out / "events.csv"
    with open(records_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(RECORD_FIELDS)
        for rec in iter_rank_steps(iter_log(log)):
            writer.writerow([_cell(rec.get(k)) for k in RECORD_FIELDS])
    with open(events_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(EVENT_FIELDS)
        for event in _events(iter_log(log)):
            writer.writerow(_event_row(event))
    return records_path, events_path


def export_tensorboard(log: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write TensorBoard event files: one run folder per rank (`rank00000/`, ...), one
    scalar per numeric record field, at the record's step and wall time.

    Args:
        log: a relay log (`*.tlm`).
        out_dir: the TensorBoard log dir (`tensorboard --logdir out_dir`).
    Returns:
        The per-rank folders written.
    Raises:
        MissingDependency: the optional `tensorboard` package is not installed.

    Example::

        export_tensorboard("run.tlm", "tb/")
    """
    try:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError as exc:
        raise MissingDependency(TENSORBOARD_MISSING) from exc

    out = Path(out_dir)
    writers: dict[int, Any] = {}
    skip = {"rank", "local_rank", "pid", "step", "time", "host"}
    try:
        for rec in iter_rank_steps(iter_log(log)):
            rank = rec["rank"]
            if rank not in writers:
                writers[rank] = EventFileWriter(str(out / f"rank{rank:05d}"))
            values = [
                Summary.Value(tag=k, simple_value=float(v))
                for k, v in rec.items()
                if k not in skip and isinstance(v, int | float) and not isinstance(v, bool)
            ]
            t = rec.get("time")
            writers[rank].add_event(
                Event(
                    wall_time=float(t) if isinstance(t, int | float) else 0.0,
                    step=rec["step"],
                    summary=Summary(value=values),
                )
            )
    finally:
        for w in writers.values():
            w.close()
    return [out / f"rank{r:05d}" for r in sorted(writers)]
