"""Loss and throughput curves: block-character plots downsampled to the widget's width.

A Line API widget: `show` computes the rows of text once per snapshot and `render_line`
hands out plain segments, skipping Rich's console rendering (measurable at 2-5 Hz with
thousands of ranks feeding the app, see benchmarks/monitor_cpu.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip
from textual.widget import Widget

from monitor.table_view import fmt_float, fmt_si

BLOCKS = " ▁▂▃▄▅▆▇█"
LABEL_WIDTH = 18


def downsample(values: Sequence[float], width: int) -> list[float]:
    """Bucket means of `values` into at most `width` points (all of them when fewer)."""
    n = len(values)
    if n <= width or width <= 0:
        return list(values)
    out = []
    for i in range(width):
        lo, hi = i * n // width, (i + 1) * n // width
        chunk = values[lo:hi]
        out.append(sum(chunk) / len(chunk))
    return out


def plot(
    values: Sequence[float], width: int, height: int, *, floor: float | None = None
) -> list[str]:
    """`height` text rows of a block plot of `values` scaled between their min (or
    `floor`, for quantities whose zero matters, like throughput) and max."""
    points = [v for v in downsample(values, width) if math.isfinite(v)]
    if not points:
        return [" " * width for _ in range(height)]
    lo, hi = min(points), max(points)
    if floor is not None:
        lo = min(lo, floor)
    span = hi - lo or 1.0
    levels = [round((v - lo) / span * (height * 8 - 1)) + 1 for v in points]
    rows = []
    for row in range(height - 1, -1, -1):
        base = row * 8
        rows.append("".join(BLOCKS[max(0, min(8, lv - base))] for lv in levels).ljust(width))
    return rows


_SERIES: tuple[tuple[str, Callable[[float], str], float | None, str], ...] = (
    ("loss", lambda v: fmt_float(v, 3), None, "cyan"),
    ("tok/s", fmt_si, 0.0, "green"),
)


class Curves(Widget):
    """Loss (mean over ranks per step) and throughput (tokens/s, whole run) over steps;
    each gets half the widget's height."""

    DEFAULT_CSS = """
    Curves { height: 2; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._series: tuple[list[tuple[int, float]], ...] = ([], [])
        self._lines: list[tuple[str, str, str]] = []

    def show(self, loss: list[tuple[int, float]], throughput: list[tuple[int, float]]) -> None:
        """Take the snapshot's curves (step, value) and redraw."""
        self._series = (loss, throughput)
        self._layout()
        self.refresh()

    def on_resize(self) -> None:
        self._layout()

    def _layout(self) -> None:
        width = max(1, self.content_region.width - LABEL_WIDTH)
        rows_each = max(1, self.content_region.height // 2)
        lines: list[tuple[str, str, str]] = []
        for points, (name, fmt, floor, color) in zip(self._series, _SERIES, strict=True):
            values = [v for _, v in points]
            last = fmt(values[-1]) if values else "-"
            for j, chart in enumerate(plot(values, width, rows_each, floor=floor)):
                label = f"{name:<6}{last:>9}" if j == rows_each - 1 else ""
                lines.append((label.ljust(LABEL_WIDTH), chart, color))
        self._lines = lines

    def render_line(self, y: int) -> Strip:
        width = self.content_region.width
        base = self.rich_style
        if y >= len(self._lines):
            return Strip.blank(width, base)
        label, chart, color = self._lines[y]
        strip = Strip(
            [
                Segment(label, base + Style(dim=True)),
                Segment(chart, base + Style(color=color)),
            ]
        )
        return strip.adjust_cell_length(width, base)
