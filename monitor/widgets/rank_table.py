"""The per-rank table: a Line API widget that renders only the rows on screen.

[Note: why not DataTable] DataTable keeps a cell object per value and re-renders every
visible cell on any change; at 1,024 ranks updated 5 times a second it was measured at
~70% of a core. Here a refresh is: sort the snapshot's ranks once (C-speed `list.sort`),
then `render_line` formats only the `height` rows Textual asks for. Cost scales with the
terminal's height, not with the number of ranks (benchmarks/monitor_cpu.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding
from textual.events import Click
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from monitor.state import Flag, RankRow, RankStatus, Snapshot
from monitor.table_view import (
    SORT_KEYS,
    Column,
    empty_note,
    filter_title,
    fit_columns,
    format_header,
    format_row,
    order_rows,
)


class RankTable(ScrollView, can_focus=True):
    """Per-rank rows of the latest snapshot; sort (`s`, `r`), cursor, enter for details."""

    COMPONENT_CLASSES = {
        "rank-table--header",
        "rank-table--cursor",
        "rank-table--straggler",
        "rank-table--memory",
        "rank-table--nan",
        "rank-table--stale",
        "rank-table--dead",
        "rank-table--exited",
        "rank-table--note",
    }

    BINDINGS = [
        Binding("up", "cursor(-1)", "up", show=False),
        Binding("down", "cursor(1)", "down", show=False),
        Binding("pageup", "page(-1)", "page up", show=False),
        Binding("pagedown", "page(1)", "page down", show=False),
        Binding("home", "jump(0)", "first", show=False),
        Binding("end", "jump(-1)", "last", show=False),
        Binding("enter", "select", "details"),
        Binding("s", "cycle_sort", "sort"),
        Binding("r", "reverse_sort", "reverse", show=False),
    ]

    @dataclass
    class RankSelected(Message):
        """Enter (or a click) on a row: open the rank's detail screen."""

        rank: int

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.sort_key = "rank"
        self.descending = False
        self.filter_text = ""
        self.order: list[int] = []
        self.cursor = 0
        self._rows: dict[int, RankRow] = {}
        self._columns: list[Column] = fit_columns(80)
        self._base_style: Style | None = None
        """`rich_style` (it walks the ancestors' styles: costly per line); reset when
        Textual says styles changed (`notify_style_update`)."""

    # --- data ---------------------------------------------------------------------

    def show(self, snapshot: Snapshot) -> None:
        """Take a new snapshot: re-sort, re-filter, keep the cursor on the same rank."""
        current = self.order[self.cursor] if 0 <= self.cursor < len(self.order) else None
        self._rows = snapshot.rows
        self._reorder(current)

    def _reorder(self, keep_rank: int | None) -> None:
        self.order = order_rows(
            self._rows, sort_key=self.sort_key, descending=self.descending, query=self.filter_text
        )
        # A filtered table says so on its top border: a hidden filter (the `o` key) must
        # not make a short or empty table look like the whole run.
        self.border_title = filter_title(self.filter_text, len(self.order), len(self._rows))
        if keep_rank is not None and keep_rank in self._rows:
            try:
                self.cursor = self.order.index(keep_rank)
            except ValueError:
                self.cursor = min(self.cursor, max(0, len(self.order) - 1))
        else:
            self.cursor = min(self.cursor, max(0, len(self.order) - 1))
        self._columns = fit_columns(max(20, self.scrollable_content_region.width), rows=self._rows)
        width = sum(c.width + 1 for c in self._columns) - 1
        self.virtual_size = Size(width, len(self.order) + 1)
        self.refresh()

    def set_query(self, query: str) -> None:
        """Filter rows (see monitor.table_view.make_filter for the syntax)."""
        self.filter_text = query
        self.cursor = 0
        self._reorder(None)
        self.scroll_to(y=0, animate=False)

    def set_sort(self, key: str, *, descending: bool | None = None) -> None:
        """Sort by `key` (one of monitor.table_view.SORT_KEYS)."""
        if key not in SORT_KEYS:
            raise ValueError(f"unknown sort key {key!r}; expected one of {SORT_KEYS}")
        self.sort_key = key
        if descending is not None:
            self.descending = descending
        # A new order is read from its top: the cursor goes to the first row.
        self.cursor = 0
        self._reorder(None)
        self.scroll_to(y=0, animate=False)

    @property
    def selected_rank(self) -> int | None:
        """The rank under the cursor (None when the table is empty)."""
        return self.order[self.cursor] if 0 <= self.cursor < len(self.order) else None

    # --- rendering ----------------------------------------------------------------

    def on_resize(self) -> None:
        self._reorder(self.selected_rank)

    def _row_style(self, row: RankRow) -> Style:
        name = None
        if row.status is RankStatus.DEAD or row.flags & Flag.ERROR:
            name = "rank-table--dead"
        elif row.flags & Flag.NAN_LOSS:
            name = "rank-table--nan"
        elif row.status is RankStatus.STALE or row.status is RankStatus.UNREACHABLE:
            name = "rank-table--stale"
        elif row.flags & Flag.MEMORY:
            name = "rank-table--memory"
        elif row.flags & Flag.STRAGGLER:
            name = "rank-table--straggler"
        elif row.status is RankStatus.EXITED:
            name = "rank-table--exited"
        return self.get_component_rich_style(name) if name else Style()

    def notify_style_update(self) -> None:
        self._base_style = None
        super().notify_style_update()

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        width = self.scrollable_content_region.width
        base = self._base_style
        if base is None:
            base = self._base_style = self.rich_style
        if y == 0:
            text = format_header(self._columns, self.sort_key, self.descending)
            style = base + self.get_component_rich_style("rank-table--header")
        else:
            index = scroll_y + y - 1
            if index >= len(self.order):
                if index == 0:  # an empty table says why, rather than looking like no run
                    note = empty_note(self.filter_text, len(self._rows))
                    style = base + self.get_component_rich_style("rank-table--note")
                    return Strip([Segment(note, style)], len(note)).crop_extend(0, width, base)
                return Strip.blank(width, base)
            row = self._rows[self.order[index]]
            text = format_row(row, self._columns)
            style = base + self._row_style(row)
            if index == self.cursor:
                style += self.get_component_rich_style("rank-table--cursor")
        strip = Strip([Segment(text, style)], len(text))
        return strip.crop_extend(scroll_x, scroll_x + width, style)

    # --- keys ---------------------------------------------------------------------

    def _scroll_to_cursor(self) -> None:
        visible = max(1, self.scrollable_content_region.height - 1)
        top = int(self.scroll_y)
        if self.cursor < top:
            self.scroll_to(y=self.cursor, animate=False)
        elif self.cursor >= top + visible:
            self.scroll_to(y=self.cursor - visible + 1, animate=False)
        self.refresh()

    def action_cursor(self, delta: int) -> None:
        if self.order:
            self.cursor = max(0, min(len(self.order) - 1, self.cursor + delta))
            self._scroll_to_cursor()

    def action_page(self, direction: int) -> None:
        self.action_cursor(direction * max(1, self.scrollable_content_region.height - 2))

    def action_jump(self, index: int) -> None:
        if self.order:
            self.cursor = index % len(self.order)
            self._scroll_to_cursor()

    def action_select(self) -> None:
        rank = self.selected_rank
        if rank is not None:
            self.post_message(self.RankSelected(rank))

    def action_cycle_sort(self) -> None:
        self.set_sort(SORT_KEYS[(SORT_KEYS.index(self.sort_key) + 1) % len(SORT_KEYS)])

    def action_reverse_sort(self) -> None:
        self.descending = not self.descending
        self.set_sort(self.sort_key)

    def on_click(self, event: Click) -> None:
        index = int(self.scroll_y) + event.y - 1
        if event.y >= 1 and 0 <= index < len(self.order):
            if index == self.cursor and event.chain >= 2:
                self.action_select()
            self.cursor = index
            self.refresh()
