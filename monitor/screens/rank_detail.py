"""The rank detail screen: every field of one rank's latest record, its recent step
times and losses, and its events. Escape goes back."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer, Static

from monitor.model import MonitorModel, Snapshot
from monitor.table_view import end_note, fmt_age, fmt_flags, fmt_float, fmt_si
from monitor.units import fmt_bytes, fmt_flops
from monitor.widgets.curves import plot
from monitor.widgets.events import describe

_MEMORY = (
    "mem_allocated",
    "mem_reserved",
    "mem_peak",
    "device_mem_used",
    "device_mem_total",
    "host_rss",
    "comm_bytes",
    "sent_all_gather",
    "sent_reduce_scatter",
    "sent_all_to_all",
    "sent_all_reduce",
)
_FIELDS = (
    "host",
    "node",
    "local_rank",
    "pid",
    "step",
    "loss",
    "lr",
    "grad_norm",
    "loss_scale",
    "skipped",
    "step_time_s",
    "tokens_per_s",
    "tflops",
    "mfu",
    "moe_tokens",
    "moe_dropped",
    "moe_imbalance",
    *_MEMORY,
    "alloc_retries",
    "ooms",
    "device_util",
    "device_power_w",
    "device_temp_c",
    "dropped",
)


def _value(key: str, value: object) -> str:
    if value is None:
        return "-"
    if key in _MEMORY:
        return fmt_bytes(value)
    if key == "tokens_per_s":
        return fmt_si(value)
    if key == "tflops":
        return fmt_flops(value)
    units = {"device_util": "%", "device_power_w": " W", "device_temp_c": " C"}
    if key in units and isinstance(value, int | float):
        return f"{value:.1f}{units[key]}"
    if key == "mfu" and isinstance(value, int | float):
        return f"{100 * value:.1f}%"
    if key == "lr":
        return f"{value:.3g}" if isinstance(value, float) else str(value)
    if isinstance(value, float):
        return fmt_float(value, 4)
    return str(value)


class RankDetailScreen(Screen[None]):
    """Details of one rank, refreshed with every snapshot while shown."""

    BINDINGS = [Binding("escape,backspace", "app.pop_screen", "back")]

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def compose(self) -> ComposeResult:
        yield Static(id="detail-title")
        yield Static(id="detail-fields")
        yield Static(id="detail-curves")
        yield Static(id="detail-events")
        yield Footer()

    def show(self, snapshot: Snapshot, model: MonitorModel) -> None:
        """Redraw from the app's latest snapshot and the model's per-rank history."""
        # [Note: a detail screen without its widgets] The app's refresh timer calls this
        # whenever the screen is on top, which includes two moments without its widgets:
        # after the push and before compose, and while the app exits and removes them (seen
        # under load as NoMatches '#detail-title', once in each). Then there is nothing to
        # draw into; the push draws it once it is mounted.
        if not self.is_mounted:
            return
        try:
            title = self.query_one("#detail-title", Static)
        except NoMatches:
            return
        row = snapshot.rows.get(self.rank)
        if row is None:
            title.update(Text(f"rank {self.rank}: no records yet", "bold"))
            return
        title.update(
            Text.assemble(
                (f"rank {self.rank}", "bold"),
                f"  {row.status.value}",
                (end_note(row), "bold yellow"),
                f"  last seen {fmt_age(row.age_s)} ago",
                (f"  flags {fmt_flags(row.flags)}" if row.flags else "", "bold yellow"),
            )
        )
        table = Table.grid(padding=(0, 2))
        for _ in range(3):
            table.add_column(style="dim")
            table.add_column()
        cells = [(k, _value(k, row.record.get(k))) for k in _FIELDS]
        per_col = (len(cells) + 2) // 3
        for i in range(per_col):
            line: list[str] = []
            for c in range(3):
                j = c * per_col + i
                line.extend(cells[j] if j < len(cells) else ("", ""))
            table.add_row(*line)
        self.query_one("#detail-fields", Static).update(table)
        history = model.history(self.rank)
        width = max(10, self.size.width - 20)
        curves = Text(no_wrap=True)
        for name, values in (
            ("step_s", [h.step_time_s for h in history if h.step_time_s is not None]),
            ("loss", [h.loss for h in history if h.loss is not None]),
        ):
            curves.append(f"{name:<8}", "dim")
            floor = 0.0 if name == "step_s" else None
            curves.append(plot(values, width, 1, floor=floor)[0], "cyan")
            curves.append(f" {fmt_float(values[-1], 4) if values else '-'}\n")
        self.query_one("#detail-curves", Static).update(curves)
        events = model.rank_events(self.rank)[-8:]
        lines = Text("\n").join(describe(e, model.first_time) for e in events)
        self.query_one("#detail-events", Static).update(lines or Text("no events", "dim"))
