"""The monitor app: live from relays, or a replay of a relay's log.

Data flow: workers (RelayClient per relay, or the log loader) post messages
(monitor/messages.py); handlers feed the `MonitorModel` (cheap per record); a timer takes
a `Snapshot` a few times a second and hands it to the widgets, which draw only what is on
screen. Nothing is drawn per record (see monitor/model.py [Note: cost per record]).

[Note: refresh rate at scale]
Records are ingested as they arrive (cheap per record, monitor/model.py [Note: cost per
record]); the screen is redrawn from the latest state by a timer, never per batch. A
redraw costs O(ranks) in Python (the snapshot: every rank's status, flags and summary;
then sorting the table) plus Textual's frame: at 4,096 ranks about half of the monitor's
CPU at 2 Hz (benchmarks/monitor_cpu.py --tui-virtual). So the automatic rate (no
`refresh_hz` given; the CLI's default) is 2 Hz up to `LARGE_RUN_RANKS` ranks in the shown
run and 1 Hz above: a table of thousands of ranks read by a person loses nothing at 1 Hz,
and the goal (< 25% of a core at 4,096 ranks) is met with room. An explicit `refresh_hz`
(`--refresh-hz`) is honoured at any size. Keys (sorting, filtering, seeking) still
redraw at once, and the relay still sends a batch every 0.5 s (ingest cost is per
record, not per batch).

Runs are kept apart (monitor/runs.py): each has its own model, the screen shows one
(the newest unless the user picked another with `p` / `n`), and the summary bar names it
when there is anything to tell apart (a run id, or more than one run).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Input

from fsdpx.telemetry.wire.coalesce import BATCH_S_MAX, BATCH_S_MIN
from fsdpx.telemetry.wire.transport import parse_address
from monitor.messages import ConnectionChanged, ReplayLoaded, TelemetryBatch
from monitor.model import MonitorModel, MonitorSettings, Snapshot
from monitor.receiver import Batch, RelayClient
from monitor.replay import ReplayPlayer, ReplayStep, load_log
from monitor.runs import RunBook
from monitor.screens.hang import HangScreen
from monitor.screens.rank_detail import RankDetailScreen
from monitor.screens.stragglers import StragglersScreen
from monitor.table_view import fmt_duration
from monitor.widgets.curves import Curves
from monitor.widgets.events import EventsLog
from monitor.widgets.rank_table import RankTable
from monitor.widgets.summary import SummaryBar

REPLAY_TICK_S = 0.1
DEFAULT_REFRESH_HZ = 2.0
LARGE_RUN_RANKS = 1000
"""Under the automatic refresh rate, a shown run of more ranks than this is redrawn at
half `DEFAULT_REFRESH_HZ` ([Note: refresh rate at scale])."""


class MonitorApp(App[None]):
    """The fsdpx monitor.

    Args:
        sources: relay addresses (Unix socket paths or host:port) to watch live.
        replay: a relay log (`*.tlm`) to replay instead.
        replay_messages: already-loaded log messages to replay (tests, `fsdpx demo`).
        settings: stale/dead thresholds and outlier rules.
        secret: the relays' shared secret, or None.
        refresh_hz: screen refreshes per second; None: automatic, 2, or 1 for a run of
            more than `LARGE_RUN_RANKS` ranks ([Note: refresh rate at scale]).
        clock: the live monitor's clock (tests pass a fake one).
        speed: initial replay speed; paused: start the replay paused.

    Example::

        MonitorApp(sources=["/tmp/fsdpx-relay.sock"]).run()
        MonitorApp(replay="run.tlm", speed=4.0).run()
    """

    # Absolute: Textual resolves a relative CSS_PATH next to a subclass's own module.
    CSS_PATH = Path(__file__).with_name("monitor.tcss")
    TITLE = "fsdpx monitor"
    ENABLE_COMMAND_PALETTE = False

    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("ctrl+c", "quit", "quit", show=False, priority=True),
        Binding("slash", "filter", "filter"),
        Binding("o", "outliers", "outliers"),
        Binding("w", "stragglers", "stragglers"),
        Binding("h", "hang", "hang dump"),
        Binding("p", "run(-1)", "prev run"),
        Binding("n", "run(1)", "next run"),
        Binding("escape", "clear_filter", "clear", show=False),
        Binding("space", "pause", "pause", priority=True),
        Binding("left", "seek(-10)", "-10s", priority=True),
        Binding("right", "seek(10)", "+10s", priority=True),
        Binding("shift+left", "seek(-60)", "-60s", show=False, priority=True),
        Binding("shift+right", "seek(60)", "+60s", show=False, priority=True),
        Binding("left_square_bracket", "speed(-1)", "slower", priority=True),
        Binding("right_square_bracket", "speed(1)", "faster", priority=True),
    ]

    def __init__(
        self,
        *,
        sources: Sequence[str] = (),
        replay: str | os.PathLike[str] | None = None,
        replay_messages: list[dict[str, Any]] | None = None,
        settings: MonitorSettings | None = None,
        secret: bytes | None = None,
        refresh_hz: float | None = None,
        clock: Callable[[], float] = time.time,
        speed: float = 1.0,
        paused: bool = False,
    ) -> None:
        super().__init__()
        if bool(sources) + (replay is not None) + (replay_messages is not None) != 1:
            raise ValueError(
                "MonitorApp needs exactly one of sources (relay addresses), replay (a log "
                f"path) or replay_messages; got sources={list(sources)}, replay={replay!r}"
            )
        for address in sources:
            parse_address(address)  # a ValueError naming the bad address, before any I/O
        if refresh_hz is not None and refresh_hz <= 0:
            raise ValueError(f"refresh_hz must be > 0; got {refresh_hz}")
        self.runs = RunBook(settings or MonitorSettings())
        self.pinned_run: str | None = None
        """The run the user picked with p/n; None with `follow_newest`."""
        self.follow_newest = True
        self.sources = list(sources)
        self.replay_path = None if replay is None else Path(replay)
        self.secret = secret
        self.adaptive_refresh = refresh_hz is None
        """Halve the rate for a large run ([Note: refresh rate at scale])."""
        self.refresh_hz = DEFAULT_REFRESH_HZ if refresh_hz is None else refresh_hz
        self.refresh_ticks = 0
        """Refresh timer ticks so far (the automatic rate skips every other one)."""
        self.clock = clock
        self.player: ReplayPlayer | None = None
        self._pending_replay = replay_messages
        self._speed = speed
        self._paused = paused
        self._connections: dict[str, str] = dict.fromkeys(self.sources, "connecting")
        self._clients: list[RelayClient] = []
        self._last_tick = time.monotonic()
        self.snapshot: Snapshot = self.model.snapshot(0.0)
        self.replay_error: str | None = None

    # --- layout -------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        # Kept as attributes: `query_one` searches the active screen, which is the detail
        # screen while it is open, and the main widgets still update behind it.
        self.summary_bar = SummaryBar(id="summary")
        self.curves = Curves(id="curves")
        self.table = RankTable(id="ranks")
        self.events_log = EventsLog(id="events")
        self.filter_box = Input(
            placeholder="filter: rank, 8-15, host, outliers, stale, nan ...", id="filter"
        )
        yield self.summary_bar
        yield self.curves
        yield self.table
        yield self.events_log
        yield self.filter_box
        yield Footer()

    def on_mount(self) -> None:
        self.table.focus()
        self._fit_to_height(self.size.height)
        if self.sources:
            for address in self.sources:
                client = RelayClient(
                    address,
                    on_batch=self._post_batch,
                    on_status=self._status_poster(address),
                    secret=self.secret,
                    clock=self.clock,
                    # One frame from the relay per refresh (fsdpx/telemetry/wire/
                    # coalesce.py [Note: relay coalescing]), within the range it accepts.
                    batch_s=min(max(1.0 / self.refresh_hz, BATCH_S_MIN), BATCH_S_MAX),
                    columns=True,  # records as columns (fsdpx/telemetry/wire/columns.py)
                )
                self._clients.append(client)
                self.run_worker(client.run(), group="relays", name=address)
        elif self._pending_replay is not None:
            self._start_replay(self._pending_replay)
            self._pending_replay = None
        else:
            self._load_replay()
        self.set_interval(1.0 / self.refresh_hz, self.refresh_tick)
        self.refresh_view()

    def on_resize(self) -> None:
        self._fit_to_height(self.size.height)

    def _fit_to_height(self, height: int) -> None:
        # 80x24 keeps 2 curve rows and 4 event lines; a tall terminal gets more of both.
        self.curves.styles.height = 2 if height < 40 else 8
        self.events_log.styles.height = 4 if height < 40 else 10

    # --- data in ------------------------------------------------------------------

    def _status_poster(self, address: str) -> Callable[[bool, str], None]:
        def post(connected: bool, detail: str) -> None:
            self.post_message(ConnectionChanged(address, connected, detail))

        return post

    def _post_batch(self, batch: Batch) -> None:
        self.post_message(TelemetryBatch(**vars(batch)))

    @property
    def shown_run(self) -> str | None:
        """The run on screen: the newest unless the user picked one."""
        runs = self.runs
        if self.follow_newest or self.pinned_run not in runs:  # (a pinned run forgotten)
            return runs.newest
        return self.pinned_run

    @property
    def model(self) -> MonitorModel:
        """The shown run's model."""
        return self.runs.model(self.shown_run)

    def on_telemetry_batch(self, message: TelemetryBatch) -> None:
        shown, known = self.shown_run, len(self.runs)
        # Records first: a batch's events (an exit) come after its records.
        self.runs.add_records(message.records, now=message.received_at, source=message.source)
        for block in message.columns:  # (a batch holds records or columns, not both)
            self.runs.add_columns(block, now=message.received_at, source=message.source)
        by_run = self.runs.add_events(message.events, now=message.received_at)
        if message.dumps:
            self.runs.add_dumps(message.dumps)
        self._events_arrived(shown, known, by_run)

    def _events_arrived(
        self, shown: str | None, known: int, by_run: dict[str | None, list[Any]]
    ) -> None:
        if self.shown_run != shown:  # a new run arrived and is followed: show it whole
            self._show_run_events()
        else:
            if events := by_run.get(shown):
                self.events_log.add(events, self.model.first_time)
            if made := self.model.take_made_events():  # chronic stragglers
                self.events_log.add(made, self.model.first_time)
        if len(self.runs) != known and self.screen_stack:  # (none left while shutting down)
            self.refresh_bindings()  # the run keys appear with a second run

    def _show_run_events(self) -> None:
        model = self.model
        model.take_made_events()  # already among model.events
        self.events_log.reset(model.events, model.first_time)

    def on_connection_changed(self, message: ConnectionChanged) -> None:
        self._connections[message.source] = message.detail or (
            "connected" if message.connected else "disconnected"
        )
        # Its ranks show as one unreachable node, not as ranks going stale one by one
        # (monitor/nodes.py [Note: unreachable nodes]).
        self.runs.set_reachable(message.source, message.connected, self.clock())
        if made := self.model.take_made_events():
            self.events_log.add(made, self.model.first_time)

    @work(thread=True, exclusive=True, group="replay-load")
    def _load_replay(self) -> None:
        assert self.replay_path is not None
        try:
            messages = load_log(self.replay_path)
        except (ValueError, OSError) as exc:
            self.post_message(ReplayLoaded(str(self.replay_path), error=str(exc)))
            return
        self.post_message(ReplayLoaded(str(self.replay_path), messages))

    def on_replay_loaded(self, message: ReplayLoaded) -> None:
        if message.error is not None:
            self.replay_error = message.error
            self.notify(message.error, title="cannot replay", severity="error", timeout=30)
            return
        self._start_replay(message.messages)

    def _start_replay(self, messages: list[dict[str, Any]]) -> None:
        self.player = ReplayPlayer(messages, speed=self._speed, paused=self._paused)
        self._apply(self.player.seek(self.player.start))
        self._last_tick = time.monotonic()
        self.set_interval(REPLAY_TICK_S, self._replay_tick)
        self.refresh_bindings()  # the replay keys exist now: show them in the footer
        self.refresh_view()

    def _replay_tick(self) -> None:
        assert self.player is not None
        tick = time.monotonic()
        self._apply(self.player.advance(tick - self._last_tick))
        self._last_tick = tick

    def _apply(self, step: ReplayStep) -> None:
        if step.reset:
            self.runs.clear()
        shown, known = self.shown_run, len(self.runs)
        self.runs.add_records(step.records, now=None)
        by_run = self.runs.add_events(step.events)
        if step.dumps:
            self.runs.add_dumps(step.dumps)
        if step.reset:
            self._show_run_events()
        else:
            self._events_arrived(shown, known, by_run)

    # --- data out -----------------------------------------------------------------

    def now(self) -> float:
        """Monitor time: the replay's virtual clock, or the live clock."""
        if self.player is not None:
            return self.player.position
        return self.clock()

    def refresh_tick(self) -> None:
        """The refresh timer: redraw, except every other tick for a run of more than
        `LARGE_RUN_RANKS` ranks under the automatic rate ([Note: refresh rate at scale])."""
        self.refresh_ticks += 1
        if (
            self.adaptive_refresh
            and self.refresh_ticks % 2
            and len(self.model.ranks) > LARGE_RUN_RANKS
        ):
            return
        self.refresh_view()

    def refresh_view(self) -> None:
        """Take a snapshot and redraw every widget from it (the timer calls this)."""
        snap = self.model.snapshot(self.now())
        self.snapshot = snap
        self.summary_bar.show(snap.summary, self._source_text(), snap.nodes)
        self.curves.show(snap.loss_curve, snap.throughput_curve)
        self.table.show(snap)
        top = self._top_screen()
        if isinstance(top, RankDetailScreen | StragglersScreen | HangScreen):
            top.show(snap, self.model)

    def _top_screen(self) -> Screen[object] | None:
        """The screen on top, or None while the app tears its stack down.

        `App.screen` raises ScreenStackError on an empty stack, and the refresh timer and
        the binding checks can still run in that window (seen at load ~80 in a test).
        """
        stack = self.screen_stack
        return stack[-1] if stack else None

    def _source_text(self) -> str:
        runs = self.runs
        source = self._connection_text()
        if len(runs) > 1 or runs.newest is not None:  # something to tell apart
            return f"{runs.label(self.shown_run)}  {source}"
        return source

    def _connection_text(self) -> str:
        if self.player is not None:
            p = self.player
            name = self.replay_path.name if self.replay_path is not None else "log"
            state = "paused" if p.paused else f"playing {p.speed:g}x"
            if p.finished and not p.paused:
                state = "end of log"
            pos = fmt_duration(p.position - p.start)
            return f"replay {name}  {state}  {pos} / {fmt_duration(p.duration)}"
        if self.replay_path is not None:
            return f"replay {self.replay_path.name}: " + (self.replay_error or "loading ...")
        return "  ".join(f"{a}: {s}" for a, s in self._connections.items())

    # --- actions ------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        top = self._top_screen()
        covered = isinstance(top, RankDetailScreen | StragglersScreen | HangScreen)
        if action in ("filter", "outliers", "clear_filter"):
            # They act on the main table: not offered (nor run) while a screen covers it.
            return not covered
        if action in ("stragglers", "hang"):  # (a letter typed into the filter is text)
            return not covered and not isinstance(self.focused, Input)
        if action == "request_dumps":  # only live: a replay has what its log holds
            return isinstance(top, HangScreen) and bool(self._clients)
        if action in ("pause", "seek", "speed"):
            # Replay keys exist only in a replay, and never steal keys from the filter box.
            return self.player is not None and not isinstance(self.focused, Input)
        if action == "run":
            return len(self.runs) > 1 and not isinstance(self.focused, Input)
        return True

    def action_run(self, direction: int) -> None:
        """Show the previous (-1) or next (+1) run; past the newest, follow new runs."""
        ids = self.runs.run_ids
        at = ids.index(self.shown_run) if self.shown_run in self.runs else len(ids) - 1
        target = min(len(ids) - 1, max(0, at + direction))
        self.follow_newest = target == len(ids) - 1
        self.pinned_run = None if self.follow_newest else ids[target]
        self._show_run_events()
        self.refresh_view()

    def action_pause(self) -> None:
        assert self.player is not None
        self.player.toggle_pause()
        self._last_tick = time.monotonic()
        self.refresh_view()

    def action_seek(self, delta_s: float) -> None:
        assert self.player is not None
        self._apply(self.player.seek_relative(delta_s))
        self.refresh_view()

    def seek_to(self, offset_s: float) -> None:
        """Replay: jump to `offset_s` seconds after the log's start."""
        assert self.player is not None, "seek_to needs a replay"
        self._apply(self.player.seek(self.player.start + offset_s))
        self.refresh_view()

    def action_speed(self, direction: int) -> None:
        assert self.player is not None
        if direction > 0:
            self.player.faster()
        else:
            self.player.slower()
        self.refresh_view()

    def action_filter(self) -> None:
        box = self.filter_box
        box.display = True
        box.focus()

    def action_outliers(self) -> None:
        box = self.filter_box
        terms = box.value.split()
        box.value = " ".join(
            [t for t in terms if t != "outliers"] if "outliers" in terms else [*terms, "outliers"]
        )
        self.table.set_query(box.value)

    def action_clear_filter(self) -> None:
        box = self.filter_box
        box.value = ""
        box.display = False
        table = self.table
        table.set_query("")
        table.focus()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.table.set_query(event.value)

    @on(Input.Submitted, "#filter")
    def _filter_done(self, event: Input.Submitted) -> None:
        box = self.filter_box
        box.display = bool(box.value)
        self.table.focus()

    def action_stragglers(self) -> None:
        screen = StragglersScreen()
        self.push_screen(screen)
        # Drawn once mounted (not from a timer that may fire before the screen exists),
        # from a fresh snapshot: the last timer's may predate records applied since, and
        # the screen also reads the live model (a stale top list beside newer events).
        screen.call_after_refresh(self.refresh_view)

    def action_hang(self) -> None:
        """Open the hang screen and, live, ask every rank of the shown run for a dump."""
        screen = HangScreen()
        self.push_screen(screen)
        if self._clients:
            self.action_request_dumps()
        screen.call_after_refresh(self.refresh_view)

    def action_request_dumps(self) -> None:
        """Send a dump request through every relay (monitor/PROTOCOL.md "Hang dumps")."""
        request_id = uuid.uuid4().hex
        self.model.dumps.start(request_id)
        sent = [c.request_dumps(request_id, self.shown_run) for c in self._clients]
        if not any(sent):
            self.notify("not connected to a relay: no dump asked for", severity="warning")

    def on_rank_table_rank_selected(self, message: RankTable.RankSelected) -> None:
        screen = RankDetailScreen(message.rank)
        self.push_screen(screen)
        screen.call_after_refresh(self.refresh_view)
