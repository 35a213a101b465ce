"""The summary bar: the run at a glance, and the connection or replay state."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from monitor.state import Summary
from monitor.table_view import fmt_duration, fmt_float, fmt_si


class SummaryBar(Static):
    """Two lines: step, loss, tokens/s, rank counts, elapsed, ETA; then the source."""

    def show(self, summary: Summary, source: str) -> None:
        """Redraw from a snapshot's summary and a one-line source description."""
        s = summary
        line = Text()
        step = "-" if s.step is None else str(s.step)
        if s.min_step is not None and s.step is not None and s.min_step != s.step:
            step += f" (min {s.min_step})"
        line.append("step ", "dim").append(step, "bold")
        line.append("  loss ", "dim").append(fmt_float(s.loss, 4), "bold")
        line.append("  tok/s ", "dim").append(fmt_si(s.tokens_per_s), "bold")
        line.append("  ranks ", "dim").append(f"{s.alive} alive", "green")
        if s.stale:
            line.append(f" {s.stale} stale", "yellow")
        if s.dead:
            line.append(f" {s.dead} dead", "bold red")
        if s.exited:
            line.append(f" {s.exited} exited", "dim")
        if s.missing:
            line.append(f" {s.missing} never seen", "bold red")
        second = Text()
        second.append("elapsed ", "dim").append(fmt_duration(s.elapsed_s))
        if s.eta_s is not None:
            second.append("  ETA ", "dim").append(fmt_duration(s.eta_s))
        second.append("  " + source, "italic")
        if s.outliers:
            second.append(f"  outliers {s.outliers}", "bold yellow")
            legend = " (S slow M mem N nan Z stale E error F failed first P peer failed H hung)"
            second.append(legend, "dim")
        if s.dropped:
            second.append(f"  dropped {s.dropped}", "red")
        both = Text("\n").join([line, second])
        both.no_wrap = True
        both.overflow = "crop"
        # Fixed size (2 rows, full width): no layout pass, which costs more than the draw.
        self.update(both, layout=False)
