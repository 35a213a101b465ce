"""The stragglers screen (`w`: who is slow): the slowest ranks with the phase that makes them slow,
a heat strip per phase across the ranks, and the chronic-straggler events. Escape goes
back. What it shows comes from monitor/stragglers.py ([Note: straggler scoring])."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Static

from monitor.model import MonitorModel, Snapshot
from monitor.stragglers import PHASE_LABELS, PHASE_NAMES, StragglerRow
from monitor.widgets.events import describe

_LEVELS = ((1.2, "▁", "green"), (1.5, "▃", "green"), (2.0, "▅", "yellow"), (3.0, "▇", "red"))
_LABEL_WIDTH = 15


def heat_cell(ratio: float | None) -> tuple[str, str]:
    """One rank (or bucket of ranks) in a heat strip: a bar as high as its time over the
    phase's median, coloured green (near the median) to red (3x and more)."""
    if ratio is None:
        return "·", "dim"
    for top, char, style in _LEVELS:
        if ratio < top:
            return char, style
    return "█", "bold red"


def heat_strip(ratios: dict[int, float | None], width: int) -> Text:
    """Ranks in rank order, `width` cells at most: with more ranks than cells, each cell
    shows the worst rank of its bucket (a straggler never averages away)."""
    ranks = sorted(ratios)
    line = Text(no_wrap=True, overflow="crop")
    if not ranks or width <= 0:
        return line
    per = max(1, -(-len(ranks) // width))  # ceil
    for i in range(0, len(ranks), per):
        bucket = [ratios[r] for r in ranks[i : i + per]]
        known = [v for v in bucket if v is not None]
        char, style = heat_cell(max(known) if known else None)
        line.append(char, style)
    return line


def straggler_line(row: StragglerRow) -> Text:
    line = Text(no_wrap=True, overflow="ellipsis")
    line.append(row.text(), "bold red" if row.chronic else "yellow")
    rel = "-" if row.relative is None else f"{row.relative:.2f}"
    ind = "-" if row.individual is None else f"{row.individual:.2f}"
    line.append(f"  relative {rel} individual {ind}", "dim")
    return line


class StragglersScreen(Screen[None]):
    """Top stragglers, heat strips and chronic-straggler events of the shown run."""

    BINDINGS = [Binding("escape,w", "app.pop_screen", "back")]

    def __init__(self) -> None:
        super().__init__()
        # Made here, not queried in `show`: the app's refresh timer may call `show`
        # before this screen composed (querying then raised NoMatches).
        self.top_box = Static(id="stragglers-top")
        self.heat_box = Static(id="stragglers-heat")
        self.events_box = Static(id="stragglers-events")

    def compose(self) -> ComposeResult:
        yield self.top_box
        yield self.heat_box
        yield self.events_box
        yield Footer()

    def show(self, snap: Snapshot, model: MonitorModel) -> None:
        """Redraw from a snapshot (the app calls this on every refresh while shown)."""
        top = Text()
        scored = model.stragglers.last_scored_step
        top.append(
            "stragglers" + (f" (scored through step {scored})" if scored is not None else ""),
            "bold",
        )
        if not snap.stragglers:
            note = "none" if scored is not None else "no phase times in these records yet"
            top.append(f"\n  {note}", "dim")
        for row in snap.stragglers:
            top.append("\n  ")
            top.append_text(straggler_line(row))
        self.top_box.update(top)

        heat = Text()
        heat.append("phase time / median, per rank (rank order)", "bold")
        width = max(8, self.size.width - _LABEL_WIDTH - 2)
        for name in PHASE_NAMES:
            ratios = model.stragglers.heat(name)
            if all(v is None for v in ratios.values()):
                continue  # a phase no rank reports (h2d without offload, an old log)
            heat.append(f"\n{PHASE_LABELS[name]:<{_LABEL_WIDTH}}")
            heat.append_text(heat_strip(ratios, width))
        self.heat_box.update(heat)

        events = Text()
        events.append("chronic-straggler events", "bold")
        made = [e for e in model.events if e.get("kind") == "straggler"][-8:]
        for event in made:
            events.append("\n")
            events.append_text(describe(event, model.first_time))
        if not made:
            events.append("\n  none", "dim")
        self.events_box.update(events)
