"""The per-rank telemetry publisher: one record per optimizer step, plus events.

The engine calls `observe_loss(loss)` from backward and `on_step(engine, result)` at each
optimizer-step boundary; everything else happens here or on the sender thread.

[Note: publishing never blocks training]
On the training thread a step costs a few counter reads, a tuple and a `deque.append`
to a bounded drop-oldest queue (a full queue drops the oldest record and counts it). On
CUDA the loss is copied into pinned host memory with non_blocking=True and a CUDA event
is recorded; the sender thread publishes the record once that event has completed, so
the record goes out a step late and the training thread never waits for the device. On
CPU the loss is read directly (no device to wait for). The sender thread wakes every
`poll_interval_s`, samples NVML and host RSS, connects (or reconnects, with backoff) to
the relay and sends batches with a `send_timeout_s` socket timeout; a batch it cannot
send is dropped and counted. Nothing it does raises into training: errors are counted
in `stats` and logged once.

[Note: telemetry accounting]
Every record is in exactly one place: `queued`, `stats.records_sent` or `dropped`
(pushed out of the full queue, or in a batch whose send failed); the same holds for
events with `events_queued`, `stats.events_sent` and `stats.events_dropped`. A failed
send loses only the batch it was sending: events are taken from their queue only after
the records batch before them went out. "Sent" means handed to the kernel in full: a
relay that never reads loses what sits in its socket buffer when the connection is
closed, and no sender can know that. A send failure can therefore lose only events
(a records batch that fit in the socket buffer, then an events frame that did not);
`send_failures > 0` does not imply `dropped > 0`.

The engine reports its checkpoint saves and loads through
fsdpx/telemetry/checkpoint_events.py ([Note: checkpoint events] in
fsdpx/checkpoint/saving.py), which calls, on rank 0::

    publisher.event("checkpoint_saved", step=step, detail={"path": ..., "tag": ...,
                    "bytes": n, "duration_s": dt, "async": background})
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

import torch
from torch import nn

from fsdpx.comm.counted import comm_log
from fsdpx.config import TelemetryConfig
from fsdpx.errors import RankFailureError
from fsdpx.telemetry.dump import make_dump
from fsdpx.telemetry.flops import StepMeter, device_peak_tflops
from fsdpx.telemetry.moe_load import moe_load
from fsdpx.telemetry.node import node_from_env
from fsdpx.telemetry.phases import StepPhases, phase_clock
from fsdpx.telemetry.probes import AllocatorProbe, NvmlProbe, host_rss
from fsdpx.telemetry.sigterm import SigtermHook
from fsdpx.telemetry.wire.protocol import (
    COMM_SPLIT_FIELDS,
    EVENT_KINDS,
    PHASE_FIELDS,
    RECORD_FIELDS,
    ProtocolError,
)
from fsdpx.telemetry.wire.relay import Relay
from fsdpx.telemetry.wire.runs import RunIdentity
from fsdpx.telemetry.wire.transport import (
    Connection,
    connect,
    open_socket,
    parse_address,
    read_secret,
)

# Record field -> fsdpx.comm kind (the record's sent_* fields, PROTOCOL.md).
_SENT_FIELDS = {
    "sent_all_gather": "all_gather_single",
    "sent_reduce_scatter": "reduce_scatter",
    "sent_all_to_all": "all_to_all_single",
    "sent_all_reduce": "all_reduce",
}

# The values of StepPhases.seconds_per_phase, in its order.
_TIMED_FIELDS = PHASE_FIELDS + COMM_SPLIT_FIELDS
log = logging.getLogger("fsdpx.telemetry")
_BATCH = 512  # records per frame: ~200 KB, well under MAX_FRAME_BYTES
_TRACEBACK_CHARS = 4000
_RETRY_MAX_S = 5.0


class _StepResult(Protocol):
    @property
    def global_step(self) -> int: ...
    @property
    def skipped(self) -> bool: ...
    @property
    def grad_norm(self) -> float | None: ...
    @property
    def loss_scale(self) -> float: ...


class _EngineView(Protocol):
    optimizer: torch.optim.Optimizer


@dataclass
class PublisherStats:
    """Sender-side counters (read them from any thread; values are approximate)."""

    records_sent: int = 0
    events_sent: int = 0
    events_dropped: int = 0
    """Events lost in a failed send (records lost are the publisher's `dropped`)."""
    connects: int = 0
    send_failures: int = 0
    sender_errors: int = 0
    dumps_sent: int = 0
    """Hang dumps sent in answer to a monitor's dump_request."""


def _plain(value: Any, depth: int = 0) -> Any:
    """`value` with anything msgpack cannot carry turned into str (event details come
    from user code: paths, tensors, dataclasses)."""
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    if depth < 4 and isinstance(value, dict):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if depth < 4 and isinstance(value, list | tuple):
        return [_plain(v, depth + 1) for v in value]
    return str(value)


class Publisher:
    """Publishes this rank's records and events (module docstring).

    Args:
        cfg: the telemetry config section.
        rank / local_rank / world_size: this process's place in the job.
        device: the training device (CUDA: allocator stats, NVML, async loss copy).
        module: the root module, for the one-time FLOP measurement (None: none).
        optimizer: the optimizer, for the first step's lr (None: the first record's lr
            is None; later ones come from the engine's optimizer).
        param_dtype: precision.param_dtype, to pick the device peak for MFU.
        install_hooks: chain sys.excepthook (exception event), register atexit (exit
            event, final flush) and chain SIGTERM (exit event "terminated", see
            fsdpx/telemetry/sigterm.py); all are undone by close().
        total_steps: the run's length, sent in the start event (the monitor's ETA).
        run: this launch's run id and job, the same on every rank (start.py agrees on
            them); None: from the config, a fresh run id when it names none (right for
            a one-process job only). See fsdpx/telemetry/wire/runs.py [Note: run identity].

    Example::

        pub = Publisher(cfg.telemetry, rank=0, local_rank=0, world_size=1,
                        device=torch.device("cpu"))
        pub.event("checkpoint_saved", step=10, detail={"path": "ckpt/10"})
        pub.close()
    """

    def __init__(
        self,
        cfg: TelemetryConfig,
        *,
        rank: int,
        local_rank: int,
        world_size: int,
        device: torch.device,
        module: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        param_dtype: str = "fp32",
        compiled: bool = False,
        install_hooks: bool = True,
        total_steps: int | None = None,
        run: RunIdentity | None = None,
    ) -> None:
        self.cfg = cfg
        if run is None:
            run = RunIdentity.for_launch(cfg.run_id, cfg.job, env=os.environ)
        self.run = run
        self.rank, self.local_rank, self.world_size = rank, local_rank, world_size
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.node = node_from_env(os.environ)  # [Note: node identity] in telemetry/node.py
        self.device = device
        self.address = parse_address(cfg.relay)
        self.stats = PublisherStats()
        self._secret = read_secret(cfg.secret_env)
        self._records: deque[tuple[Any, ...]] = deque(maxlen=cfg.queue_size)
        # Bytes sent per collective kind up to the previous step ([Note: one comm log]).
        self._comm_totals = comm_log().totals()
        self._events: deque[dict[str, Any]] = deque(maxlen=cfg.queue_size)
        self._dropped_queue = 0  # written by the training thread only
        self._dropped_send = 0  # written by the sender thread only
        self._losses: list[torch.Tensor] = []
        self._last_step_end: float | None = None
        self._last_step: int | None = None  # for hang dumps (sender thread reads it)
        self._alloc = AllocatorProbe(device)
        self._nvml: NvmlProbe | None = None  # made on the sender thread (NVML init is slow)
        self._peak = device_peak_tflops(device, param_dtype)
        self._meter = StepMeter()
        # Phase times per step ([Note: phase spans] in fsdpx/telemetry/phases.py).
        self._clock = phase_clock()
        self._clock.enable(device)
        self._clock.take()  # what ran before this publisher is no step of its
        moe_load().take()  # likewise the expert load ([Note: one expert-load counter])
        if cfg.measure_flops and module is not None and not compiled:
            self._meter.arm(module)
        # The lr the next step will use: read before each step's optimizer.step().
        self._lr = None if optimizer is None else self._lr_of(optimizer)
        self._conn: Connection | None = None
        self._retry_at = 0.0
        self._backoff = 0.5
        self._warned: set[str] = set()
        self._closed = False
        self.relay: Relay | None = None
        if local_rank == 0 and cfg.start_relay:
            self.relay = self._start_relay()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="fsdpx-telemetry", daemon=True)
        self._prev_excepthook = None
        self._sigterm = SigtermHook(lambda: self.close(reason="terminated"))
        if install_hooks:
            self._prev_excepthook = sys.excepthook
            sys.excepthook = self._excepthook
            atexit.register(self.close)
            self._sigterm.install()  # [Note: chaining SIGTERM]
        self._hooks = install_hooks
        start: dict[str, Any] = {"world_size": world_size, "device": str(device), "job": run.job}
        if total_steps is not None:  # the monitor's ETA
            start["total_steps"] = total_steps
        self.event("start", step=0, detail=start)
        self._thread.start()

    # --- training-thread API ------------------------------------------------------------

    @property
    def dropped(self) -> int:
        """Records lost so far: pushed out of the full queue, or in a failed send."""
        return self._dropped_queue + self._dropped_send

    @property
    def queued(self) -> int:
        """Records waiting to be sent."""
        return len(self._records)

    @property
    def events_queued(self) -> int:
        """Events waiting to be sent."""
        return len(self._events)

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Remember a micro-step's loss (the engine calls this from backward)."""
        self._losses.append(loss.detach())

    def on_step(self, engine: _EngineView, result: _StepResult) -> None:
        """Queue the record of the optimizer step that just finished (never blocks,
        never raises: a failure here is counted in stats.sender_errors and logged once)."""
        try:
            self._on_step(engine, result)
        except Exception as exc:
            self.stats.sender_errors += 1
            self._warn_once("on_step", f"telemetry: a step's record was lost ({exc!r})")

    def _on_step(self, engine: _EngineView, result: _StepResult) -> None:
        now = time.perf_counter()
        if self._meter.measuring:
            self._meter.finish()
            now = time.perf_counter()  # the measured step's time is not representative
            self._last_step_end = None
        step_time = None if self._last_step_end is None else now - self._last_step_end
        self._last_step_end = now
        self._last_step = result.global_step
        loss_value, loss_host, ready = self._loss_to_host()
        allocated, reserved, peak = self._alloc.at_step()
        totals = comm_log().totals()
        sent = {f: totals[k] - self._comm_totals[k] for f, k in _SENT_FIELDS.items()}
        self._comm_totals = totals
        lr = self._lr
        self._lr = self._lr_of(engine.optimizer)  # the scheduler has stepped: next step's
        item = (
            result.global_step,
            time.time(),
            lr,
            result.grad_norm,
            result.loss_scale,
            result.skipped,
            step_time,
            allocated,
            reserved,
            peak,
            loss_value,
            loss_host,
            ready,
            self._clock.take(),
            sent,
            moe_load().take(),
        )
        if len(self._records) == self._records.maxlen:
            self._dropped_queue += 1
        self._records.append(item)
        if result.skipped:
            self.event(
                "overflow", step=result.global_step, detail={"loss_scale": result.loss_scale}
            )

    def event(self, kind: str, *, step: int | None = None, detail: Any = None) -> None:
        """Publish an event (never blocks, never raises for a bad detail value).

        Args:
            kind: one of EVENT_KINDS ("checkpoint_saved", "checkpoint_loaded", ...).
            step: the optimizer step it belongs to.
            detail: a str or a dict (e.g. {"path", "bytes", "duration_s"}).
        Raises:
            ValueError: unknown kind (a programming error, caught in tests).
        """
        if kind not in EVENT_KINDS:
            raise ValueError(f"telemetry event kind must be one of {EVENT_KINDS}; got {kind!r}")
        if len(self._events) == self._events.maxlen:
            self.stats.events_dropped += 1
        self._events.append(
            {
                "rank": self.rank,
                "host": self.host,
                "time": time.time(),
                "kind": kind,
                "step": step,
                "detail": _plain(detail),
                "run_id": self.run.run_id,
            }
        )

    def record_exception(self, exc: BaseException, *, step: int | None = None) -> None:
        """Publish an "exception" event with a traceback summary of `exc`."""
        text = "".join(traceback.format_exception(exc))[-_TRACEBACK_CHARS:]
        detail: dict[str, Any] = {
            "type": type(exc).__name__,
            "message": str(exc)[:1000],
            "traceback": text,
        }
        if isinstance(exc, RankFailureError):
            # The monitor shows this rank as stopped by that one, not failed on its own.
            detail["failed_rank"] = exc.failed_rank
        self.event("exception", step=step, detail=detail)

    def close(self, *, reason: str | None = None, timeout_s: float = 3.0) -> None:
        """Send an "exit" event, flush what is queued (bounded by timeout_s), stop the
        sender and any in-process relay, undo the hooks. Idempotent.

        Args:
            reason: the exit event's reason; None: "terminated" after a SIGTERM (the job
                was preempted or cancelled), else "closed".
        """
        if self._closed:
            return
        self._closed = True
        if reason is None:
            reason = "terminated" if self._sigterm.received else "closed"
        self._meter.abort()
        self._clock.disable()
        detail = {"reason": reason, "dropped": self.dropped}
        detail["events_dropped"] = self.stats.events_dropped
        self.event("exit", step=None, detail=detail)
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        if self._hooks:
            if sys.excepthook == self._excepthook:
                sys.excepthook = self._prev_excepthook or sys.__excepthook__
            atexit.unregister(self.close)
            self._sigterm.uninstall()
        if self.relay is not None:
            self.relay.wait_for_sources(timeout_s)
            self.relay.stop()

    def _excepthook(
        self, typ: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        try:
            self.record_exception(exc.with_traceback(tb))
            self.close(reason="exception")
        finally:
            (self._prev_excepthook or sys.__excepthook__)(typ, exc, tb)

    def _loss_to_host(self) -> tuple[float | None, torch.Tensor | None, Any]:
        losses, self._losses = self._losses, []
        if not losses:
            return None, None, None
        loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        if loss.device.type != "cuda":
            return float(loss), None, None
        host = torch.empty((), dtype=torch.float32, pin_memory=True)
        host.copy_(loss, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return None, host, ready

    @staticmethod
    def _lr_of(optimizer: torch.optim.Optimizer) -> float | None:
        lr = optimizer.param_groups[0].get("lr")
        # A tensor lr (capturable optimizers) would sync to read here; leave it out.
        return float(lr) if isinstance(lr, int | float) else None

    # --- set-up helpers -----------------------------------------------------------------

    def _start_relay(self) -> Relay | None:
        """Start an in-process relay when nobody answers at the address (local rank 0)."""
        try:
            open_socket(self.address, 0.5).close()
            if self.cfg.log_path is not None:
                self._warn_once(
                    "log",
                    f"telemetry.log_path={self.cfg.log_path!r} is unused: a relay already "
                    f"listens at {self.address} and writes its own log (its --log)",
                )
            return None
        except OSError:
            pass
        relay = Relay(self.address, secret=self._secret, log_path=self.cfg.log_path)
        try:
            self.address = relay.bind()
        except (OSError, ValueError) as exc:
            self._warn_once("relay", f"telemetry: could not start a relay at {self.address}: {exc}")
            return None
        relay.start_thread()
        return relay

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    # --- sender thread ------------------------------------------------------------------

    def _run(self) -> None:
        self._nvml = NvmlProbe.for_device(self.device)
        while True:
            self._wake.wait(self.cfg.poll_interval_s)
            self._wake.clear()
            stopping = self._stopping
            try:
                self._pump(final=stopping)
                self._answer_requests()
            except Exception as exc:  # the sender must survive anything
                self.stats.sender_errors += 1
                self._warn_once("sender", f"telemetry sender error (continuing): {exc!r}")
            if stopping:
                break
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _pump(self, *, final: bool) -> None:
        if self._conn is None and not self._connect(final):
            return
        while self._records or self._events:
            records = self._take_records(final)
            if records and not self._send("records", records):
                return  # events stay queued: only the failed batch is lost
            events = [self._events.popleft() for _ in range(min(64, len(self._events)))]
            if not records and not events:
                return  # the oldest record's loss copy has not finished yet
            if events and not self._send("events", events):
                return

    def _answer_requests(self) -> None:
        """Answer the relay's `dump_request`s with this rank's hang dump ([Note: dumping
        from the sender thread] in fsdpx/telemetry/dump.py)."""
        conn = self._conn
        if conn is None:
            return
        try:
            messages = conn.poll()
        except (OSError, ProtocolError) as exc:  # ConnectionError is an OSError
            self._drop_connection(f"reading from {self.address} failed ({exc})")
            return
        for message in messages:
            if message.get("type") != "dump_request":
                continue  # nothing else is sent to ranks (forward compatible)
            run = message.get("run_id")
            if run is not None and run != self.run.run_id:
                continue  # a request for another run on this relay
            dump = make_dump(
                message.get("request_id"),
                rank=self.rank,
                host=self.host,
                pid=self.pid,
                run_id=self.run.run_id,
                step=self._last_step,
            )
            try:
                conn.send({"type": "dump", "dump": _plain(dump)}, timeout_s=self.cfg.send_timeout_s)
            except (OSError, ProtocolError) as exc:
                self._drop_connection(f"sending a hang dump to {self.address} failed ({exc})")
                return
            self.stats.dumps_sent += 1

    def _drop_connection(self, why: str) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._retry_at = time.monotonic() + self._backoff
        self._warn_once("read", f"telemetry: {why}")

    def _connect(self, final: bool) -> bool:
        if time.monotonic() < self._retry_at and not final:
            return False
        try:
            self._conn = connect(
                self.address,
                role="rank",
                secret=self._secret,
                timeout_s=self.cfg.send_timeout_s,
                rank=self.rank,
                local_rank=self.local_rank,
                world_size=self.world_size,
                host=self.host,
                pid=self.pid,
                run_id=self.run.run_id,
                job=self.run.job,
            )
        except (OSError, ProtocolError) as exc:
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(_RETRY_MAX_S, self._backoff * 2)
            self._warn_once(
                "connect",
                f"telemetry: no relay at {self.address} ({exc}); keeping the last "
                f"{self.cfg.queue_size} records until one answers",
            )
            return False
        self.stats.connects += 1
        self._backoff = 0.5
        return True

    def _send(self, kind: str, items: list[dict[str, Any]]) -> bool:
        assert self._conn is not None
        try:
            self._conn.send({"type": kind, kind: items}, timeout_s=self.cfg.send_timeout_s)
        except (OSError, ProtocolError) as exc:
            self.stats.send_failures += 1
            if kind == "records":
                self._dropped_send += len(items)
            else:
                self.stats.events_dropped += len(items)
            self._conn.close()
            self._conn = None
            self._retry_at = time.monotonic() + self._backoff
            self._warn_once("send", f"telemetry: sending to {self.address} failed ({exc})")
            return False
        if kind == "records":
            self.stats.records_sent += len(items)
        else:
            self.stats.events_sent += len(items)
        return True

    def _take_records(self, final: bool) -> list[dict[str, Any]]:
        retries, ooms = self._alloc.counters()
        device = self._nvml.sample() if self._nvml is not None else {}
        rss = host_rss()
        out: list[dict[str, Any]] = []
        while self._records and len(out) < _BATCH:
            ready = self._records[0][12]
            if ready is None:  # no loss copy to wait for: the phase events, if any
                ready = self._records[0][13].last_event
            if ready is not None and not ready.query():
                if not final:
                    break
                ready.synchronize()  # shutting down: the last loss is worth the wait
            item = self._records.popleft()
            out.append(self._record(item, retries, ooms, device, rss))
        return out

    def _record(
        self, item: tuple[Any, ...], retries: Any, ooms: Any, device: dict[str, Any], rss: Any
    ) -> dict[str, Any]:
        (step, wall, lr, grad_norm, scale, skipped, step_time, allocated, reserved, peak) = item[
            :10
        ]
        loss_value, loss_host = item[10], item[11]
        phases: StepPhases = item[13]
        loss = float(loss_host.item()) if loss_host is not None else loss_value
        flops = self._meter.flops_per_step
        tflops = flops / step_time / 1e12 if flops and step_time else None
        tokens = self.cfg.tokens_per_step
        record = dict.fromkeys(RECORD_FIELDS)
        record.update(device)
        record.update(
            rank=self.rank,
            local_rank=self.local_rank,
            host=self.host,
            pid=self.pid,
            step=step,
            time=wall,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            loss_scale=scale,
            skipped=skipped,
            step_time_s=step_time,
            tokens_per_s=tokens / step_time if tokens and step_time else None,
            mem_allocated=allocated,
            mem_reserved=reserved,
            mem_peak=peak,
            alloc_retries=retries,
            ooms=ooms,
            host_rss=rss,
            tflops=tflops,
            mfu=tflops / self._peak if tflops is not None and self._peak else None,
            comm_bytes=self._meter.comm_bytes_per_step,
            dropped=self.dropped,
            run_id=self.run.run_id,
            job=self.run.job,
            node=self.node,
        )
        record.update(zip(_TIMED_FIELDS, phases.seconds_per_phase(), strict=True))
        record.update(item[14])
        record.update(item[15])
        return record
