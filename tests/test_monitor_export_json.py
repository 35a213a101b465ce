"""events.csv's `detail` column is strict JSON that any tool reads back (not a Python repr)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from fsdpx.telemetry.wire.logfile import open_log_writer
from monitor.export import export_csv


def test_events_csv_detail_is_json(tmp_path: Path) -> None:
    details = [
        {"path": "ckpt/10", "bytes": 3 << 30, "ok": True, "note": None, "sizes": [1, 2.5]},
        "plain text, with a comma",
        {"loss_scale": float("nan"), "limit": float("inf")},
    ]
    log = tmp_path / "run.tlm"
    with open_log_writer(log) as writer:
        events = [
            {"rank": 0, "host": "h", "time": 1.0, "kind": "checkpoint_saved", "step": i,
             "detail": d}
            for i, d in enumerate(details)
        ]  # fmt: skip
        events.append({"rank": 0, "host": "h", "time": 2.0, "kind": "exit", "step": None})
        writer.write_message({"type": "events", "events": events})
    _, events_csv = export_csv(log, tmp_path / "out")
    with open(events_csv, newline="") as f:
        cells = [row["detail"] for row in csv.DictReader(f)]
    assert json.loads(cells[0]) == details[0]
    assert cells[0].startswith('{"path": "ckpt/10"') and "true" in cells[0] and "null" in cells[0]
    assert json.loads(cells[1]) == "plain text, with a comma"
    # Strict JSON has no NaN: non-finite numbers are spelled as strings.
    assert json.loads(cells[2]) == {"loss_scale": "nan", "limit": "inf"}
    assert cells[3] == ""  # no detail: an empty cell
