"""CPU cost of the monitor TUI with thousands of simulated ranks, next to a DataTable table.

The monitor runs as a child process in a real pseudo-terminal (Textual's normal driver,
so screen output is generated and written as in a user's terminal). This process plays
a relay: it speaks the relay's side of the handshake on a Unix socket and forwards each
rank's frame as it came (`--frames as-sent`: every rank sends one every `--batch` s, as a
publisher does), or, for a monitor whose hello asks for batches (`batch_s`, as the fsdpx
monitor does), one `batch` frame per `batch_s` made by the relay's own code
(fsdpx/telemetry/wire/coalesce.py: `--frames coalesced`, rows as a 1.0 relay sends them;
`--frames columnar`, records as columns when the hello asks, as a 1.1 relay does:
fsdpx/telemetry/wire/columns.py), at `--rate` records/s per rank.
The monitor's CPU use is its process CPU time (user + system, all threads) over a
wall-time window after a warm-up, read from /proc.

Two table implementations, same app, same data, same refresh rate:
  line       monitor/widgets/rank_table.py (Line API, renders visible rows only)
  datatable  textual.widgets.DataTable, every rank's cells updated each refresh

Run (about 4 minutes):

    python benchmarks/monitor_cpu.py                         # 1,024 and 4,096 ranks
    python benchmarks/monitor_cpu.py --ranks 1024 --seconds 10 --tables line
    python benchmarks/monitor_cpu.py --tables line --frames as-sent coalesced --repeat 2
    python benchmarks/monitor_cpu.py --receive-only --ranks 4096 --repeat 3
    python benchmarks/monitor_cpu.py --tui-virtual --ranks 4096 --seconds 8 --repeat 3
    MONITOR_BENCH_CODE=/path/to/other/checkout python benchmarks/monitor_cpu.py --tui-virtual

Output: one line per (table, frames, ranks) with CPU % of one core and records/s
received, then the DataTable / line ratio per rank count, and the as-sent / coalesced
CPU side by side. Goal: line < 10% of a core at 1,024 ranks, < 25% at 4,096. The machine's
load average is printed with each line (a shared machine inflates CPU time).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import re
import select
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# MONITOR_BENCH_CODE=/path/to/another/checkout: measure that checkout's monitor with this
# script (before/after comparisons, interleaved, on the same machine and interpreter).
sys.path.insert(0, os.environ.get("MONITOR_BENCH_CODE") or str(ROOT))

from fsdpx.telemetry.wire.coalesce import encode_batches  # noqa: E402
from fsdpx.telemetry.wire.protocol import (  # noqa: E402
    HEADER,
    FrameDecoder,
    encode_frame,
    make_challenge,
)
from monitor.synthetic import SyntheticRun  # noqa: E402

TICK_S = 0.05
WARMUP_INTERVALS = 2
"""--tui-virtual: refresh intervals not measured (the first ranks' arrival: one-off costs)."""


# --- the relay side (this process) ------------------------------------------------------


class FakeRelay:
    """Accepts one monitor, does the handshake, then streams records until stopped."""

    def __init__(
        self, path: str, n_ranks: int, rate_hz: float, batch_s: float, frames: str
    ) -> None:
        self.path = path
        self.coalesce = frames != "as-sent"
        self.columnar = frames == "columnar"
        self.monitor_batch_s: float | None = None
        self.monitor_columns = False
        self.batch_s = batch_s
        self.frames = 0
        self.run = SyntheticRun(
            n_ranks=n_ranks, seed=0, straggler=1, memory_hog=2, phases=True
        )  # phases: the phase-time fields are part of what the monitor scores
        self.rate_hz = rate_hz
        self.sent = 0
        self.stop = threading.Event()
        self.connected = threading.Event()
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen(1)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        conn.sendall(encode_frame(make_challenge(auth_required=False)))
        decoder = FrameDecoder()
        hello: list[dict[str, Any]] = []
        while not hello:
            hello = decoder.feed(conn.recv(65536))
        if self.coalesce:  # as the relay does for a monitor that asks
            self.monitor_batch_s = hello[0].get("batch_s")
            self.monitor_columns = self.columnar and hello[0].get("columns") is True
        conn.sendall(encode_frame({"type": "welcome", "version": 1, "host": "bench", "pid": 0}))
        conn.sendall(encode_frame({"type": "history", "records": [], "events": [], "more": False}))
        self.connected.set()
        n = self.run.n_ranks
        # Like the relay forwarding publishers' batches: each rank sends one frame every
        # `batch_s` (the publisher's poll interval) with the records made meanwhile.
        groups = max(1, round(self.batch_s / TICK_S)) if self.batch_s > 0 else 1
        per_batch = self.rate_hz * (self.batch_s if self.batch_s > 0 else TICK_S)
        per_group = (n + groups - 1) // groups
        step = [0] * n
        due = [0.0] * n
        # Per-rank templates: only step, time and loss change (keeps this process, which
        # competes for the same cores, cheap; the monitor decodes full records anyway).
        templates = [self.run.record(rank, 1) for rank in range(n)]
        t0 = time.monotonic()
        tick = 0
        pending: list[dict[str, Any]] = []
        interval = self.monitor_batch_s
        flush_at = t0 + interval if interval else 0.0
        while not self.stop.is_set():
            g = tick % groups
            frames = []
            now = time.time()
            for rank in range(g * per_group, min(n, (g + 1) * per_group)):
                due[rank] += per_batch
                records = []
                while due[rank] >= 1.0:
                    due[rank] -= 1.0
                    step[rank] += 1
                    rec = dict(templates[rank])
                    rec["step"] = step[rank]
                    rec["time"] = now
                    rec["loss"] = 2.0 + 2.0 / (1.0 + 0.01 * step[rank])
                    records.append(rec)
                if records and interval:
                    pending.extend(records)  # counted as sent when its batch goes
                elif records:
                    frames.append(encode_frame({"type": "records", "records": records}))
                    self.sent += len(records)
            if interval and time.monotonic() >= flush_at:
                bodies = encode_batches(pending, [], columns=self.monitor_columns)
                frames = [HEADER.pack(len(b)) + b for b in bodies]
                self.sent += len(pending)
                pending = []
                flush_at += interval
            try:
                conn.sendall(b"".join(frames))
            except OSError:
                return
            self.frames += len(frames)
            tick += 1
            delay = t0 + tick * TICK_S - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        conn.close()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(
    table: str,
    n_ranks: int,
    rate_hz: float,
    batch_s: float,
    warmup_s: float,
    seconds: float,
    size: tuple[int, int],
    frames: str = "as-sent",
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        sock = os.path.join(tmp, "relay.sock")
        stats = os.path.join(tmp, "stats.json")
        relay = FakeRelay(sock, n_ranks, rate_hz, batch_s, frames)
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
        env = {
            **os.environ,
            "TERM": "xterm-256color",
            "COLUMNS": str(size[0]),
            "LINES": str(size[1]),
        }
        child = subprocess.Popen(
            [sys.executable, __file__, "--child", table, sock, stats],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            close_fds=True,
            start_new_session=True,
        )
        os.close(slave)
        written = 0
        tail = bytearray()

        def drain(until: float) -> None:
            nonlocal written
            while time.monotonic() < until:
                ready, _, _ = select.select([master], [], [], 0.05)
                if ready:
                    try:
                        data = os.read(master, 1 << 16)
                    except OSError:
                        return
                    written += len(data)
                    tail[:] = (tail + data)[-4000:]

        # The warm-up starts once the monitor is up and connected (its start-up, imports
        # included, is not what is measured).
        deadline = time.monotonic() + 180
        while not relay.connected.is_set() and time.monotonic() < deadline and child.poll() is None:
            drain(time.monotonic() + 0.2)
        if not relay.connected.is_set():
            raise RuntimeError(f"monitor did not connect: {tail.decode(errors='replace')}")
        drain(time.monotonic() + warmup_s)
        cpu0, wall0, sent0, out0 = _cpu_seconds(child.pid), time.monotonic(), relay.sent, written
        frames0 = relay.frames
        drain(wall0 + seconds)
        cpu1, wall1, sent1, out1 = _cpu_seconds(child.pid), time.monotonic(), relay.sent, written
        frames1 = relay.frames
        relay.stop.set()
        os.write(master, b"q")
        drain(time.monotonic() + 0.5)
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        os.close(master)
        if child.returncode != 0:
            text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", tail.decode(errors="replace"))
            raise RuntimeError(f"monitor exited with {child.returncode}: {text[-1500:]}")
        received = json.loads(Path(stats).read_text()) if os.path.exists(stats) else {}
        wall = wall1 - wall0
        if frames != "as-sent" and not relay.monitor_batch_s:
            raise RuntimeError("the monitor did not ask for batches (hello batch_s)")
        if frames == "columnar" and not relay.monitor_columns:
            raise RuntimeError("the monitor did not ask for columns (hello columns)")
        return {
            "table": table,
            "frames": frames,
            "load": os.getloadavg()[0],
            "ranks": n_ranks,
            "cpu_pct": 100.0 * (cpu1 - cpu0) / wall,
            "sent_per_s": (sent1 - sent0) / wall,
            "frames_per_s": (frames1 - frames0) / wall,
            "terminal_kib_per_s": (out1 - out0) / wall / 1024,
            "received_total": received.get("records"),
            "child_stats": received,
            "sent_total": relay.sent,
        }


# --- the monitor side (child process) ---------------------------------------------------


def child_main(table: str, address: str, stats_path: str) -> None:
    from textual.widgets import DataTable

    from monitor.app import MonitorApp
    from monitor.cli import run_app
    from monitor.messages import TelemetryBatch
    from monitor.model import Snapshot
    from monitor.table_view import fmt_age, fmt_float
    from monitor.units import fmt_bytes

    class CountingApp(MonitorApp):
        """Counts records and the CPU time of the two app-side stages (the rest is the
        receiver's decoding, Textual's compositor and the event loop)."""

        records = 0
        cpu_batches = 0.0
        cpu_refresh = 0.0

        profiler: Any = None
        batches = 0

        def on_telemetry_batch(self, message: TelemetryBatch) -> None:
            self.batches += 1
            if self.profiler is not None and self.batches == 10:
                # Steady state only: start-up (imports, CSS, first layout) is not profiled.
                self.profiler.enable()
            t = time.thread_time()
            self.records += len(message.records) + sum(b.n for b in message.columns)
            super().on_telemetry_batch(message)
            self.cpu_batches += time.thread_time() - t

        def refresh_view(self) -> None:
            t = time.thread_time()
            super().refresh_view()
            self.cpu_refresh += time.thread_time() - t

    class DataTableApp(CountingApp):
        """The same app with the rank table replaced by a DataTable (the anchor)."""

        def compose(self):  # type: ignore[no-untyped-def]
            for widget in super().compose():
                if widget is self.table:
                    self.grid: DataTable[str] = DataTable(id="grid")
                    yield self.grid
                else:
                    yield widget

        def on_mount(self) -> None:
            self.table.display = False
            self.grid.add_columns("rank", "state", "step", "step_s", "loss", "resv", "mem%", "age")
            # MonitorApp.on_mount runs next on its own: Textual calls each class's handler
            # (calling it here too connected twice and started two refresh timers).

        def refresh_view(self) -> None:
            t = time.thread_time()
            self._refresh_grid()
            self.cpu_refresh += time.thread_time() - t

        def _refresh_grid(self) -> None:
            snap: Snapshot = self.model.snapshot(self.now())
            self.snapshot = snap
            self.summary_bar.show(snap.summary, self._source_text())
            self.curves.show(snap.loss_curve, snap.throughput_curve)
            keys = self.grid.columns
            col = list(keys)
            for rank, row in snap.rows.items():
                cells = (
                    str(rank),
                    row.status.value,
                    str(row.record.get("step")),
                    fmt_float(row.record.get("step_time_s")),
                    fmt_float(row.record.get("loss"), 4),
                    fmt_bytes(row.record.get("mem_reserved"), compact=True),
                    "-" if row.mem_fraction is None else f"{100 * row.mem_fraction:.0f}%",
                    fmt_age(row.age_s),
                )
                key = str(rank)
                if key not in self.grid.rows:
                    self.grid.add_row(*cells, key=key)
                else:
                    for c, value in zip(col, cells, strict=True):
                        self.grid.update_cell(key, c, value)

    cls = DataTableApp if table == "datatable" else CountingApp
    app = cls(sources=[address])
    # A path: write a cProfile of the main thread there, from the 10th batch on.
    profile = os.environ.get("MONITOR_BENCH_PROFILE")
    if profile:
        import cProfile

        # CPU time of the main thread (the app's event loop: receiving, ingest, snapshots
        # and Textual's rendering), not wall time: a loaded machine's waits are not cost.
        app.profiler = cProfile.Profile(time.thread_time)
        run_app(app)
        app.profiler.disable()
        app.profiler.dump_stats(profile)
    else:
        run_app(app)  # as `fsdpx-monitor` runs it
    stats = {"records": app.records, "cpu_batches": app.cpu_batches, "cpu_refresh": app.cpu_refresh}
    stats["cpu_total"] = time.process_time()
    Path(stats_path).write_text(json.dumps(stats))


def receive_path(n_ranks: int, rate_hz: float, batch_s: float, seconds: float) -> None:
    """--receive-only: the monitor's receive path alone, in this process, without a
    terminal: the bytes of `seconds` of traffic (as sent: a frame per rank per `batch_s`;
    coalesced: one batch per monitor refresh, 0.5 s, rows; columnar: the same batches with
    records as columns, protocol 1.1) fed through the real RelayClient (frame decoding,
    validation walk, batching) into the app's RunBook (the records' ingest: rank state,
    step aggregates, straggler scores), then one snapshot per refresh (what the app
    computes before drawing: statuses, outliers, summary, top stragglers). CPU time (process_time) per
    second of traffic, so a busy shared machine skews it far less than the live runs.
    Rendering is not included: it does not depend on how records arrive."""
    import asyncio

    from monitor.model import MonitorSettings
    from monitor.receiver import Batch, RelayClient
    from monitor.runs import RunBook

    run = SyntheticRun(n_ranks=n_ranks, seed=0, straggler=1, memory_hog=2, phases=True)
    templates = [run.record(rank, 1) for rank in range(n_ranks)]
    intervals = int(seconds / batch_s)
    refresh_s = 0.5
    # Records per rank frame: rate x batch_s on average (2 and 3 in turn for 5/s, 0.5 s).
    per_frame = [
        int((i + 1) * rate_hz * batch_s) - int(i * rate_hz * batch_s) for i in range(intervals)
    ]
    first_step = [sum(per_frame[:i]) + 1 for i in range(intervals)]

    def records_of(interval: int, rank: int) -> list[dict[str, Any]]:
        out = []
        for k in range(per_frame[interval]):
            rec = dict(templates[rank])
            rec["step"] = first_step[interval] + k
            rec["time"] = 1000.0 + interval * batch_s
            rec["loss"] = 2.0 + 2.0 / (1.0 + 0.01 * rec["step"])
            out.append(rec)
        return out

    streams: dict[str, bytes] = {}
    frames = [
        encode_frame({"type": "records", "records": records_of(i, r)})
        for i in range(intervals)
        for r in range(n_ranks)
    ]
    streams["as-sent"] = b"".join(frames)
    per_batch = max(1, round(refresh_s / batch_s))
    counts = {"as-sent": len(frames)}
    for name, columns in (("coalesced", False), ("columnar", True)):
        bodies = []
        for start in range(0, intervals, per_batch):
            pending = [
                rec
                for i in range(start, min(intervals, start + per_batch))
                for r in range(n_ranks)
                for rec in records_of(i, r)
            ]
            bodies += encode_batches(pending, [], columns=columns)
        streams[name] = b"".join(HEADER.pack(len(b)) + b for b in bodies)
        counts[name] = len(bodies)
    for name, data in streams.items():
        book = RunBook(MonitorSettings())
        got: list[int] = []
        ingest_cpu = [0.0]

        def ingest(
            batch: Batch, book: RunBook = book, got: list[int] = got, t: list[float] = ingest_cpu
        ) -> None:
            t0 = time.process_time()
            book.add_records(batch.records, now=batch.received_at, source=batch.source)
            for block in batch.columns:
                book.add_columns(block, now=batch.received_at, source=batch.source)
            t[0] += time.process_time() - t0
            got.append(len(batch.records) + sum(block.n for block in batch.columns))

        client = RelayClient("bench", on_batch=ingest, on_status=lambda *_: None)

        async def feed(data: bytes = data, client: RelayClient = client) -> None:
            reader = asyncio.StreamReader(limit=1 << 18)
            for i in range(0, len(data), 1 << 18):  # reads of the receiver's size
                reader.feed_data(data[i : i + (1 << 18)])
            reader.feed_eof()
            await client._receive(reader, FrameDecoder())

        cpu0 = time.process_time()
        asyncio.run(feed())
        cpu = time.process_time() - cpu0
        # The app's per-refresh model work on the final state (before Textual draws).
        model = book.model(book.newest)
        end = 1000.0 + seconds
        cpu0 = time.process_time()
        for _ in range(int(seconds / refresh_s)):
            model.snapshot(end)
        snap = time.process_time() - cpu0
        print(
            f"receive path  {name:9s} ranks={n_ranks:5d}  {counts[name]:7d} frames, "
            f"{sum(got):8d} records for {seconds:.0f} s of traffic: {100 * cpu / seconds:5.2f}% "
            f"of one core, of which ingest {100 * ingest_cpu[0] / seconds:5.2f}%; "
            f"snapshots at {1 / refresh_s:.0f} Hz {100 * snap / seconds:5.2f}% "
            f"(load {os.getloadavg()[0]:.1f})",
            flush=True,
        )


def _columnar_intervals(
    n_ranks: int, rate_hz: float, batch_s: float, seconds: float, refresh_s: float
) -> list[bytes]:
    """The framed `batch` bodies a 1.1 relay sends a monitor refreshing every `refresh_s`:
    one item per refresh interval (its frames joined), `rate_hz` records per rank per
    second, each rank's records made every `batch_s` (the publisher's poll interval)."""
    run = SyntheticRun(n_ranks=n_ranks, seed=0, straggler=1, memory_hog=2, phases=True)
    templates = [run.record(rank, 1) for rank in range(n_ranks)]
    polls = int(seconds / batch_s)
    per_poll = [int((i + 1) * rate_hz * batch_s) - int(i * rate_hz * batch_s) for i in range(polls)]
    first_step = [sum(per_poll[:i]) + 1 for i in range(polls)]
    per_refresh = max(1, round(refresh_s / batch_s))
    out = []
    for start in range(0, polls, per_refresh):
        pending = []
        for i in range(start, min(polls, start + per_refresh)):
            for rank in range(n_ranks):
                for k in range(per_poll[i]):
                    rec = dict(templates[rank])
                    rec["step"] = first_step[i] + k
                    rec["time"] = 1000.0 + i * batch_s
                    rec["loss"] = 2.0 + 2.0 / (1.0 + 0.01 * rec["step"])
                    pending.append(rec)
        bodies = encode_batches(pending, [], columns=True)
        out.append(b"".join(HEADER.pack(len(b)) + b for b in bodies))
    return out


def tui_virtual(
    n_ranks: int,
    rate_hz: float,
    batch_s: float,
    seconds: float,
    size: tuple[int, int],
    refresh_hz: float | None = None,
) -> None:
    """--tui-virtual: the whole app on Textual's headless driver, in virtual time. Per
    refresh interval (0.5 s of traffic, columnar batches as a 1.1 relay sends them): decode
    the frames, hand the batch to the app as the receiver does, take the refresh
    (`refresh_view`: snapshot, table, summary, curves) and let Textual lay out and render
    the frame; the first `WARMUP_INTERVALS` are not measured. CPU time (process_time) of
    that work per second of traffic: not wall time,
    so a loaded machine inflates it far less than the live runs (whose 2 Hz timer also
    skips refreshes under load). Not included: writing the frame to a terminal (headless)
    and the event loop's idle polling."""
    import asyncio

    from textual.events import Mount

    from fsdpx.telemetry.wire.columns import RecordColumns
    from monitor.app import MonitorApp
    from monitor.messages import TelemetryBatch

    refresh_s = 0.5
    intervals = _columnar_intervals(n_ranks, rate_hz, batch_s, seconds, refresh_s)
    clock = [1000.0]

    class VirtualApp(MonitorApp):
        def on_mount(self, event: Mount) -> None:  # type: ignore[override]
            # Not MonitorApp's (Textual calls every class's handler unless told not to):
            # no relay connection and no refresh timer, the loop below drives the app.
            event.prevent_default()
            self.table.focus()
            self._fit_to_height(self.size.height)

    kwargs: dict[str, Any] = {} if refresh_hz is None else {"refresh_hz": refresh_hz}
    app = VirtualApp(sources=["/nonexistent/relay.sock"], clock=lambda: clock[0], **kwargs)
    cpu = [0.0]
    records = [0]
    refreshes = [0]

    async def drive() -> None:
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            # The timer's callback (a checkout from before it existed: the redraw itself).
            tick = getattr(app, "refresh_tick", app.refresh_view)
            for k, data in enumerate(intervals):
                clock[0] = 1000.0 + (k + 1) * refresh_s
                t0 = time.process_time()
                decoder = FrameDecoder()
                blocks = []
                for message in decoder.feed(data):
                    block = RecordColumns.read(message.get("record_columns"))
                    assert block is not None
                    blocks.append(block)
                app.on_telemetry_batch(
                    TelemetryBatch(source="bench", columns=blocks, received_at=clock[0])
                )
                tick()  # what the app's refresh timer does every refresh_s
                await pilot.pause(0.05)  # (Textual's screen update timer renders the frame)
                refreshes[0] += 1
                if k >= WARMUP_INTERVALS:
                    cpu[0] += time.process_time() - t0
                    records[0] += sum(b.n for b in blocks)

    asyncio.run(drive())
    assert refreshes[0] == len(intervals)
    traffic_s = (len(intervals) - WARMUP_INTERVALS) * refresh_s
    code = os.environ.get("MONITOR_BENCH_CODE") or str(ROOT)
    print(
        f"whole TUI, virtual time  ranks={n_ranks:5d}  {records[0]:8d} records for "
        f"{traffic_s:.0f} s of traffic: {100 * cpu[0] / traffic_s:5.2f}% of one core "
        f"(refresh_hz {refresh_hz or 'auto'}, code {code}, load {os.getloadavg()[0]:.1f})",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--rate", type=float, default=5.0, help="records/s per rank")
    parser.add_argument(
        "--batch",
        type=float,
        default=0.5,
        help="seconds between a rank's frames (publisher poll interval); 0: a frame per record",
    )
    parser.add_argument("--seconds", type=float, default=15.0, help="measured window")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--tables", nargs="+", default=["line", "datatable"])
    parser.add_argument("--size", default="120x40", help="terminal COLSxROWS")
    parser.add_argument(
        "--frames",
        nargs="+",
        default=["coalesced"],
        choices=["as-sent", "coalesced", "columnar"],
        help="what the relay sends the monitor: ranks' frames as they came, or batches "
        "(rows, as a 1.0 relay; columnar, as a 1.1 relay)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="rounds (interleaved)")
    parser.add_argument(
        "--tui-virtual",
        action="store_true",
        help="the whole app headless in virtual time (no terminal, no relay process)",
    )
    parser.add_argument(
        "--refresh-hz",
        type=float,
        default=None,
        help="--tui-virtual: the app's refresh_hz (default: its automatic rate); the "
        "virtual clock still ticks every 0.5 s",
    )
    parser.add_argument(
        "--receive-only",
        action="store_true",
        help="measure the receive path alone (no terminal): as-sent vs coalesced",
    )
    args = parser.parse_args()
    cols, rows = (int(v) for v in args.size.split("x"))
    if args.tui_virtual:
        for _ in range(args.repeat):
            for n in args.ranks:
                tui_virtual(n, args.rate, args.batch, args.seconds, (cols, rows), args.refresh_hz)
        return
    if args.receive_only:
        for _ in range(args.repeat):
            for n in args.ranks:
                receive_path(n, args.rate, args.batch, args.seconds)
        return
    results = []
    for _ in range(args.repeat):
        for n in args.ranks:
            for table in args.tables:
                for frames in args.frames:
                    r = measure(
                        table,
                        n,
                        args.rate,
                        args.batch,
                        args.warmup,
                        args.seconds,
                        (cols, rows),
                        frames,
                    )
                    results.append(r)
                    print(
                        f"{table:9s} {frames:9s} ranks={n:5d} load {r['load']:4.1f}  "
                        f"monitor CPU {r['cpu_pct']:5.1f}% of one core  "
                        f"records {r['sent_per_s']:6.0f}/s in {r['frames_per_s']:5.0f} frames/s  received {r['received_total']} "
                        f"of {r['sent_total']}  terminal output {r['terminal_kib_per_s']:.0f} KiB/s",
                        flush=True,
                    )
                    print(f"    child CPU totals: {r['child_stats']}", flush=True)
    for n in args.ranks:
        for table in args.tables:
            cpu = {
                f: [
                    f"{r['cpu_pct']:.1f}"
                    for r in results
                    if (r["ranks"], r["table"], r["frames"]) == (n, table, f)
                ]
                for f in args.frames
            }
            print(
                f"ranks={n} {table}: CPU % by relay frames: "
                + "; ".join(f"{f} {', '.join(v)}" for f, v in cpu.items())
            )
    for n in args.ranks:
        by = {r["table"]: r for r in results if r["ranks"] == n and r["frames"] == args.frames[0]}
        if "line" not in by or "datatable" not in by:
            continue
        target = n * args.rate
        line, grid = by["line"], by["datatable"]
        # CPU per 1,000 records/s: a table that cannot keep up slows its own input (the
        # relay's socket fills), so raw CPU % alone flatters it.
        per_k = {t: r["cpu_pct"] / max(r["sent_per_s"] / 1000, 1e-9) for t, r in by.items()}
        print(
            f"ranks={n}: target {target:.0f} records/s; line API took "
            f"{line['sent_per_s']:.0f}/s, DataTable {grid['sent_per_s']:.0f}/s; CPU % per "
            f"1k records/s: line {per_k['line']:.2f}, DataTable {per_k['datatable']:.2f} "
            f"({per_k['datatable'] / max(per_k['line'], 1e-9):.1f}x)"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(*sys.argv[2:5])
    else:
        main()
