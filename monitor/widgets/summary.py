"""The summary bar: the run at a glance, the connection or replay state, and the nodes."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widgets import Static

from monitor.state import NodeRow, Summary
from monitor.table_view import fmt_duration, fmt_float, fmt_si
from monitor.units import fmt_bytes

MAX_NODES_SHOWN = 32
"""Nodes named on the nodes line (the most interesting first); the rest are counted."""


def nodes_line(nodes: Sequence[NodeRow]) -> Text:
    """The per-node line: `nodes 2  1 UNREACHABLE 2 ranks  0: 2 ranks 0.105s 1.2G`.

    `nodes` come unreachable first, then slowest first (monitor/nodes.py), so what needs
    a look is at the left, where a narrow terminal does not crop it; only the first
    MAX_NODES_SHOWN are formatted (thousands of ranks are hundreds of nodes)."""
    line = Text()
    line.append("nodes ", "dim").append(str(len(nodes)), "bold")
    for n in nodes[:MAX_NODES_SHOWN]:
        name = "?" if n.node is None else str(n.node)
        if n.unreachable:
            line.append(f"  {name}: ", "bold")
            line.append(f"unreachable ({n.unreachable}/{n.ranks} ranks)", "bold red")
            continue
        line.append(f"  {name}: ", "bold").append(f"{n.ranks}r", "dim")
        line.append(" " + fmt_float(n.slowest_step_s, 3) + "s")
        if n.max_mem is not None:
            line.append(" " + fmt_bytes(n.max_mem, compact=True))
    if len(nodes) > MAX_NODES_SHOWN:
        line.append(f"  +{len(nodes) - MAX_NODES_SHOWN} more", "dim")
    return line


class SummaryBar(Static):
    """Two lines: step, loss, tokens/s, rank counts, elapsed, ETA; then the source. A
    third when ranks name their nodes: per node, its ranks, slowest step time and
    largest memory (or that it is unreachable)."""

    def show(self, summary: Summary, source: str, nodes: Sequence[NodeRow] = ()) -> None:
        """Redraw from a snapshot's summary, a one-line source description and the
        snapshot's per-node rows."""
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
        if s.unreachable:
            line.append(f" {s.unreachable} unreachable", "bold red")
        if s.missing:
            line.append(f" {s.missing} never seen", "bold red")
        second = Text()
        second.append("elapsed ", "dim").append(fmt_duration(s.elapsed_s))
        if s.eta_s is not None:
            second.append("  ETA ", "dim").append(fmt_duration(s.eta_s))
        second.append("  " + source, "italic")
        if s.outliers:
            second.append(f"  outliers {s.outliers}", "bold yellow")
            legend = (
                " (S slow M mem N nan Z stale E error F failed first P peer failed H hung"
                " U node unreachable)"
            )
            second.append(legend, "dim")
        if s.dropped:
            second.append(f"  dropped {s.dropped}", "red")
        lines = [line, second]
        if nodes:
            lines.append(nodes_line(nodes))
        both = Text("\n").join(lines)
        both.no_wrap = True
        both.overflow = "crop"
        # Fixed size (full width; 2 rows, 3 with nodes): no layout pass on a redraw, which
        # costs more than the draw; only when the nodes line comes or goes.
        if self.styles.height is None or self.styles.height.value != len(lines):
            self.styles.height = len(lines)
        self.update(both, layout=False)
