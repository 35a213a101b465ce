"""The per-node telemetry relay: ranks and monitors connect to it (monitor/PROTOCOL.md).

One thread, one `selectors` loop, non-blocking sockets: it accepts ranks and monitors,
keeps a bounded history per rank (sent to monitors that join late), forwards live
frames to every monitor, and appends every frame to a zstd replay log. A slow monitor
never slows ranks: each monitor has a bounded output queue whose oldest frames are
dropped (counted); a rank that breaks the protocol is dropped (counted), others go on.

Who runs it (decision, see [Note: relay placement]): either a separate process

    python -m fsdpx.telemetry.relay --log run.tlm            # this node's default socket

or, when `telemetry.start_relay` is on and nothing answers at the address, local rank
0 starts it as a thread inside its training process (its log: `telemetry.log_path`).

[Note: relay placement]
In-process on local rank 0 needs no extra command and dies with the job (no orphan);
its cost is one mostly idle thread in one rank (a select() wake-up per incoming frame).
A separate process outlives the job, so a monitor can still read the history after
training ends, and costs the ranks nothing. Both speak the same protocol.

Example::

    relay = Relay("127.0.0.1:0", log_path="run.tlm")
    relay.bind()
    thread = relay.start_thread()
    ...
    relay.stop()
"""

from __future__ import annotations

import argparse
import contextlib
import os
import selectors
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpx.telemetry.wire.coalesce import Coalescer
from fsdpx.telemetry.wire.history import History
from fsdpx.telemetry.wire.logfile import LogWriter, open_log_writer
from fsdpx.telemetry.wire.metrics_http import DEFAULT_TOKEN_ENV, MetricsServer
from fsdpx.telemetry.wire.protocol import (
    HEADER,
    PROTOCOL_MINOR,
    FrameAuth,
    FrameDecoder,
    ProtocolError,
    accept_hello,
    encode_frame,
    make_challenge,
    make_welcome,
)
from fsdpx.telemetry.wire.transport import (
    DEFAULT_SECRET_ENV,
    Address,
    default_socket_dir,
    ensure_private_dir,
    parse_address,
    read_secret,
)
from fsdpx.telemetry.wire.validate import (
    check_dump_request,
    check_hello,
    validate_dump,
    validate_message,
)

HANDSHAKE_TIMEOUT_S = 10.0
_RECV_BYTES = 1 << 18
_DRAIN_READS = 64  # at most 16 MiB per connection taken in by stop()
_MAX_REASON = 1000  # characters of an error's text sent to the peer and in its event


@dataclass
class RelayStats:
    """Counters, readable while the relay runs (a snapshot is approximate)."""

    accepted: int = 0
    bad_connections: int = 0
    """Connections dropped for a protocol or auth error (bad frame, bad HMAC, timeout)."""
    auth_failures: int = 0
    frames_in: int = 0
    records_in: int = 0
    events_in: int = 0
    monitor_frames_dropped: int = 0
    """Frames dropped from slow monitors' queues."""
    batches_out: int = 0
    """`batch` frames made for monitors that asked for coalescing (one copy per monitor)."""
    dump_requests: int = 0
    """Monitors' dump requests passed on to the ranks."""
    refused_full: int = 0
    cpu_s: float = 0.0
    """CPU time of the relay thread (updated once per loop iteration)."""


class _Conn:
    __slots__ = (
        "sock",
        "decoder",
        "challenge",
        "role",
        "auth",
        "identity",
        "opened",
        "pending",
        "pending_bytes",
        "keep",
        "wire",
        "last_step",
        "said_exit",
        "output_dead",
        "coalesce",
    )

    def __init__(self, sock: socket.socket, challenge: dict[str, Any]) -> None:
        self.sock = sock
        self.decoder = FrameDecoder()
        self.challenge = challenge
        self.role: str | None = None
        self.auth: FrameAuth | None = None
        self.identity: dict[str, Any] = {}
        self.opened = time.monotonic()
        # Bodies not yet on the wire, each with "tag it" decided when it was queued (the
        # handshake frames are plain, the rest tagged once auth is set).
        self.pending: deque[tuple[bytes, bool]] = deque()
        self.pending_bytes = 0
        self.keep = 0  # leading pending bodies never dropped (history)
        self.wire = b""  # the frame being written
        self.last_step: Any = None
        self.said_exit = False
        # A send failed (the peer went away or shut its read side): nothing more is
        # written, but the connection stays open for reading until EOF, see _write.
        self.output_dead = False
        # A monitor that asked for `batch` frames (its hello's batch_s): its live items.
        self.coalesce: Coalescer | None = None


class Relay:
    """The relay server. See the module docstring.

    Args:
        address: where to listen (transport.parse_address); None: this node's default.
        secret: shared secret; required for a non-loopback address.
        log_path: append every frame to this zstd log (None: no log).
        history_recent / history_sparse: records kept per rank (full / thinned).
        max_events: events kept for late monitors.
        max_monitor_buffer: bytes queued per monitor before its oldest frames drop.
        max_connections: further connections are closed at once (counted).
    """

    def __init__(
        self,
        address: str | Address | None = None,
        *,
        secret: bytes | None = None,
        log_path: str | os.PathLike[str] | None = None,
        history_recent: int = 256,
        history_sparse: int = 256,
        max_events: int = 10_000,
        max_monitor_buffer: int = 16 << 20,
        max_connections: int = 8192,
    ) -> None:
        self.address = parse_address(address)
        self.secret = secret
        self.log_path = None if log_path is None else Path(log_path)
        self.history = History(
            recent=history_recent, sparse=history_sparse, max_events=max_events, max_ranks=1 << 16
        )
        self.max_monitor_buffer = max_monitor_buffer
        self.max_connections = max_connections
        self.stats = RelayStats()
        self._listener: socket.socket | None = None
        self._log: LogWriter | None = None
        self._sel = selectors.DefaultSelector()
        self._conns: dict[int, _Conn] = {}
        self.latest: dict[tuple[Any, Any, Any], dict[str, Any]] = {}
        """The newest record per (run, host, rank): what the Prometheus endpoint serves."""
        self._monitors: dict[int, _Conn] = {}
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread: threading.Thread | None = None
        self._sources = 0  # connected ranks and relays (written by the loop thread only)
        self._shut = False

    # --- set-up -------------------------------------------------------------------------

    def bind(self) -> Address:
        """Open the listening socket; returns the bound address (the real port for :0).

        Raises:
            ValueError: a non-loopback address without a secret, or a Unix socket path
                where a relay already answers.
        """
        addr = self.address
        if not addr.is_loopback() and not self.secret:
            raise ValueError(
                f"refusing to listen on {addr} without a shared secret: anyone who can "
                f"reach it could read the run's telemetry. Set {DEFAULT_SECRET_ENV} (the "
                "same value on ranks, relays and monitors), or listen on a Unix socket or "
                "127.0.0.1"
            )
        if addr.path is not None:
            sock = self._bind_unix(Path(addr.path))
        else:
            assert addr.host is not None and addr.port is not None
            family = socket.AF_INET6 if ":" in addr.host else socket.AF_INET
            sock = socket.create_server((addr.host, addr.port), family=family, backlog=512)
            host, port = sock.getsockname()[:2]
            self.address = Address(host=host, port=port)
        sock.setblocking(False)
        self._listener = sock
        self._sel.register(sock, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        if self.log_path is not None:
            self._log = open_log_writer(self.log_path)
        return self.address

    def _bind_unix(self, path: Path) -> socket.socket:
        if path.parent == default_socket_dir():
            ensure_private_dir(path.parent)
        if path.exists():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
                raise ValueError(
                    f"a relay already listens on {path}; connect to it, or give another "
                    "address (--listen / telemetry.relay)"
                )
            except (ConnectionRefusedError, FileNotFoundError):
                path.unlink(missing_ok=True)  # a dead relay's socket file
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        os.chmod(path, 0o600)  # only this user may connect
        sock.listen(512)
        return sock

    def start_thread(self) -> threading.Thread:
        """Run the loop in a daemon thread (bind() first)."""
        self._thread = threading.Thread(target=self.serve, name="fsdpx-relay", daemon=True)
        self._thread.start()
        return self._thread

    def wait_for_sources(self, timeout_s: float) -> bool:
        """Wait until no rank or relay is connected (they said goodbye), at most timeout_s.
        Returns True when none is left. Used before stopping an in-process relay so the
        other local ranks' last records still reach the log."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._sources == 0:
                return True
            time.sleep(0.02)
        return False

    def request_stop(self) -> None:
        """Ask the loop to stop at its next turn, without waiting (safe in a signal
        handler); stop() then finishes the shutdown."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop, take in what peers already sent, close every connection and
        the log (idempotent)."""
        self._stop.set()
        if self._thread is None:  # served in this thread (returned) or never: close here
            if self._listener is not None:
                self._shutdown()
            return
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    # --- the loop -----------------------------------------------------------------------

    def serve(self) -> None:
        """Serve until stop(); closes everything on the way out."""
        assert self._listener is not None, "call bind() first"
        try:
            while not self._stop.is_set():
                for key, mask in self._sel.select(timeout=self._select_timeout()):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        conn = self._conns.get(key.fd)
                        if conn is not None and mask & selectors.EVENT_READ:
                            self._read(conn)
                        conn = self._conns.get(key.fd)
                        if conn is not None and mask & selectors.EVENT_WRITE:
                            self._write(conn)
                self._expire_handshakes()
                self._flush_batches(time.monotonic())
                if self._log is not None:
                    self._log.flush_if_due()
                self.stats.cpu_s = time.thread_time()
            self._drain()
        finally:
            self._shutdown()

    def _drain(self) -> None:
        """Take in what peers sent before stop(): a rank's last frames (its exit event,
        sent just before the job or a test stops the relay) sit in the socket buffers
        and would be lost by closing at once. Bounded, so a peer that keeps sending
        cannot hold stop() up."""
        for conn in list(self._conns.values()):
            for _ in range(_DRAIN_READS):
                if not self._read(conn):
                    break
        self._flush_batches(None)

    def _shutdown(self) -> None:
        if self._shut:
            return
        self._shut = True
        for conn in list(self._conns.values()):
            self._close(conn)
        if self._listener is not None:
            self._sel.unregister(self._listener)
            self._listener.close()
            if self.address.path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self.address.path)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(self._wake_r)
        self._wake_r.close()
        self._wake_w.close()
        self._sel.close()
        if self._log is not None:
            self._log.close()

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # e.g. EMFILE: try again on the next wake-up
            if len(self._conns) >= self.max_connections:
                self.stats.refused_full += 1
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Conn(sock, make_challenge(auth_required=bool(self.secret)))
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ)
            self.stats.accepted += 1
            self._queue(conn, encode_frame(conn.challenge)[HEADER.size :], keep=True)

    def _read(self, conn: _Conn) -> bool:
        """One recv and the frames it completes; True when data came and the
        connection is still open (more may be waiting)."""
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return False
        try:
            conn.decoder.push(data)
            while (message := conn.decoder.next_message()) is not None:
                self._handle(conn, message)
        except ProtocolError as exc:
            self._reject(conn, exc)
            return False
        except Exception as exc:  # whatever a peer sends must never stop the relay
            self._reject(conn, ProtocolError(f"{type(exc).__name__}: {exc}"))
            return False
        return True

    def _handle(self, conn: _Conn, message: dict[str, Any]) -> None:
        if conn.role is None:
            auth = accept_hello(message, conn.challenge, secret=self.secret)
            check_hello(message)
            conn.role = message["role"]
            if conn.role != "monitor":
                self._sources += 1
            conn.identity = {k: message.get(k) for k in ("role", "rank", "host", "pid", "run_id")}
            welcome = make_welcome(
                auth, host=socket.gethostname(), pid=os.getpid(), minor=PROTOCOL_MINOR
            )
            self._queue(conn, encode_frame(welcome)[HEADER.size :], keep=True)
            conn.auth = conn.decoder.auth = auth  # later frames, both ways, are tagged
            if self._log is not None:
                self._log.write_message(
                    {k: v for k, v in message.items() if k not in ("auth", "nonce")}
                )
            if conn.role == "monitor":
                self._monitors[conn.sock.fileno()] = conn
                if message.get("batch_s") is not None:  # checked by check_hello
                    # `columns` (protocol 1.1): records as columns where their keys agree.
                    columns = message.get("columns") is True
                    conn.coalesce = Coalescer(float(message["batch_s"]), columns=columns)
                for body in self.history.frames():
                    self._queue(conn, body, keep=True)
            return
        kind = message["type"]
        if conn.role == "monitor":
            if kind == "dump_request":
                self._request_dumps(message)
            return  # nothing else a monitor says is acted on (forward compatible)
        owner = (conn.identity["rank"], conn.identity["host"]) if conn.role == "rank" else None
        if kind == "dump":
            validate_dump(message, owner=owner)
            self.stats.frames_in += 1
            self._forward(conn.decoder.last_body)  # to monitors and the log, not history
            return
        if kind == "batch":
            raise ProtocolError(
                "'batch' frames go from a relay to a monitor that asked for them (hello "
                "batch_s); a rank or relay sends its items in 'records' and 'events' frames"
            )
        if kind not in ("records", "events", "history"):
            return  # unknown types are ignored (forward compatible)
        validate_message(message, owner=owner)
        self.stats.frames_in += 1
        if kind in ("records", "history"):
            records = message.get("records") or []
            if records:
                latest = self.latest
                for record in records:
                    latest[(record.get("run_id"), record.get("host"), record.get("rank"))] = record
                self.history.add_records(records)
                if len(latest) > self.history.num_ranks:  # a run the history forgot
                    kept = set(self.history.runs)
                    self.latest = {k: r for k, r in latest.items() if k[0] in kept}
                self.stats.records_in += len(records)
                # The last int step: a record without one must not blank the step its
                # connection's "disconnected" event reports.
                for record in reversed(records):
                    if type(record.get("step")) is int:
                        conn.last_step = record["step"]
                        break
        if kind in ("events", "history"):
            events = message.get("events") or []
            if events:
                self.history.add_events(events)
                self.stats.events_in += len(events)
                conn.said_exit = conn.said_exit or any(e.get("kind") == "exit" for e in events)
        if kind in ("records", "events"):
            self._forward(conn.decoder.last_body, message)

    def _request_dumps(self, message: dict[str, Any]) -> None:
        """A monitor's `dump_request`: passed on to every rank and relay connection (a
        rank answers with a `dump`, which comes back through `_forward`)."""
        request = check_dump_request(message)
        body = encode_frame(request)[HEADER.size :]
        for conn in list(self._conns.values()):
            if conn.role in ("rank", "relay"):
                self._queue(conn, body)
        self.stats.dump_requests += 1

    def _forward(self, body: bytes, message: dict[str, Any] | None = None) -> None:
        """Log a frame and send it to every monitor: as it came, or, for a monitor that
        asked for batches, its records / events (`message`, decoded) into its next batch
        ([Note: relay coalescing] in fsdpx/telemetry/wire/coalesce.py)."""
        if self._log is not None:
            self._log.write_frame(HEADER.pack(len(body)) + body)
        now = time.monotonic()
        for monitor in list(self._monitors.values()):
            batch = monitor.coalesce
            if batch is None:
                self._queue(monitor, body)
            elif message is not None and batch.fits(len(body)):
                records = message.get("records") or [] if message["type"] == "records" else []
                events = message.get("events") or [] if message["type"] == "events" else []
                for out in batch.add(records, events, body_bytes=len(body), now=now):
                    self._queue_batch(monitor, out)
            else:  # a dump or an oversized frame: what was pending goes first, in order
                for out in batch.flush():
                    self._queue_batch(monitor, out)
                self._queue(monitor, body)

    def _queue_batch(self, monitor: _Conn, body: bytes) -> None:
        self.stats.batches_out += 1
        self._queue(monitor, body)

    def _flush_batches(self, now: float | None) -> None:
        """Send the batches that are due (`now` None: every pending one)."""
        for monitor in list(self._monitors.values()):
            batch = monitor.coalesce
            if batch is not None and batch.due is not None and (now is None or now >= batch.due):
                for out in batch.flush():
                    self._queue_batch(monitor, out)

    def _select_timeout(self) -> float:
        """Wake up for the next due batch, else at least every 0.5 s (handshake expiry)."""
        dues = [m.coalesce.due for m in self._monitors.values() if m.coalesce is not None]
        due = min((d for d in dues if d is not None), default=None)
        return 0.5 if due is None else min(0.5, max(0.0, due - time.monotonic()))

    # --- output -------------------------------------------------------------------------

    def _queue(self, conn: _Conn, body: bytes, *, keep: bool = False) -> None:
        if conn.output_dead:
            return
        if keep:
            conn.keep += 1
        conn.pending.append((body, conn.auth is not None))
        conn.pending_bytes += len(body)
        # Drop-oldest beyond the limit, but never the handshake or history frames.
        while conn.pending_bytes > self.max_monitor_buffer and len(conn.pending) > conn.keep:
            dropped, _ = conn.pending[conn.keep]
            del conn.pending[conn.keep]
            conn.pending_bytes -= len(dropped)
            self.stats.monitor_frames_dropped += 1
        if not conn.wire:
            self._write(conn)

    def _write(self, conn: _Conn) -> None:
        while True:
            if not conn.wire:
                if not conn.pending:
                    break
                body, tag = conn.pending.popleft()
                conn.pending_bytes -= len(body)
                conn.keep = max(0, conn.keep - 1)
                signed = conn.auth.sign(body) if tag and conn.auth is not None else body
                conn.wire = HEADER.pack(len(signed)) + signed
            try:
                sent = conn.sock.send(conn.wire)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                # The peer is gone (EPIPE / ECONNRESET): stop writing but do not close.
                # This runs inside _read's decode loop (the welcome after a hello), and
                # closing there handled the frames that came in the same read on a
                # closed socket, after the conn had already left _conns (and a monitor
                # was registered under fd -1). The frames it sent before leaving are
                # still ours to take in; reading goes on until EOF, which then closes.
                conn.output_dead = True
                conn.pending.clear()
                conn.pending_bytes = conn.keep = 0
                conn.wire = b""
                break
            conn.wire = conn.wire[sent:]
            if conn.wire:
                break
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.wire else 0)
        with contextlib.suppress(KeyError, ValueError):
            if self._sel.get_key(conn.sock).events != want:
                self._sel.modify(conn.sock, want)

    # --- closing ------------------------------------------------------------------------

    def _reject(self, conn: _Conn, exc: ProtocolError) -> None:
        self.stats.bad_connections += 1
        if type(exc).__name__ == "AuthError":
            self.stats.auth_failures += 1
        reason = str(exc)[:_MAX_REASON]
        # Tell the client why, best effort: plain before its welcome, tagged after it like
        # every frame; only at a frame boundary of our output and to a peer still reading.
        if not conn.wire and not conn.output_dead:
            with contextlib.suppress(OSError, ProtocolError):
                error = {"type": "error", "reason": reason}
                conn.sock.send(encode_frame(error, auth=conn.auth))
        self._close(conn, reason=f"rejected: {reason}")

    def _expire_handshakes(self) -> None:
        now = time.monotonic()
        for conn in list(self._conns.values()):
            if conn.role is None and now - conn.opened > HANDSHAKE_TIMEOUT_S:
                self._reject(conn, ProtocolError("no hello within the handshake timeout"))

    def _close(self, conn: _Conn, reason: str = "connection closed before an exit event") -> None:
        fd = conn.sock.fileno()
        if fd < 0:
            return
        self._monitors.pop(fd, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        conn.sock.close()
        if conn.role in ("rank", "relay"):
            self._sources -= 1
        if conn.role in ("rank", "relay") and not conn.said_exit and not self._stop.is_set():
            event = {
                "rank": conn.identity.get("rank"),
                "host": conn.identity.get("host"),
                "time": time.time(),
                "kind": "disconnected",
                "step": conn.last_step,
                "detail": {"reason": reason},
                "run_id": conn.identity.get("run_id"),  # the run the rank's hello named
            }
            self.history.add_events([event])
            message = {"type": "events", "events": [event]}
            self._forward(encode_frame(message)[HEADER.size :], message)
        # Last: a connection leaves `_conns` only once its "disconnected" event is logged
        # and forwarded, so whoever sees it gone (a stop() after the last peer left, a
        # test waiting for that state) never races the event.
        self._conns.pop(fd, None)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m fsdpx.telemetry.relay`: run a relay until interrupted."""
    # Raw: the docstring's command lines, example and note keep their own line breaks.
    parser = argparse.ArgumentParser(
        prog="python -m fsdpx.telemetry.relay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--listen", default=None, help="address (default: this node's socket)")
    parser.add_argument("--log", default=None, help="append frames to this zstd log (.tlm)")
    parser.add_argument("--secret-env", default=DEFAULT_SECRET_ENV, help="env var with secret")
    parser.add_argument("--history", type=int, default=256, help="recent records per rank")
    parser.add_argument(
        "--prometheus-port",
        type=int,
        default=None,
        help="serve per-rank gauges at http://HOST:PORT/metrics (Prometheus text format)",
    )
    parser.add_argument(
        "--prometheus-host",
        default="127.0.0.1",
        help="address of the metrics endpoint (default 127.0.0.1; any other needs a token)",
    )
    parser.add_argument(
        "--prometheus-token-env",
        default=DEFAULT_TOKEN_ENV,
        help=f"env var with the bearer token scrapes must send (default {DEFAULT_TOKEN_ENV})",
    )
    args = parser.parse_args(argv)
    relay = Relay(
        args.listen,
        secret=read_secret(args.secret_env),
        log_path=args.log,
        history_recent=args.history,
    )
    metrics: MetricsServer | None = None
    try:
        # The endpoint first: refused (no token off loopback), the relay never binds.
        if args.prometheus_port is not None:
            token = os.environ.get(args.prometheus_token_env) or None
            metrics = MetricsServer(
                args.prometheus_host,
                args.prometheus_port,
                token=token,
                latest=lambda: dict(relay.latest),
            )
        address = relay.bind()
    except (ValueError, OSError) as exc:
        if metrics is not None:
            metrics.stop()
        parser.error(str(exc))

    # Ctrl-C / SIGTERM only ask the loop to stop: a KeyboardInterrupt raised at an
    # arbitrary point (mid-read, mid-log-write) could leave the shutdown half done.
    def request_stop(signum: int, frame: object) -> None:
        relay.request_stop()

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    print(f"fsdpx relay listening on {address}", flush=True)
    if metrics is not None:
        metrics.start()
        print(f"fsdpx relay metrics on http://{metrics.host}:{metrics.port}/metrics", flush=True)
    try:
        relay.serve()
    finally:
        relay.stop()
        if metrics is not None:
            metrics.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
