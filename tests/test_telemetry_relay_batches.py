"""Relay coalescing (fsdpx/telemetry/wire/coalesce.py [Note: relay coalescing],
monitor/PROTOCOL.md "Batches"): a monitor that asks (hello `batch_s`) gets its live traffic
as `batch` frames, one per interval, with every item, in order; a monitor that does not
ask gets the frames as they came; history, log and other clients are unchanged; frames
too large for a batch and dumps pass whole, after what was pending; hostile `batch`
frames are refused by the relay and survived by the monitor. Waits for states, never
for time (the batch interval only decides how many frames, and the counts checked hold
for any timing)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from fsdpx.telemetry.wire.coalesce import BUDGET_BYTES, Coalescer, encode_batches
from fsdpx.telemetry.wire.logfile import iter_log
from fsdpx.telemetry.wire.protocol import (
    MAX_FRAME_BYTES,
    RECORD_FIELDS,
    TAG_BYTES,
    ProtocolError,
    decode_body,
    encode_frame,
    make_challenge,
)
from fsdpx.telemetry.wire.relay import Relay
from fsdpx.telemetry.wire.transport import Connection, connect
from monitor.receiver import Batch, RelayClient

SECRET = b"batches"


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[Relay]:
    # With a secret: batch frames are tagged like every frame after the welcome.
    relay = Relay(str(tmp_path / "r.sock"), secret=SECRET, log_path=tmp_path / "r.tlm")
    relay.bind()
    relay.start_thread()
    yield relay
    relay.stop()


def _rank(relay: Relay, rank: int) -> Connection:
    return connect(relay.address, role="rank", secret=SECRET, timeout_s=5, rank=rank, host="h")


def _record(rank: int, step: int) -> dict[str, Any]:
    return {**dict.fromkeys(RECORD_FIELDS), "rank": rank, "host": "h", "step": step}


class _Monitor:
    def __init__(self, relay: Relay, **hello: Any) -> None:
        self.conn = connect(relay.address, role="monitor", secret=SECRET, timeout_s=5, **hello)
        self.messages: list[dict[str, Any]] = []

    def until(self, pred: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 120  # only ends a failure: generous for loaded CI
        while not pred():
            assert time.monotonic() < deadline, [m["type"] for m in self.messages[-5:]]
            self.messages += self.conn.receive(timeout_s=0.2)

    @property
    def live(self) -> list[dict[str, Any]]:
        return [m for m in self.messages if m["type"] != "history"]

    def items(self, key: str) -> list[dict[str, Any]]:
        return [i for m in self.live for i in m.get(key, [])]


def test_asking_monitor_gets_batches_the_other_gets_frames(relay: Relay, tmp_path: Path) -> None:
    plain, batched = _Monitor(relay), _Monitor(relay, batch_s=1.0)
    ranks = [_rank(relay, 0), _rank(relay, 1)]
    steps = 20
    for step in range(1, steps + 1):
        for rank, conn in enumerate(ranks):
            conn.send({"type": "records", "records": [_record(rank, step)]})
    ranks[0].send({"type": "events", "events": [{"rank": 0, "host": "h", "kind": "exit"}]})
    ranks[0].close()
    ranks[1].close()  # without an exit event: the relay's "disconnected" event, batched too
    sent_frames = 2 * steps + 1

    def has_all(monitor: _Monitor) -> Callable[[], bool]:
        return lambda: (
            len(monitor.items("records")) == 2 * steps and len(monitor.items("events")) == 2
        )

    plain.until(has_all(plain))
    batched.until(has_all(batched))
    # The same items, each rank's records in step order, and the same events.
    for monitor in (plain, batched):
        for rank in (0, 1):
            got = [r["step"] for r in monitor.items("records") if r["rank"] == rank]
            assert got == list(range(1, steps + 1))
        kinds = sorted((e["rank"], e["kind"]) for e in monitor.items("events"))
        assert kinds == [(0, "exit"), (1, "disconnected")]
    # The plain monitor: the frames as they came (one per rank frame, plus the event).
    assert {m["type"] for m in plain.live} == {"records", "events"}
    assert len(plain.live) == sent_frames + 1
    # The batched monitor: batch frames only, fewer than the frames the ranks sent (each
    # one interval's worth), all counted by the relay.
    assert {m["type"] for m in batched.live} == {"batch"}
    assert len(batched.live) < sent_frames
    assert relay.stats.batches_out == len(batched.live)
    plain.conn.close()
    batched.conn.close()
    relay.stop()
    # The log keeps the frames as they came: no batch in it.
    logged = [m["type"] for m in iter_log(tmp_path / "r.tlm") if m["type"] != "hello"]
    assert logged.count("records") == 2 * steps and "batch" not in logged


def _big_event(rank: int) -> dict[str, Any]:
    """An event whose frame body is over the batch budget (but a legal frame)."""
    event: dict[str, Any] = {"rank": rank, "host": "h", "kind": "exception", "step": 1}
    event["detail"] = {"type": "E", "message": "", "traceback": "x" * (BUDGET_BYTES + 10)}
    assert len(encode_frame({"type": "events", "events": [event]})) - 4 <= MAX_FRAME_BYTES
    return event


def test_oversized_frames_and_dumps_pass_whole_after_what_was_pending(relay: Relay) -> None:
    # An interval longer than the test: only these frames make the batches go out.
    batched = _Monitor(relay, batch_s=10.0)
    rank = _rank(relay, 0)
    big = _big_event(0)
    rank.send({"type": "records", "records": [_record(0, 1)]})
    rank.send({"type": "events", "events": [big]}, timeout_s=10)
    rank.send({"type": "records", "records": [_record(0, 2)]})
    dump = {"rank": 0, "host": "h", "request_id": "r1", "threads": []}
    rank.send({"type": "dump", "dump": dump})
    batched.until(lambda: any(m["type"] == "dump" for m in batched.live))
    assert [m["type"] for m in batched.live] == ["batch", "events", "batch", "dump"]
    first, whole, second, _ = batched.live
    assert [r["step"] for r in first["records"]] == [1] and "events" not in first
    assert whole["events"] == [big]
    assert [r["step"] for r in second["records"]] == [2]
    rank.close()
    batched.conn.close()


def test_batches_split_under_the_frame_limit_in_order() -> None:
    # ~200 KiB records: a few per frame; every body fits a tagged frame and decodes.
    records = [{**_record(i % 3, i), "blob": "y" * 200_000} for i in range(12)]
    events = [{"rank": 0, "host": "h", "kind": "overflow", "step": i} for i in range(5)]
    bodies = encode_batches(records, events)
    assert len(bodies) > 1
    decoded = [decode_body(b) for b in bodies]
    assert all(len(b) <= MAX_FRAME_BYTES - TAG_BYTES for b in bodies)
    assert all(m["type"] == "batch" for m in decoded)
    assert [r for m in decoded for r in m.get("records", [])] == records
    assert [e for m in decoded for e in m.get("events", [])] == events
    # The coalescer sends what was pending as soon as the next frame would overflow the
    # budget, and holds the rest until due (or flushed).
    c = Coalescer(interval_s=0.5)
    assert c.add(records[:1], [], body_bytes=BUDGET_BYTES - 10, now=100.0) == []
    assert c.due == 100.5
    (out,) = c.add(records[1:2], [], body_bytes=20, now=100.1)
    assert decode_body(out)["records"] == records[:1]
    assert c.due == 100.6 and c.pending_bytes == 20
    (rest,) = c.flush()
    assert decode_body(rest)["records"] == records[1:2] and c.due is None
    assert c.flush() == [] and not c.fits(BUDGET_BYTES + 1)


def test_a_rank_sending_a_batch_is_refused_and_nothing_of_it_kept(
    relay: Relay, tmp_path: Path
) -> None:
    batched = _Monitor(relay, batch_s=0.05)
    hostile, honest = _rank(relay, 0), _rank(relay, 1)
    # Coalesced-looking traffic with another rank's record: a batch is the relay's to make.
    hostile.send({"type": "batch", "records": [_record(0, 1), _record(5, 1)], "events": []})
    with pytest.raises(ProtocolError, match="'batch' frames go from a relay to a monitor"):
        deadline = time.monotonic() + 120  # only ends a failure: generous for loaded CI
        while time.monotonic() < deadline:
            for message in hostile.receive(timeout_s=0.2):
                if message["type"] == "error":
                    raise ProtocolError(message["reason"])
    honest.send({"type": "records", "records": [_record(1, 1)]})
    batched.until(lambda: any(e["kind"] == "disconnected" for e in batched.items("events")))
    batched.until(lambda: len(batched.items("records")) == 1)
    assert [(r["rank"], r["step"]) for r in batched.items("records")] == [(1, 1)]
    assert relay.stats.records_in == 1 and relay.stats.bad_connections == 1
    honest.close()
    batched.conn.close()
    relay.stop()
    assert not any(m["type"] == "batch" for m in iter_log(tmp_path / "r.tlm"))


async def _serve_frames(bodies: list[dict[str, Any]], path: str) -> asyncio.AbstractServer:
    """A relay stand-in: handshake without a secret, then these messages, then it stays
    open (the monitor must keep going after bad ones)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(encode_frame(make_challenge(auth_required=False)))
        await reader.read(65536)  # the hello
        writer.write(encode_frame({"type": "welcome", "version": 1, "host": "x", "pid": 1}))
        for message in bodies:
            writer.write(encode_frame(message))
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            await reader.read()  # until the monitor goes

    return await asyncio.start_unix_server(handle, path)


def test_monitor_survives_hostile_batches(tmp_path: Path) -> None:
    """Shapes a relay must not send but a monitor must survive: lists that are not
    lists, items that are not maps, missing lists, unknown fields (checked by the model,
    which counts what it cannot use)."""
    path = str(tmp_path / "fake.sock")
    good = _record(3, 7)
    frames: list[dict[str, Any]] = [
        {"type": "batch", "records": "not a list", "events": {"a": 1}},
        {"type": "batch", "records": [1, None, "x", [good]], "extra": b"\x00"},
        {"type": "batch"},
        {"type": "batch", "records": [good], "events": [{"kind": "overflow", "rank": 3}]},
    ]
    batches: list[Batch] = []

    async def scenario() -> None:
        server = await _serve_frames(frames, path)
        client = RelayClient(path, on_batch=batches.append, on_status=lambda *_: None, batch_s=0.5)
        task = asyncio.create_task(client.run())
        deadline = time.monotonic() + 120  # only ends a failure: generous for loaded CI
        while not any(good in b.records for b in batches) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        server.close()

    asyncio.run(scenario())
    records = [r for b in batches for r in b.records]
    events = [e for b in batches for e in b.events]
    # The lists that were lists came through as sent (their bad items included: the model
    # sorts them out); the rest was skipped, and the client never failed.
    assert records == [1, None, "x", [good], good]
    assert events == [{"kind": "overflow", "rank": 3}]


def test_model_takes_hostile_batch_items_without_failing() -> None:
    from monitor.model import MonitorModel

    model = MonitorModel()
    good = {**_record(3, 7), "time": 1.0, "loss": 2.0}
    model.add_records([1, None, "x", [good], good], now=1.0)
    model.add_events([{"kind": "overflow"}, 5], now=1.0)
    assert set(model.snapshot(1.0).rows) == {3} and model.bad_records == 4


def test_hello_batch_s_is_sent_only_when_asked(tmp_path: Path) -> None:
    """What the receiver's hello carries (a relay that does not know the field ignores it)."""
    seen: list[dict[str, Any]] = []

    async def scenario(batch_s: float | None) -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(encode_frame(make_challenge(auth_required=False)))
            data = await reader.read(65536)
            seen.append(msgpack.unpackb(data[4:]))
            writer.close()

        path = str(tmp_path / f"hello-{batch_s}.sock")
        server = await asyncio.start_unix_server(handle, path)
        client = RelayClient(
            path,
            on_batch=lambda b: None,
            on_status=lambda *_: None,
            batch_s=batch_s,
            reconnect=False,
        )
        await asyncio.wait_for(client.run(), 30)
        server.close()

    asyncio.run(scenario(None))
    asyncio.run(scenario(0.5))
    assert "batch_s" not in seen[0] and seen[1]["batch_s"] == 0.5
