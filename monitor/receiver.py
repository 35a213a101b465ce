"""Connection to one relay: handshake, history, live records; reconnects on failure.

`RelayClient.run` is a coroutine the app runs as a worker (one per relay address). It
posts only callbacks (`on_batch`, `on_status`), which the app turns into messages
(monitor/messages.py), so the client is tested and benchmarked without Textual.

Handshake (monitor/PROTOCOL.md): the relay speaks first with a `challenge`; the monitor
answers `hello` (role "monitor", with an HMAC proof when the relay requires a shared
secret); the relay answers `welcome` (with its own proof) or `error`, then sends
`history` frames (the run so far) and live `records`/`events`, or, when the monitor asked
for them (`batch_s`), live `batch` frames: one per refresh, every record and event of the
interval (fsdpx/telemetry/wire/coalesce.py [Note: relay coalescing]). A relay that does not
know `batch_s` sends `records`/`events` frames: both are read.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fsdpx.telemetry.wire.columns import RecordColumns
from fsdpx.telemetry.wire.protocol import (
    FrameDecoder,
    ProtocolError,
    check_welcome,
    encode_frame,
    make_hello,
)
from fsdpx.telemetry.wire.transport import parse_address

_READ_BYTES = 1 << 18


@dataclass
class Batch:
    """What one flush delivers: records and events from `source`, received at `received_at`."""

    source: str
    records: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    received_at: float = 0.0
    history: bool = False
    dumps: list[dict[str, Any]] = field(default_factory=list)
    """Ranks' hang dumps (answers to `request_dumps`)."""
    columns: list[RecordColumns] = field(default_factory=list)
    """Records that came as columns (protocol 1.1, asked for with `columns`); a batch
    holds these or `records`, never both, so the order records arrived in is kept."""


@dataclass
class RelayClient:
    """Receives a relay's history and live traffic, in batches, forever (reconnecting).

    Args:
        address: `host:port` or a Unix socket path.
        on_batch: called with each Batch (history first, then live flushes).
        on_status: called with (connected, detail) when the connection changes.
        secret: the relay's shared secret, or None.
        clock: monitor time for `Batch.received_at` (see monitor/model.py [Note: clocks]).
        flush_interval_s: longest time received records wait before a flush.
        retry_s: first reconnect delay; doubles per failure up to `max_retry_s`.
        batch_s: ask the relay to coalesce live traffic into one `batch` frame per this
            many seconds (the monitor's refresh interval; BATCH_S_MIN..BATCH_S_MAX);
            None: a frame per rank frame, as relays forward them.
        columns: with `batch_s`, also ask for records as columns (protocol 1.1,
            fsdpx/telemetry/wire/columns.py); they arrive in `Batch.columns`.

    Example::

        client = RelayClient("/tmp/relay.sock", on_batch=print, on_status=print)
        asyncio.run(client.run())
    """

    address: str
    on_batch: Callable[[Batch], None]
    on_status: Callable[[bool, str], None]
    secret: bytes | None = None
    clock: Callable[[], float] = time.time
    flush_interval_s: float = 0.1
    retry_s: float = 0.5
    max_retry_s: float = 5.0
    batch_s: float | None = None
    columns: bool = False
    reconnect: bool = True
    frames: int = field(default=0, init=False)
    _writer: asyncio.StreamWriter | None = field(default=None, init=False, repr=False)
    _auth: Any = field(default=None, init=False, repr=False)

    def request_dumps(self, request_id: str, run_id: str | None) -> bool:
        """Ask every rank behind this relay for its hang dump (monitor/PROTOCOL.md "Hang
        dumps"); the answers arrive in later batches' `dumps`. Call it on the event loop
        the client runs on. Returns False when not connected."""
        writer = self._writer
        if writer is None or writer.is_closing():
            return False
        request = {"type": "dump_request", "request_id": request_id, "run_id": run_id}
        writer.write(encode_frame(request, auth=self._auth))
        return True

    async def run(self) -> None:
        """Connect, receive, and reconnect after failures until cancelled (or once, when
        `reconnect` is False)."""
        delay = self.retry_s
        while True:
            try:
                await self._session()
                delay = self.retry_s  # a session that ended cleanly: retry soon
                self.on_status(False, "relay closed the connection")
            except OSError as exc:
                self.on_status(False, f"cannot reach relay: {exc.strerror or exc}")
            except ProtocolError as exc:
                self.on_status(False, str(exc))
            if not self.reconnect:
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_retry_s)

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        target = parse_address(self.address)
        if target.path is not None:
            return await asyncio.open_unix_connection(target.path, limit=_READ_BYTES)
        return await asyncio.open_connection(target.host, target.port, limit=_READ_BYTES)

    async def _next(self, reader: asyncio.StreamReader, decoder: FrameDecoder) -> dict[str, Any]:
        while (message := decoder.next_message()) is None:
            data = await reader.read(_READ_BYTES)
            if not data:
                raise ProtocolError("relay closed the connection during the handshake")
            decoder.push(data)
        return message

    async def _session(self) -> None:
        reader, writer = await self._open()
        try:
            decoder = FrameDecoder()
            challenge = await self._next(reader, decoder)
            hello, auth = make_hello(
                challenge,
                role="monitor",
                secret=self.secret,
                host=socket.gethostname(),
                pid=os.getpid(),
                **({} if self.batch_s is None else {"batch_s": self.batch_s}),
                **({"columns": True} if self.columns and self.batch_s is not None else {}),
            )
            writer.write(encode_frame(hello))
            await writer.drain()
            # The welcome (or error) is untagged; every frame after it is tagged.
            check_welcome(await self._next(reader, decoder), auth)
            decoder.auth = auth
            self._writer, self._auth = writer, auth
            self.on_status(True, "connected")
            await self._receive(reader, decoder)
        finally:
            self._writer = self._auth = None
            writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await writer.wait_closed()

    async def _receive(self, reader: asyncio.StreamReader, decoder: FrameDecoder) -> None:
        # Live records wait in `pending` until a timer flushes them (one timer per
        # interval, not a timeout per read: asyncio.wait_for costs a task per call).
        loop = asyncio.get_running_loop()
        pending = Batch(self.address)
        history = Batch(self.address, history=True)
        timer: asyncio.TimerHandle | None = None

        def flush() -> None:
            nonlocal pending, timer
            timer = None
            self._flush(pending)
            pending = Batch(self.address)

        try:
            while True:
                while (message := decoder.next_message()) is not None:
                    self.frames += 1
                    kind = message.get("type")
                    if kind == "history":
                        # The run so far: delivered at once (all its frames together),
                        # ahead of anything live.
                        flush()
                        history.records.extend(_list(message.get("records")))
                        history.events.extend(_list(message.get("events")))
                        if message.get("more") is not True:
                            self._deliver(_in_step_order(history))
                            history = Batch(self.address, history=True)
                    elif kind in ("records", "batch"):
                        records = _list(message.get("records"))
                        block = message.get("record_columns")
                        if (records and pending.columns) or (block is not None and pending.records):
                            # Rows and columns never share a batch, so arrival order is kept.
                            if timer is not None:
                                timer.cancel()
                            flush()
                        pending.records.extend(records)
                        if block is not None:
                            columns = RecordColumns.read(block)
                            if columns is not None:
                                pending.columns.append(columns)
                            else:  # malformed: one non-map item, counted as a bad record
                                pending.records.append(block)
                        if kind == "batch":
                            pending.events.extend(_list(message.get("events")))
                    elif kind == "events":
                        pending.events.extend(_list(message.get("events")))
                    elif kind == "dump" and type(message.get("dump")) is dict:
                        pending.dumps.append(message["dump"])
                if timer is None and (
                    pending.records or pending.events or pending.dumps or pending.columns
                ):
                    timer = loop.call_later(self.flush_interval_s, flush)
                data = await reader.read(_READ_BYTES)
                if not data:
                    return
                decoder.push(data)
        finally:
            if timer is not None:
                timer.cancel()
            flush()

    def _flush(self, batch: Batch) -> None:
        if batch.records or batch.events or batch.dumps or batch.columns:
            self._deliver(batch)

    def _deliver(self, batch: Batch) -> None:
        batch.received_at = self.clock()
        self.on_batch(batch)


def _in_step_order(history: Batch) -> Batch:
    """The relay sends its history grouped by rank; the monitor gets it in step order
    (stable, so each rank's records keep their order), as live records arrive: straggler
    scores compare the ranks step by step (monitor/stragglers.py)."""
    records = history.records
    if all(type(r) is dict and type(r.get("step")) is int for r in records):
        records.sort(key=lambda r: r["step"])
    return history


def _list(value: Any) -> list[Any]:
    # Items are checked by the model (it counts bad ones); here only the list itself.
    return value if type(value) is list else []
