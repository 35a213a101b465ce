"""What a relay refuses beyond framing (monitor/PROTOCOL.md, "What the relay checks"):
msgpack timestamps and bytes map keys, records and events of another rank, hellos with
missing or mistyped fields; and what it keeps: the last step a rank reported, an event
too large for a history frame (as a stand-in). Each refusal is an "error" frame and a
closed connection, and every other connection goes on."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from fsdpx.telemetry.wire.history import History
from fsdpx.telemetry.wire.logfile import iter_log
from fsdpx.telemetry.wire.protocol import (
    MAX_FRAME_BYTES,
    RECORD_FIELDS,
    FrameDecoder,
    ProtocolError,
    check_welcome,
    encode_frame,
    make_hello,
)
from fsdpx.telemetry.wire.relay import Relay
from fsdpx.telemetry.wire.transport import Connection, connect, open_socket


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[Relay]:
    relay = Relay(str(tmp_path / "r.sock"), log_path=tmp_path / "r.tlm")
    relay.bind()
    relay.start_thread()
    yield relay
    relay.stop()


def _wait(pred: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _rank(relay: Relay, rank: int, host: str = "h") -> Connection:
    return connect(relay.address, role="rank", secret=None, timeout_s=5, rank=rank, host=host)


def _record(rank: int, step: Any, host: str = "h") -> dict[str, Any]:
    return {**dict.fromkeys(RECORD_FIELDS), "rank": rank, "host": host, "step": step}


def _send_body(conn: Connection, body: bytes) -> None:
    """A hand-made frame (fsdpx's encoder would refuse what these tests send)."""
    conn.sock.sendall(struct.pack(">I", len(body)) + body)


def _read_until_closed(conn: Connection) -> None:
    """Read what the relay sends until it closes; raise its error frame's reason as a
    client would (ProtocolError)."""
    messages: list[dict[str, Any]] = []
    conn.sock.settimeout(10.0)
    while data := conn.sock.recv(1 << 16):
        messages += conn.decoder.feed(data)
    conn.close()
    for message in messages:
        if message["type"] == "error":
            raise ProtocolError(f"relay closed the connection: {message['reason']}")


def _history(relay: Relay) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    frames = [msgpack.unpackb(body) for body in relay.history.frames()]
    return [r for f in frames for r in f["records"]], [e for f in frames for e in f["events"]]


class _Monitor:
    """A live monitor collecting what the relay forwards (history first)."""

    def __init__(self, relay: Relay) -> None:
        self.conn = connect(relay.address, role="monitor", secret=None, timeout_s=5)
        self.messages: list[dict[str, Any]] = []

    def until(self, pred: Callable[[list[dict[str, Any]]], bool]) -> None:
        deadline = time.monotonic() + 20
        while not pred(self.messages):
            assert time.monotonic() < deadline, self.messages[-3:]
            self.messages += self.conn.receive(timeout_s=0.2)

    def items(self, key: str) -> list[dict[str, Any]]:
        return [i for m in self.messages for i in m.get(key, [])]


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (
            {"type": "records", "records": [{**_record(0, 4), "time": msgpack.Timestamp(1, 0)}]},
            r"msgpack timestamp at records\[0\]\.time is not allowed",
        ),
        (
            {"type": "records", "records": [dict(_record(0, 4).items() | {(b"loss", 1.0)})]},
            r"map key b'loss' at records\[0\] is a bytes; map keys must be str",
        ),
    ],
    ids=["timestamp", "bytes_key"],
)
def test_timestamps_and_bytes_keys_are_refused_and_kept_nowhere(
    relay: Relay, tmp_path: Path, bad: dict[str, Any], match: str
) -> None:
    monitor = _Monitor(relay)
    hostile, other = _rank(relay, 0), _rank(relay, 1)
    hostile.send({"type": "records", "records": [_record(0, 3)]})
    other.send({"type": "records", "records": [_record(1, 1)]})
    _wait(lambda: relay.stats.records_in == 2)
    _send_body(hostile, msgpack.packb(bad))
    with pytest.raises(ProtocolError, match=f"relay closed the connection: {match}") as refused:
        _read_until_closed(hostile)
    reason = str(refused.value).removeprefix("relay closed the connection: ")
    other.send({"type": "records", "records": [_record(1, 2)]})  # the other rank goes on
    monitor.until(lambda _: (1, 2) in {(r["rank"], r["step"]) for r in monitor.items("records")})
    monitor.until(lambda _: any(e["kind"] == "disconnected" for e in monitor.items("events")))
    other.close()
    (gone,) = [e for e in monitor.items("events") if e["kind"] == "disconnected"]
    # The step the rank last reported, and why it went.
    assert (gone["rank"], gone["step"]) == (0, 3)
    assert gone["detail"]["reason"] == f"rejected: {reason}"
    seen = {(r["rank"], r["step"]) for r in monitor.items("records")}
    assert seen == {(0, 3), (1, 1), (1, 2)}  # never the bad step 4
    records, _ = _history(relay)
    assert {(r["rank"], r["step"]) for r in records} == {(0, 3), (1, 1), (1, 2)}
    assert relay.stats.bad_connections == 1 and relay.stats.records_in == 3
    monitor.conn.close()
    relay.stop()
    logged = [
        r for m in iter_log(tmp_path / "r.tlm") if m["type"] == "records" for r in m["records"]
    ]
    assert {(r["rank"], r["step"]) for r in logged} == {(0, 3), (1, 1), (1, 2)}


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (
            {"type": "records", "records": [_record(0, 1), _record(1, 1)]},
            r"records\[1\] is for rank 1 on host 'h', but this connection's hello said "
            r"rank 0 on host 'h': a rank's connection publishes only that rank's",
        ),
        (
            {"type": "events", "events": [{"rank": 0, "host": "elsewhere", "kind": "exit"}]},
            r"events\[0\] is for rank 0 on host 'elsewhere', but this connection's hello",
        ),
        (
            {"type": "events", "events": [{"kind": "exit"}]},  # no identity at all
            r"events\[0\] is for rank None on host None, but this connection's hello",
        ),
    ],
    ids=["other_rank", "other_host", "no_identity"],
)
def test_a_rank_connection_publishes_only_its_own_items(
    relay: Relay, message: dict[str, Any], match: str
) -> None:
    impostor, honest = _rank(relay, 0), _rank(relay, 1)
    impostor.send(message)
    with pytest.raises(ProtocolError, match=f"relay closed the connection: {match}"):
        _read_until_closed(impostor)
    honest.send({"type": "records", "records": [_record(1, 5)]})
    _wait(lambda: relay.stats.records_in == 1)
    honest.close()
    _wait(lambda: not relay._conns)
    records, events = _history(relay)
    # Nothing of the refused frame (not even its rank 0 item) was kept; rank 1's only
    # record is its own, and rank 0's end says why.
    assert [(r["rank"], r["step"]) for r in records] == [(1, 5)]
    assert [(e["rank"], e["kind"]) for e in events] == [(0, "disconnected"), (1, "disconnected")]
    assert events[0]["detail"]["reason"].startswith("rejected: ")


def test_a_relay_connection_carries_other_ranks(relay: Relay) -> None:
    downstream = connect(relay.address, role="relay", secret=None, timeout_s=5)
    downstream.send({"type": "records", "records": [_record(5, 1, "n1"), _record(6, 1, "n2")]})
    _wait(lambda: relay.stats.records_in == 2)
    assert relay.stats.bad_connections == 0
    downstream.close()


def _handshake(relay: Relay, role: str, **fields: Any) -> dict[str, Any]:
    """Raw handshake with exactly these hello fields (transport.connect fills host/pid)."""
    with open_socket(relay.address, 5.0) as sock:
        decoder = FrameDecoder()
        challenge: list[dict[str, Any]] = []
        while not challenge:
            challenge = decoder.feed(sock.recv(4096))
        hello, auth = make_hello(challenge[0], role=role, secret=None, **fields)
        sock.sendall(encode_frame(hello))
        answer: list[dict[str, Any]] = []
        while not answer:
            answer = decoder.feed(sock.recv(4096))
        check_welcome(answer[0], auth)
        return answer[0]


@pytest.mark.parametrize(
    ("role", "fields", "match"),
    [
        ("rank", {"rank": 0, "pid": 1}, "hello field 'host' is required for role 'rank'"),
        ("rank", {"rank": 0, "host": "h"}, "hello field 'pid' is required for role 'rank'"),
        ("rank", {"host": "h", "pid": 1}, "hello field 'rank' is required for role 'rank'"),
        ("monitor", {"host": "h"}, "hello field 'pid' is required for role 'monitor'"),
        ("relay", {"pid": 1}, "hello field 'host' is required for role 'relay'"),
        ("rank", {"rank": "0", "host": "h", "pid": 1}, "'rank' must be an int >= 0; got str '0'"),
        ("rank", {"rank": True, "host": "h", "pid": 1}, "'rank' must be an int >= 0; got bool"),
        ("rank", {"rank": -1, "host": "h", "pid": 1}, "'rank' must be an int >= 0; got int -1"),
        ("monitor", {"host": b"h", "pid": 1}, "'host' must be a str; got bytes"),
        ("monitor", {"host": "h", "pid": 1.5}, "'pid' must be an int; got float"),
        ("monitor", {"host": "h", "pid": 1, "run_id": 7}, "'run_id' must be a str; got int"),
        ("monitor", {"host": "h", "pid": 1, "job": ["x"]}, "'job' must be a str; got list"),
        ("rank", {"rank": 0, "host": "h", "pid": 1, "world_size": 0}, "'world_size' must be an"),
        # A monitor's request for batch frames (coalesce.py): seconds, within range.
        (
            "monitor",
            {"host": "h", "pid": 1, "batch_s": "0.5"},
            r"'batch_s' must be a number of seconds from 0.01 to 10.0; got str",
        ),
        ("monitor", {"host": "h", "pid": 1, "batch_s": True}, "'batch_s' must be a number"),
        ("monitor", {"host": "h", "pid": 1, "batch_s": 0}, "'batch_s' must be a number"),
        ("monitor", {"host": "h", "pid": 1, "batch_s": 3600.0}, "'batch_s' must be a number"),
        ("monitor", {"host": "h", "pid": 1, "batch_s": float("nan")}, "'batch_s' must be a"),
    ],
)
def test_hello_fields_are_checked(
    relay: Relay, role: str, fields: dict[str, Any], match: str
) -> None:
    with pytest.raises(ProtocolError, match=f"relay refused the connection: .*{match}"):
        _handshake(relay, role, **fields)
    _wait(lambda: relay.stats.bad_connections == 1)
    # Optional fields may be nil; the relay goes on serving.
    welcome = _handshake(relay, "monitor", host="h", pid=1, rank=None, run_id=None)
    assert welcome["type"] == "welcome"


def test_disconnected_reports_the_last_int_step(relay: Relay) -> None:
    rank = _rank(relay, 0)
    rank.send({"type": "records", "records": [_record(0, 4), _record(0, None)]})
    rank.send({"type": "records", "records": [{"rank": 0, "host": "h"}]})  # no step at all
    _wait(lambda: relay.stats.records_in == 3)
    rank.close()
    _wait(lambda: len(_history(relay)[1]) == 1)
    (event,) = _history(relay)[1]
    assert (event["kind"], event["step"]) == ("disconnected", 4)
    assert event["detail"] == {"reason": "connection closed before an exit event"}


def _largest_event(rank: int) -> dict[str, Any]:
    """An exception event whose "events" frame body is exactly MAX_FRAME_BYTES."""
    event: dict[str, Any] = {"rank": rank, "host": "h", "time": 1.0, "kind": "exception"}
    event["step"] = 9
    event["detail"] = {"type": "E", "message": "", "traceback": ""}
    base = len(encode_frame({"type": "events", "events": [event]})) - 4
    # str headers: 1 byte up to 31 chars, 5 bytes from 65,536 on.
    event["detail"]["traceback"] = "x" * (MAX_FRAME_BYTES - base - 4)
    assert len(encode_frame({"type": "events", "events": [event]})) - 4 == MAX_FRAME_BYTES
    return event


def test_a_legal_event_too_large_for_history_is_kept_as_a_stand_in(
    relay: Relay, tmp_path: Path
) -> None:
    live = _Monitor(relay)
    rank = _rank(relay, 0)
    event = _largest_event(0)
    rank.send({"type": "events", "events": [event]})
    rank.send({"type": "events", "events": [{**event, "kind": "exit", "detail": "done"}]})
    live.until(lambda _: len(live.items("events")) == 2)
    assert live.items("events")[0] == event  # live: whole
    late = _Monitor(relay)
    late.until(lambda ms: any(m["type"] == "history" and not m["more"] for m in ms))
    stand_in, done = late.items("events")
    size = len(msgpack.packb(event))
    assert stand_in == {
        "rank": 0,
        "host": "h",
        "time": 1.0,
        "kind": "exception",
        "step": 9,
        "detail": f"[left out of the relay's history: this event encodes to {size} bytes, "
        "more than a history frame holds; the live frame and the relay's log have it whole]",
        "run_id": None,  # a known event field the event did not carry
        "truncated": size,
    }
    assert done["detail"] == "done" and relay.history.truncated == 1
    rank.close()
    live.conn.close()
    late.conn.close()
    relay.stop()
    logged = [e for m in iter_log(tmp_path / "r.tlm") if m["type"] == "events" for e in m["events"]]
    assert logged[0] == event  # the log: whole


def test_history_stand_in_of_a_record_keeps_the_small_fields() -> None:
    history = History(recent=4, sparse=0, max_events=4, max_ranks=4)
    record = {**_record(2, 7), "loss": 0.5, "notes": "n" * MAX_FRAME_BYTES, "phase": 1.0}
    history.add_records([record])
    history.add_records([_record(2, 8)])
    (body,) = history.frames()
    stand_in, after = msgpack.unpackb(body)["records"]
    size = len(msgpack.packb(record))
    assert stand_in == {**_record(2, 7), "loss": 0.5, "phase": 1.0, "truncated": size}
    assert after == _record(2, 8) and history.truncated == 1
    huge_host = {**_record(3, 1), "host": "h" * MAX_FRAME_BYTES}
    history.add_records([huge_host])  # a value of a known field too large: nil
    stand_in = msgpack.unpackb(list(history.frames())[-1])["records"][-1]
    assert stand_in["host"] is None and stand_in["step"] == 1
