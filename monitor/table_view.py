"""Columns, sorting, filtering and cell formatting of the rank table (pure, no Textual).

The widget (monitor/widgets/rank_table.py) asks this module for the row order once per
refresh and for the text of the few rows on screen; keeping it here lets the tests check
sort and filter rules without a terminal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from monitor.state import Flag, RankRow, RankStatus
from monitor.units import fmt_bytes


@dataclass(frozen=True)
class Column:
    """One table column: header, width, how to format a row, and how it gives way when
    the terminal is too narrow (see `fit_columns`)."""

    key: str
    title: str
    width: int
    cell: Callable[[RankRow], str]
    drop: int = 0
    """Drop priority: the highest goes first when the terminal is too narrow; 0: never."""
    align_left: bool = False
    source: str | None = None
    """The record field shown; a column whose field no rank reports (device memory on a
    CPU run) is hidden before any column with data is dropped. None: always kept."""
    drop_without_device: int | None = None
    """`drop` when no rank reports device memory (a CPU run), if different."""


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def fmt_float(value: Any, digits: int = 3) -> str:
    """A number for a cell: fixed digits, `nan`/`inf` spelled out, `-` when unknown."""
    v = _num(value)
    if v is None:
        return "-"
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.{digits}f}"


def fmt_si(value: Any) -> str:
    """A rate with an SI suffix (12.3k, 4.56M), `-` when unknown."""
    v = _num(value)
    if v is None or not math.isfinite(v):
        return "-"
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= limit:
            return f"{v / limit:.3g}{suffix}"
    return f"{v:.3g}"


def fmt_duration(seconds: float | None) -> str:
    """Seconds as H:MM:SS (or M:SS), `-` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = int(seconds)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def fmt_age(seconds: float) -> str:
    """A last-seen age: 0.4s, 12s, 3m, 2h."""
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


FLAG_LETTERS: tuple[tuple[Flag, str], ...] = (
    (Flag.STRAGGLER, "S"),
    (Flag.MEMORY, "M"),
    (Flag.NAN_LOSS, "N"),
    (Flag.STALE, "Z"),
    (Flag.ERROR, "E"),
    (Flag.FAILED_FIRST, "F"),
    (Flag.PEER_FAILED, "P"),
    (Flag.HUNG, "H"),
    (Flag.UNREACHABLE, "U"),
)
"""Letters of the flags column; the summary bar shows the legend."""


def fmt_flags(flags: Flag) -> str:
    return "".join(letter for flag, letter in FLAG_LETTERS if flag & flags)


def end_note(row: RankRow) -> str:
    """How the rank's end relates to the others': ': peer rank N failed' for a rank that
    stopped because of another, ' (failed first)' for the rank another one named."""
    if row.flags & Flag.PEER_FAILED:
        peer = "a peer rank" if row.stopped_by is None else f"peer rank {row.stopped_by}"
        return f": {peer} failed"
    return " (failed first)" if row.flags & Flag.FAILED_FIRST else ""


def _mem_pct(row: RankRow) -> str:
    return "-" if row.mem_fraction is None else f"{100 * row.mem_fraction:.0f}%"


def _util(row: RankRow) -> str:
    v = _num(row.record.get("device_util"))
    return "-" if v is None else f"{v:.0f}%"


def _node(row: RankRow) -> str:
    node = row.record.get("node")
    return str(node) if type(node) is int else "-"


def _state(row: RankRow) -> str:
    # "unreachable" does not fit the 6-cell column; the U flag and the nodes line say it whole.
    return "unrch" if row.status is RankStatus.UNREACHABLE else row.status.value


def _bytes_cell(field: str) -> Callable[[RankRow], str]:
    return lambda r: fmt_bytes(r.record.get(field), compact=True)


COLUMNS: tuple[Column, ...] = (
    Column("rank", "rank", 5, lambda r: str(r.rank)),
    # The node rank (fsdpx/telemetry/node.py): hidden on a narrow terminal when no rank
    # names one (a single-node run), else kept ahead of the host name.
    Column("node", "node", 4, _node, 1, source="node"),
    Column("host", "host", 9, lambda r: str(r.record.get("host") or "-")[:9], 2, True),
    Column("status", "state", 6, _state, 0, True),
    Column("step", "step", 7, lambda r: str(r.record.get("step"))),
    Column("step_time", "step_s", 7, lambda r: fmt_float(r.record.get("step_time_s"), 3)),
    Column("loss", "loss", 8, lambda r: fmt_float(r.record.get("loss"), 4)),
    Column("alloc", "alloc", 6, _bytes_cell("mem_allocated"), 4, source="mem_allocated"),
    Column("reserved", "resv", 6, _bytes_cell("mem_reserved"), source="mem_reserved"),
    Column("peak", "peak", 6, _bytes_cell("mem_peak"), 5, source="mem_peak"),
    Column("capacity", "cap", 6, _bytes_cell("device_mem_total"), 3, source="device_mem_total"),
    Column("mem", "mem%", 5, _mem_pct, source="device_mem_total"),
    Column("util", "util", 5, _util, 6, source="device_util"),
    # Host memory: next to device memory the first to go, but on a CPU run the only
    # memory there is, kept longer than the host names (the filter still matches hosts).
    Column("rss", "rss", 6, _bytes_cell("host_rss"), 7, source="host_rss", drop_without_device=1),
    Column("age", "age", 6, lambda r: fmt_age(r.age_s)),
    # 6 wide: "flags" and the sort arrow.
    Column("flags", "flags", 6, lambda r: fmt_flags(r.flags), 0, True),
)

_DEVICE_MEMORY_FIELDS = ("mem_allocated", "mem_reserved", "device_mem_total")


def _line_width(columns: Sequence[Column]) -> int:
    return sum(c.width + 1 for c in columns) - 1  # one space between columns


def fit_columns(
    width: int, columns: Sequence[Column] = COLUMNS, rows: Mapping[int, RankRow] | None = None
) -> list[Column]:
    """The columns that fit in `width` cells; the rest scroll horizontally.

    When all do not fit, columns whose `source` field no row reports are hidden first
    (always-empty device columns on a CPU run), then columns are dropped by priority.
    With enough room every column stays, so the layout does not jump as data arrives.
    """
    kept = list(columns)
    if _line_width(kept) <= width:
        return kept
    device = True
    if rows is not None:
        values = list(rows.values())
        kept = [
            c
            for c in kept
            if c.source is None or any(r.record.get(c.source) is not None for r in values)
        ]
        device = any(r.record.get(f) is not None for r in values for f in _DEVICE_MEMORY_FIELDS)

    def priority(c: Column) -> int:
        if not device and c.drop_without_device is not None:
            return c.drop_without_device
        return c.drop

    droppable = sorted((c for c in kept if priority(c)), key=lambda c: -priority(c))
    while droppable and _line_width(kept) > width:
        kept.remove(droppable.pop(0))
    return kept


def format_row(row: RankRow, columns: Sequence[Column]) -> str:
    """One row's text, columns padded to their widths."""
    cells = []
    for col in columns:
        text = col.cell(row)[: col.width]
        cells.append(text.ljust(col.width) if col.align_left else text.rjust(col.width))
    return " ".join(cells)


def format_header(columns: Sequence[Column], sort_key: str, descending: bool) -> str:
    """The header line; the sort column carries an arrow."""
    cells = []
    for col in columns:
        title = col.title[: col.width]
        if col.key == sort_key:
            # The arrow always shows: a title too long for it gives up its last letter.
            title = title[: col.width - 1] + ("↓" if descending else "↑")
        cells.append(title.ljust(col.width) if col.align_left else title.rjust(col.width))
    return " ".join(cells)


_STATUS_ORDER = {
    RankStatus.DEAD: 0,
    RankStatus.UNREACHABLE: 1,
    RankStatus.STALE: 2,
    RankStatus.ALIVE: 3,
    RankStatus.EXITED: 4,
}


def _sort_value(row: RankRow, key: str) -> float:
    rec = row.record
    value: float | None
    if key == "rank":
        return float(row.rank)
    if key == "step":
        value = _num(rec.get("step"))
    elif key == "step_time":
        value = _num(rec.get("step_time_s"))
    elif key == "loss":
        value = _num(rec.get("loss"))
        if value is not None and math.isnan(value):
            value = math.inf  # NaN sorts as the worst loss, not randomly
    elif key == "mem":
        value = row.mem_fraction
    elif key == "util":
        value = _num(rec.get("device_util"))
    elif key == "age":
        value = row.age_s
    elif key == "status":
        value = float(_STATUS_ORDER[row.status])
    elif key == "flags":
        value = float(bin(row.flags.value).count("1"))
    else:
        raise ValueError(f"unknown sort key {key!r}; expected one of {SORT_KEYS}")
    return -math.inf if value is None else value


SORT_KEYS: tuple[str, ...] = (
    "rank",
    "step_time",
    "loss",
    "mem",
    "step",
    "util",
    "age",
    "flags",
    "status",
)
"""Sort keys in the order the `s` key cycles through them."""


Predicate = Callable[[RankRow], bool]


def _rank_between(lo: int, hi: int) -> Predicate:
    return lambda row: lo <= row.rank <= hi


def _status_is(status: RankStatus) -> Predicate:
    return lambda row: row.status is status


def _has_flag(flag: Flag) -> Predicate:
    return lambda row: bool(row.flags & flag)


def _node_is(node: int) -> Predicate:
    return lambda row: row.record.get("node") == node


def _host_contains(text: str) -> Predicate:
    return lambda row: text in str(row.record.get("host") or "").lower()


_FLAG_WORDS = {
    "outliers": ~Flag.NONE,
    "outlier": ~Flag.NONE,
    "straggler": Flag.STRAGGLER,
    "memory": Flag.MEMORY,
    "nan": Flag.NAN_LOSS,
    "error": Flag.ERROR,
    "first": Flag.FAILED_FIRST,
    "peer": Flag.PEER_FAILED,
    "hung": Flag.HUNG,
    "unreachable": Flag.UNREACHABLE,
}


def make_filter(query: str) -> Predicate:
    """A row predicate from the filter box's text.

    Terms, separated by spaces, all must match: `12` (rank 12), `8-15` (ranks 8..15),
    `outliers` (any flag), `stale`/`dead`/`alive`/`exited` (status), `straggler`, `memory`,
    `nan`, `error`, `first`, `peer`, `unreachable` (a flag), `node:3` (the ranks of node 3),
    anything else: a substring of the host name.

    Example::

        keep = make_filter("node003 outliers")
    """
    preds: list[Predicate] = []
    for term in query.lower().split():
        lo, dash, hi = term.partition("-")
        node = term.removeprefix("node:")
        if node != term and node.isdigit():
            preds.append(_node_is(int(node)))
        elif term.isdigit():
            preds.append(_rank_between(int(term), int(term)))
        elif dash and lo.isdigit() and hi.isdigit():
            preds.append(_rank_between(int(lo), int(hi)))
        elif term in _FLAG_WORDS:
            preds.append(_has_flag(_FLAG_WORDS[term]))
        elif term in {s.value for s in RankStatus}:
            preds.append(_status_is(RankStatus(term)))
        else:
            preds.append(_host_contains(term))
    return lambda row: all(p(row) for p in preds)


def order_rows(
    rows: dict[int, RankRow], *, sort_key: str, descending: bool, query: str
) -> list[int]:
    """Ranks to show, filtered by `query` and sorted by `sort_key` (ties by rank)."""
    keep = make_filter(query) if query.strip() else None
    selected = [r for r in rows.values() if keep is None or keep(r)]
    selected.sort(key=_RANK)
    if sort_key == "rank":  # (the default: one sort, its key read in C)
        if descending:
            selected.reverse()
    else:
        selected.sort(key=lambda r: _sort_value(r, sort_key), reverse=descending)
    return [r.rank for r in selected]


_RANK = attrgetter("rank")


def filter_title(query: str, shown: int, total: int) -> str:
    """The table's title under a filter: `outliers only (3 of 12 ranks)`; "" unfiltered."""
    terms = query.lower().split()
    if not terms:
        return ""
    what = "outliers only" if terms == ["outliers"] else f"filter: {' '.join(terms)}"
    return f"{what} ({shown} of {total} ranks)"


def empty_note(query: str, total: int) -> str:
    """The line an empty table shows: no ranks yet, no outliers, or nothing matches."""
    terms = query.lower().split()
    if total == 0:
        return "no ranks heard from yet"
    if terms == ["outliers"]:
        return f"no outliers among {total} ranks"
    return f"no ranks match the filter '{' '.join(terms)}' ({total} ranks in all)"
