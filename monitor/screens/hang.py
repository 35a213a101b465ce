"""The hang screen (`h`): asks every rank of the shown run for a dump (stacks of all
threads, the collectives it entered) and shows which rank is inside which collective and
which one never arrived (monitor/hangs.py [Note: who never arrived]). `h` asks again,
escape goes back."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Static

from monitor.model import MonitorModel, Snapshot
from monitor.state import Flag, RankStatus

_STACK_LINES = 6


class HangScreen(Screen[None]):
    """The newest dump request's verdict and each rank's innermost frames."""

    BINDINGS = [
        Binding("escape", "app.pop_screen", "back"),
        Binding("h", "app.request_dumps", "ask again"),
    ]

    def __init__(self) -> None:
        super().__init__()
        # Made here, not queried in `show`: the app's refresh timer may call `show`
        # before this screen composed (querying then raised NoMatches).
        self.report_box = Static(id="hang-report")

    def compose(self) -> ComposeResult:
        yield self.report_box
        yield Footer()

    def show(self, snap: Snapshot, model: MonitorModel) -> None:
        """Redraw from the model's dumps (the app calls this on every refresh while shown)."""
        running = (RankStatus.ALIVE, RankStatus.STALE)
        expected = [r for r, row in snap.rows.items() if row.status in running]
        hung = [r for r, row in snap.rows.items() if row.flags & Flag.HUNG]
        text = Text()
        text.append("hang diagnosis", "bold")
        text.append(f"  hung: {', '.join(map(str, hung)) or 'none'}\n", "red" if hung else "dim")
        if model.dumps.latest is None:
            text.append("no dump asked for yet (h asks every rank)", "dim")
            self.report_box.update(text)
            return
        report = model.dumps.report(expected=expected)
        lines = report.lines()
        text.append(lines[0] + "\n", "bold red" if report.never_arrived else "bold")
        for line in lines[1:]:
            text.append(line + "\n")
        for d in report.ranks:
            text.append(f"\nrank {d.rank} main thread, innermost frames:\n", "bold")
            frames = [ln for ln in d.stack.splitlines() if ln.strip()][-_STACK_LINES:]
            text.append("\n".join(frames) + "\n", "dim")
        self.report_box.update(text)
