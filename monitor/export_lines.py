"""Export a relay log as JSONL (one item per line, for any log pipeline) and as a
Prometheus text snapshot (each rank's latest record as gauges, the format the relay's
`--prometheus-port` serves: fsdpx/telemetry/wire/prometheus.py).

JSONL lines are strict JSON objects `{"type": "record" | "event" | "dump", ...the item's
fields}`, in log order, records deduplicated as in CSV (the first of each run, rank,
step). NaN and infinite floats, which strict JSON has no word for, are written as the
strings "nan", "inf" and "-inf"; `read_jsonl` turns them back into floats in the record
fields that are numbers (monitor/PROTOCOL.md), so a log round-trips.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fsdpx.telemetry.wire.logfile import iter_log
from fsdpx.telemetry.wire.prometheus import prometheus_text
from fsdpx.telemetry.wire.runs import run_of
from monitor.export import _in_run, _json_safe, check_run, iter_rank_steps

_STRING_FIELDS = frozenset({"host", "run_id", "job", "type"})
_NON_FINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _lines(log: str | os.PathLike[str], run: str | None) -> Iterator[dict[str, Any]]:
    # Records deduplicated as CSV rows are; events and dumps as they came, in log order.
    seen: set[tuple[Any, Any, Any]] = set()
    for message in iter_log(log):
        kind = message.get("type")
        if kind in ("records", "history"):
            for rec in iter_rank_steps([message], run=run):
                key = (run_of(rec), rec["rank"], rec["step"])
                if key not in seen:
                    seen.add(key)
                    yield {"type": "record", **rec}
        if kind in ("events", "history"):
            for event in message.get("events") or ():
                if isinstance(event, dict) and _in_run(event, run):
                    yield {"type": "event", **event}
        if kind == "dump" and isinstance(message.get("dump"), dict):
            dump = message["dump"]
            if _in_run(dump, run):
                yield {"type": "dump", **dump}


def export_jsonl(
    log: str | os.PathLike[str], out: str | os.PathLike[str], *, run: str | None = None
) -> int:
    """Write the log as JSONL to `out`; returns the lines written.

    Raises:
        ValueError: not a telemetry log, or no run `run` (the message lists its runs).

    Example::

        export_jsonl("run.tlm", "run.jsonl")
    """
    check_run(log, run)
    n = 0
    with open(out, "w", encoding="utf-8") as f:
        for item in _lines(log, run):
            f.write(json.dumps(_json_safe(item), ensure_ascii=False, allow_nan=False, default=str))
            f.write("\n")
            n += 1
    return n


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The items of an `export_jsonl` file, non-finite record numbers restored."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            item = json.loads(line)
            if item.get("type") == "record":
                for key, value in item.items():
                    if key not in _STRING_FIELDS and type(value) is str and value in _NON_FINITE:
                        item[key] = _NON_FINITE[value]
            out.append(item)
    return out


def export_prometheus(
    log: str | os.PathLike[str], out: str | os.PathLike[str], *, run: str | None = None
) -> Path:
    """Write each rank's latest record in the log as Prometheus gauges (text format 0.0.4)
    to `out` (e.g. for node_exporter's textfile collector).

    Raises:
        ValueError: not a telemetry log, or no run `run`.
    """
    check_run(log, run)
    latest: dict[tuple[Any, Any, Any], dict[str, Any]] = {}
    for rec in iter_rank_steps(iter_log(log), run=run):
        latest[(run_of(rec), rec.get("host"), rec["rank"])] = rec
    path = Path(out)
    path.write_text(prometheus_text(latest), encoding="utf-8")
    return path
