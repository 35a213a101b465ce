"""The publisher never disturbs training: relay absent, stalled (accepts, never reads) or
killed mid-run, training completes, nothing escapes, and the drop counter accounts for
every record that did not arrive. Also: events, the in-process relay, NVML fallbacks."""

from __future__ import annotations

import socket
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fsdpx.config import TelemetryConfig
from fsdpx.engine import StepResult
from fsdpx.errors import RankFailureError
from fsdpx.telemetry.probes import NvmlProbe, host_rss
from fsdpx.telemetry.publisher import Publisher
from fsdpx.telemetry.wire.logfile import iter_log
from fsdpx.telemetry.wire.protocol import (
    FrameDecoder,
    accept_hello,
    encode_frame,
    make_challenge,
    make_welcome,
)
from fsdpx.telemetry.wire.relay import Relay
from fsdpx.telemetry.wire.transport import connect

FAST = TelemetryConfig(enabled=True, start_relay=False, poll_interval_s=0.02, send_timeout_s=0.2)


def _publisher(cfg: TelemetryConfig, module: nn.Module | None = None, **kw: Any) -> Publisher:
    kw.setdefault("install_hooks", False)
    return Publisher(
        cfg, rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), module=module, **kw
    )


def _train(
    pub: Publisher, steps: int, after_step: Callable[[int], None] | None = None
) -> list[float]:
    """A plain training loop that feeds the publisher the way the engine does."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = types.SimpleNamespace(optimizer=opt)
    losses = []
    for step in range(1, steps + 1):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        pub.observe_loss(loss)
        opt.step()
        opt.zero_grad()
        pub.on_step(engine, StepResult(step, False, None, 1.0))
        losses.append(loss.item())
        if after_step is not None:
            after_step(step)
    return losses


def _accounted(pub: Publisher, steps: int) -> None:
    assert pub.stats.records_sent + pub.dropped + pub.queued == steps


def test_relay_absent(tmp_path: Path) -> None:
    pub = _publisher(replace(FAST, relay=str(tmp_path / "none.sock"), queue_size=10))
    losses = _train(pub, 50)
    pub.close()
    assert len(losses) == 50 and all(loss == loss for loss in losses)
    assert pub.stats.connects == 0 and pub.stats.records_sent == 0
    assert pub.dropped == 40 and pub.queued == 10  # the newest 10 were kept
    _accounted(pub, 50)


class _StalledRelay:
    """Accepts connections and, with handshake=True, completes the handshake; then never
    reads another byte."""

    def __init__(self, path: Path, *, handshake: bool) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(16)
        self.handshake = handshake
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.held.append(sock)
            if self.handshake:
                challenge = make_challenge(auth_required=False)
                sock.sendall(encode_frame(challenge))
                decoder = FrameDecoder()
                hello = None
                while hello is None:
                    decoder.push(sock.recv(1))  # byte by byte: read nothing past the hello
                    hello = decoder.next_message()
                sock.sendall(
                    encode_frame(make_welcome(accept_hello(hello, challenge, secret=None)))
                )

    def close(self) -> None:
        self.listener.close()
        for sock in self.held:
            sock.close()


def _events_accounted(pub: Publisher, published: int) -> None:
    stats = pub.stats
    assert stats.events_sent + stats.events_dropped + pub.events_queued == published


@pytest.mark.parametrize("handshake", [False, True], ids=["silent", "never_reads"])
def test_relay_stalled(tmp_path: Path, handshake: bool) -> None:
    path = tmp_path / "stalled.sock"
    stalled = _StalledRelay(path, handshake=handshake)
    pub = _publisher(replace(FAST, relay=str(path), queue_size=100_000))
    try:
        steps = 3000  # ~1.5 MB of records: more than a Unix socket buffers
        _train(pub, steps)
        if handshake:  # wait for the state asserted below: a send has timed out
            _wait_for(lambda: pub.stats.send_failures > 0)
        pub.close(timeout_s=60)  # returns once the sender has stopped
    finally:
        stalled.close()
    _accounted(pub, steps)
    _events_accounted(pub, 2)  # start and exit
    if handshake:  # sends started, then timed out: each failed batch is counted as lost
        # A failure may have lost records, events or both (a records batch can fit in
        # the socket buffer and the events frame after it not): [Note: telemetry accounting].
        lost = pub.dropped + pub.stats.events_dropped
        assert pub.stats.send_failures >= 1 and lost >= pub.stats.send_failures
        assert pub.stats.records_sent < steps
    else:  # never got past the handshake: nothing sent, nothing lost, all still queued
        assert pub.stats.connects == 0 and pub.queued == steps and pub.dropped == 0
        assert pub.events_queued == 2 and pub.stats.events_dropped == 0


def _wait_for(condition: Callable[[], bool], what: str = "condition") -> None:
    """Wait for a state. The bound only turns a hang into a failure; it is not a timing."""
    deadline = time.monotonic() + 120
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class _EventsStallConnection:
    """A relay connection whose socket buffer takes records frames but not events frames:
    the sequence that left `send_failures=2, dropped=0` on a machine with a larger buffer."""

    def __init__(self, sent: list[str]) -> None:
        self.sent = sent

    def send(self, message: dict[str, Any], *, timeout_s: float) -> None:
        if message["type"] == "events":
            raise TimeoutError("timed out")
        self.sent.append(message["type"])

    def close(self) -> None:
        pass


def test_failed_events_send_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[str] = []
    monkeypatch.setattr(
        "fsdpx.telemetry.publisher.connect", lambda *a, **k: _EventsStallConnection(sent)
    )
    pub = _publisher(replace(FAST, relay="unix:/nonexistent.sock", queue_size=1000))
    _train(pub, 40)
    pub.event("checkpoint_saved", step=40, detail={"path": "x"})
    _wait_for(lambda: pub.queued == 0 and pub.events_queued == 0, "both queues to empty")
    pub.close(timeout_s=60)  # the exit event goes out in a batch of its own, and fails
    assert pub.stats.send_failures >= 2 and "records" in sent
    assert pub.stats.records_sent == 40 and pub.dropped == 0
    # start, checkpoint_saved, exit: all lost in failed events sends, and counted as such.
    assert pub.stats.events_sent == 0 and pub.stats.events_dropped == 3
    _events_accounted(pub, 3)


def test_records_send_failure_keeps_queued_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """Events are taken from their queue only after the records batch before them went out:
    a failed records send loses that batch, not the events behind it."""
    attempts: list[str] = []

    class RecordsFailOnce:
        def send(self, message: dict[str, Any], *, timeout_s: float) -> None:
            attempts.append(message["type"])
            if message["type"] == "records" and attempts.count("records") == 1:
                raise TimeoutError("timed out")

        def close(self) -> None:
            pass

    monkeypatch.setattr("fsdpx.telemetry.publisher.connect", lambda *a, **k: RecordsFailOnce())
    pub = _publisher(replace(FAST, relay="unix:/nonexistent.sock", queue_size=1000))
    _train(pub, 10)
    _wait_for(lambda: pub.stats.events_sent >= 1, "the start event to go out")
    pub.close(timeout_s=60)
    assert pub.stats.send_failures == 1 and pub.stats.events_dropped == 0
    assert pub.stats.events_sent == 2  # start and exit both arrived
    _accounted(pub, 10)


def test_relay_killed_mid_run(tmp_path: Path) -> None:
    relay = Relay(str(tmp_path / "r.sock"))
    relay.bind()
    relay.start_thread()
    pub = _publisher(replace(FAST, relay=str(relay.address), queue_size=16))

    def kill_at_20(step: int) -> None:
        if step == 20:  # once the first 20 are sent (or dropped) and taken in
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not (
                pub.queued == 0 and relay.stats.records_in == pub.stats.records_sent > 0
            ):
                time.sleep(0.01)
            relay.stop()

    _train(pub, 200, kill_at_20)
    sent_before_kill = relay.stats.records_in
    pub.close()
    _accounted(pub, 200)
    # Everything after the kill is lost except the newest 16, which the queue still holds.
    assert pub.stats.records_sent == sent_before_kill > 0
    assert pub.queued == 16 and pub.dropped == 200 - 16 - sent_before_kill


def test_stalled_monitor_never_slows_ranks(tmp_path: Path) -> None:
    relay = Relay(str(tmp_path / "r.sock"), max_monitor_buffer=32 << 10)
    relay.bind()
    relay.start_thread()
    monitor = connect(relay.address, role="monitor", secret=None, timeout_s=5)  # never reads
    pub = _publisher(replace(FAST, relay=str(relay.address), queue_size=100_000))
    try:
        _train(pub, 2000)
        pub.close()
        deadline = time.monotonic() + 20
        while relay.stats.records_in < 2000 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert relay.stats.records_in == 2000 and pub.dropped == 0
        assert relay.stats.monitor_frames_dropped > 0
    finally:
        monitor.close()
        relay.stop()


@pytest.fixture
def relay_with_log(tmp_path: Path) -> Iterator[tuple[Relay, Path]]:
    log = tmp_path / "run.tlm"
    relay = Relay(str(tmp_path / "r.sock"), log_path=log)
    relay.bind()
    relay.start_thread()
    yield relay, log
    relay.stop()


def _events(log: Path) -> list[dict[str, Any]]:
    return [e for m in iter_log(log) if m["type"] == "events" for e in m["events"]]


def test_events_overflow_checkpoint_exception_exit(
    relay_with_log: tuple[Relay, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    relay, log = relay_with_log
    printed: list[Any] = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: printed.append(a))  # the hook before
    previous = sys.excepthook
    pub = _publisher(replace(FAST, relay=str(relay.address)), install_hooks=True)
    assert sys.excepthook == pub._excepthook
    engine = types.SimpleNamespace(optimizer=torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1))
    pub.on_step(engine, StepResult(1, True, None, 65536.0))
    pub.event("checkpoint_saved", step=1, detail={"path": Path("/ckpt/1"), "bytes": 10})
    with pytest.raises(ValueError, match="telemetry event kind must be one of"):
        pub.event("checkpoint_written")
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)  # what an uncaught error does
    assert printed and sys.excepthook is previous  # chained, then restored by close()
    relay.stop()
    events = _events(log)
    assert [e["kind"] for e in events] == [
        "start",
        "overflow",
        "checkpoint_saved",
        "exception",
        "exit",
    ]
    assert events[1]["detail"] == {"loss_scale": 65536.0} and events[1]["step"] == 1
    assert events[2]["detail"] == {"path": "/ckpt/1", "bytes": 10}
    assert events[3]["detail"]["type"] == "RuntimeError"
    assert 'raise RuntimeError("boom")' in events[3]["detail"]["traceback"]
    assert events[4]["detail"]["reason"] == "exception"


def test_rank_failure_events_name_the_failed_rank(relay_with_log: tuple[Relay, Path]) -> None:
    """A RankFailureError's exception event carries failed_rank (nil when unknown), so the
    monitor shows the rank as stopped by that peer; other exceptions carry none."""
    relay, log = relay_with_log
    pub = _publisher(replace(FAST, relay=str(relay.address)))
    pub.record_exception(RankFailureError("rank 1 vanished", failed_rank=1))
    pub.record_exception(RankFailureError("no rank recorded an error"))
    pub.record_exception(ValueError("this rank's own error"))
    pub.close()
    relay.stop()
    details = [e["detail"] for e in _events(log) if e["kind"] == "exception"]
    assert [d["type"] for d in details] == ["RankFailureError", "RankFailureError", "ValueError"]
    assert [d.get("failed_rank", "absent") for d in details] == [1, None, "absent"]


def test_local_rank_0_starts_a_relay_when_none_runs(tmp_path: Path) -> None:
    log = tmp_path / "inproc.tlm"
    cfg = replace(FAST, relay=str(tmp_path / "r.sock"), start_relay=True, log_path=str(log))
    pub0 = _publisher(cfg, module=None)
    assert pub0.relay is not None
    pub1 = Publisher(
        cfg, rank=1, local_rank=1, world_size=2, device=torch.device("cpu"), install_hooks=False
    )
    assert pub1.relay is None
    losses = _train(pub1, 5)
    _train(pub0, 5)
    pub1.close()
    pub0.close()  # waits for the other local ranks, then stops the relay and the log
    records = [r for m in iter_log(log) if m["type"] == "records" for r in m["records"]]
    assert sorted((r["rank"], r["step"]) for r in records) == [
        (rank, step) for rank in (0, 1) for step in range(1, 6)
    ]
    assert [r["loss"] for r in records if r["rank"] == 1] == pytest.approx(losses, rel=1e-6)


def test_flops_measured_on_first_training_step(relay_with_log: tuple[Relay, Path]) -> None:
    relay, log = relay_with_log
    model = nn.Linear(8, 1)
    pub = _publisher(replace(FAST, relay=str(relay.address)), module=model)
    engine = types.SimpleNamespace(optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    for step in (1, 2):
        model(torch.randn(4, 8)).sum().backward()
        pub.on_step(engine, StepResult(step, False, None, 1.0))
    pub.close()
    # forward 2*4*8 + weight grad 2*4*8 (no input grad): 128 FLOPs; no collectives.
    assert pub._meter.flops_per_step == 128 and pub._meter.comm_bytes_per_step == 0


def test_nvml_absent_or_failing_is_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    assert NvmlProbe.for_device(torch.device("cpu")).unavailable == "not a CUDA device"
    broken = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def no_driver() -> None:
        raise NVMLError("Driver Not Loaded")

    broken.NVMLError = NVMLError  # type: ignore[attr-defined]
    broken.nvmlInit = no_driver  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    probe = NvmlProbe.for_device(torch.device("cuda", 0))
    assert probe.unavailable == "NVML unavailable: Driver Not Loaded"
    assert probe.sample() == dict.fromkeys(probe.sample())  # all None, no raise
    assert all(v is None for v in probe.sample().values())


def test_nvml_maps_by_uuid_and_tolerates_missing_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("pynvml")
    handles = {"GPU-1234": "h-by-uuid"}
    calls = {"mem": 0}

    class NVMLError(Exception):
        pass

    def by_uuid(uuid: str) -> str:
        if uuid not in handles:
            raise NVMLError("Not Found")
        return handles[uuid]

    def memory(handle: str) -> Any:
        assert handle == "h-by-uuid"
        calls["mem"] += 1
        if calls["mem"] > 1:
            raise NVMLError("GPU is lost")
        return types.SimpleNamespace(used=1 << 30, total=80 << 30)

    def temperature(handle: str, sensor: int) -> int:
        raise NVMLError("Not Supported")

    fake.__dict__.update(
        NVMLError=NVMLError,
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByUUID=by_uuid,
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=87),
        nvmlDeviceGetPowerUsage=lambda h: 312_000,
        nvmlDeviceGetTemperature=temperature,
        NVML_TEMPERATURE_GPU=0,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(uuid="1234")
    )
    probe = NvmlProbe.for_device(torch.device("cuda", 0))
    assert probe.unavailable is None
    assert probe.sample() == {
        "device_mem_used": 1 << 30,
        "device_mem_total": 80 << 30,
        "device_util": 87,
        "device_power_w": 312.0,
        "device_temp_c": None,
    }
    # The device goes away: the probe goes inert instead of raising every step.
    assert all(v is None for v in probe.sample().values())
    assert probe.unavailable == "NVML memory query failed: GPU is lost"
    assert calls["mem"] == 2 and all(v is None for v in probe.sample().values())


def test_host_rss_reads_statm() -> None:
    rss = host_rss()
    assert rss is not None and rss > 10 << 20


def test_config_errors_name_the_key() -> None:
    from fsdpx.config import Config

    with pytest.raises(
        ValueError, match=r"'telemetry.send_timeout_s' must be a number of seconds > 0; got -1"
    ):
        Config.from_dict({"telemetry": {"send_timeout_s": -1}})
    with pytest.raises(
        ValueError, match=r"'telemetry.tokens_per_step' must be None or an integer >= 1; got 0"
    ):
        Config.from_dict({"telemetry": {"tokens_per_step": 0}})
    with pytest.raises(ValueError, match="did you mean"):
        Config.from_dict({"telemetry": {"queue_sise": 5}})
    with pytest.raises(
        ValueError, match=r"'telemetry.total_steps' must be an integer >= 1, or null; got 0"
    ):
        Config.from_dict({"telemetry": {"total_steps": 0}})


def test_start_event_carries_the_run_length(relay_with_log: tuple[Relay, Path]) -> None:
    """The monitor's ETA needs the run's length: from telemetry.total_steps, else the
    schedule's total_num_steps."""
    from fsdpx.config import Config
    from fsdpx.distributed import DistInfo
    from fsdpx.telemetry.start import start_telemetry

    relay, log = relay_with_log
    cfg = Config.from_dict(
        {
            "telemetry": {"enabled": True, "start_relay": False, "relay": str(relay.address)},
            "scheduler": {"type": "WarmupDecayLR", "warmup_num_steps": 2, "total_num_steps": 40},
        }
    )
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    model = nn.Linear(2, 2)
    pub = start_telemetry(cfg, info, model, torch.optim.SGD(model.parameters(), lr=1))
    assert pub is not None
    pub.close()  # also restores sys.excepthook
    relay.stop()
    assert _events(log)[0]["detail"]["total_steps"] == 40
