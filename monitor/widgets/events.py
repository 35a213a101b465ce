"""The events log: start, checkpoints, overflow skips, exceptions, exits."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.text import Text
from textual.widgets import RichLog

from monitor.table_view import fmt_float
from monitor.units import fmt_bytes

_STYLES = {
    "exception": "bold red",
    "overflow": "yellow",
    "checkpoint_saved": "green",
    "checkpoint_loaded": "green",
    "exit": "dim",
    "start": "dim",
    "node_unreachable": "bold red",
    "node_reachable": "green",
}


def describe(event: dict[str, Any], t0: float | None) -> Text:
    """One event as a line: run-relative time (never the wall clock), step, rank, kind,
    and the detail's size/duration/message."""
    t = event.get("time")
    when = "-"
    if isinstance(t, int | float) and t0 is not None:
        when = f"+{t - t0:.1f}s"
    kind = str(event.get("kind"))
    detail = event.get("detail")
    parts: list[str] = []
    if isinstance(detail, dict):
        if "bytes" in detail:
            parts.append(fmt_bytes(detail["bytes"]))
        if "duration_s" in detail:
            parts.append(f"{fmt_float(detail['duration_s'], 2)}s")
        if "loss_scale" in detail:
            parts.append(f"loss scale {detail['loss_scale']}")
        for key in ("type", "message", "reason", "path"):
            if detail.get(key):
                parts.append(str(detail[key]))
    elif detail:
        parts.append(str(detail))
    line = Text(no_wrap=True, overflow="ellipsis")
    line.append(f"{when:>9} ", "dim")
    step = event.get("step")
    rank = event.get("rank")  # None: an event of a node (its relay lost or back)
    where = "" if rank is None else f" rank {rank}"
    line.append(f"step {'-' if step is None else step}{where} ", "dim")
    line.append(kind, _STYLES.get(kind, ""))
    if parts:
        line.append("  " + "  ".join(parts).splitlines()[0] if parts else "")
    return line


class EventsLog(RichLog):
    """Scrolling log of events, newest at the bottom."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, max_lines=1000, wrap=False, auto_scroll=True)

    def add(self, events: Iterable[dict[str, Any]], t0: float | None) -> None:
        for event in events:
            if isinstance(event, dict):  # anything else was counted and skipped upstream
                self.write(describe(event, t0))

    def reset(self, events: Iterable[dict[str, Any]], t0: float | None) -> None:
        self.clear()
        self.add(events, t0)
