"""Wire protocol: golden bytes, round trips (hypothesis), limits, and a running relay fed
10,000 malformed, oversized and truncated frames and random bytes."""

from __future__ import annotations

import random
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpx.telemetry.wire.logfile import iter_log, open_log_writer
from fsdpx.telemetry.wire.protocol import (
    MAX_FRAME_BYTES,
    RECORD_FIELDS,
    FrameAuth,
    FrameDecoder,
    ProtocolError,
    encode_frame,
    make_challenge,
    make_hello,
)
from fsdpx.telemetry.wire.relay import Relay
from fsdpx.telemetry.wire.transport import connect, parse_address
from fsdpx.telemetry.wire.validate import validate_message

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
messages = st.dictionaries(st.text(max_size=8), values, max_size=6).map(
    lambda d: {**d, "type": "records"}
)


def test_golden_bytes() -> None:
    frame = encode_frame({"type": "events", "events": []})
    assert frame.hex(" ") == (
        "00 00 00 15 82 a4 74 79 70 65 a6 65 76 65 6e 74 73 a6 65 76 65 6e 74 73 90"
    )


@settings(max_examples=200, deadline=None)
@given(msgs=st.lists(messages, min_size=1, max_size=5), cuts=st.lists(st.integers(0, 400)))
def test_round_trip_in_any_chunking(msgs: list[dict[str, Any]], cuts: list[int]) -> None:
    stream = b"".join(encode_frame(m) for m in msgs)
    decoder = FrameDecoder()
    out: list[dict[str, Any]] = []
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    for a, b in zip(points, points[1:], strict=False):
        out += decoder.feed(stream[a:b])
    assert out == msgs and decoder.buffered == 0


@settings(max_examples=100, deadline=None)
@given(msgs=st.lists(messages, min_size=1, max_size=5))
def test_round_trip_authenticated(msgs: list[dict[str, Any]]) -> None:
    sender = FrameAuth(b"k" * 32, b"C", b"S")
    decoder = FrameDecoder(auth=FrameAuth(b"k" * 32, b"S", b"C"))
    assert decoder.feed(b"".join(encode_frame(m, auth=sender) for m in msgs)) == msgs


@settings(max_examples=2000, deadline=None)
@given(data=st.binary(max_size=64))
def test_random_bytes_only_raise_protocol_error(data: bytes) -> None:
    decoder = FrameDecoder()
    try:
        for message in decoder.feed(data):
            assert isinstance(message, dict) and isinstance(message["type"], str)
    except ProtocolError:
        pass


def test_oversized_length_is_rejected_from_the_header_alone() -> None:
    decoder = FrameDecoder()
    with pytest.raises(ProtocolError, match=r"frame length 1048577 outside 1\.\.1048576"):
        decoder.feed(struct.pack(">I", MAX_FRAME_BYTES + 1))
    with pytest.raises(ProtocolError):  # the decoder stays failed: drop the connection
        decoder.feed(encode_frame({"type": "events", "events": []}))
    with pytest.raises(ProtocolError, match="frame length 0"):
        FrameDecoder().feed(b"\x00\x00\x00\x00")


def test_truncated_frame_waits_for_the_rest() -> None:
    frame = encode_frame({"type": "events", "events": []})
    decoder = FrameDecoder()
    assert decoder.feed(frame[:-1]) == [] and decoder.buffered == len(frame) - 1
    assert decoder.feed(frame[-1:]) == [{"type": "events", "events": []}]


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (msgpack.packb([1, 2]), "must be a map with a str 'type'"),
        (msgpack.packb({"kind": "x"}), "must be a map with a str 'type'"),
        (msgpack.packb({1: 2, "type": "x"}), "not valid msgpack"),
        (msgpack.packb({"type": "x", "t": msgpack.ExtType(5, b"x")}), "extension type 5"),
        # msgpack decodes its Timestamp extension itself (ext_hook never sees it), and
        # strict_map_key lets bytes keys through: the validation walk rejects both.
        (
            msgpack.packb({"type": "records", "time": msgpack.Timestamp(1, 0)}),
            r"msgpack timestamp at time is not allowed",
        ),
        (
            msgpack.packb(
                {"type": "records", "records": [{"rank": 0, "time": msgpack.Timestamp(1, 0)}]}
            ),
            r"msgpack timestamp at records\[0\]\.time is not allowed",
        ),
        (msgpack.packb({"type": "x", b"rank": 0}), "map key b'rank' at the top level is a bytes"),
        (
            msgpack.packb({"type": "events", "events": [{"detail": [{b"k": 1}]}]}),
            r"map key b'k' at events\[0\]\.detail\[0\] is a bytes; map keys must be str",
        ),
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb({"type": "x"}) + b"\x00", "not valid msgpack"),
    ],
)
def test_bad_bodies(body: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        FrameDecoder().feed(struct.pack(">I", len(body)) + body)


def test_encode_refuses_oversized_and_unencodable() -> None:
    with pytest.raises(ProtocolError, match="exceeds MAX_FRAME_BYTES=1048576; split the batch"):
        encode_frame({"type": "records", "blob": b"x" * MAX_FRAME_BYTES})
    with pytest.raises(ProtocolError, match="not encodable"):
        encode_frame({"type": "records", "x": object()})


def test_deep_nesting_is_checked_without_recursion() -> None:
    # 1020 one-item arrays: deeper than Python's recursion limit (1000), within msgpack's
    # unpacker (1023); built by hand, msgpack's packer stops at 512.
    head = msgpack.packb({"type": "x", "v": None})[:-1]  # the map without v's value
    body = head + b"\x91" * 1020 + msgpack.packb(msgpack.Timestamp(1, 0))
    with pytest.raises(ProtocolError, match="msgpack timestamp at v"):
        FrameDecoder().feed(struct.pack(">I", len(body)) + body)


def test_validate_message_shapes() -> None:
    validate_message({"type": "records", "records": [dict.fromkeys(RECORD_FIELDS)]})
    validate_message({"type": "future", "anything": 1})  # unknown types pass
    with pytest.raises(ProtocolError, match="needs 'records': a list of maps"):
        validate_message({"type": "records", "records": [1]})
    with pytest.raises(ProtocolError, match="int 'rank' and a str 'host'"):
        validate_message({"type": "events", "events": [{"rank": "0"}]})
    mine = {"type": "records", "records": [{"rank": 0, "host": "h"}]}
    validate_message(mine, owner=(0, "h"))
    validate_message({"type": "records", "records": [{"rank": 1, "host": "h"}]})  # a relay's
    with pytest.raises(ProtocolError, match=r"records\[0\] is for rank 0 on host 'h', but"):
        validate_message(mine, owner=(1, "h"))


def test_version_mismatch_is_refused() -> None:
    challenge = make_challenge(auth_required=False)
    with pytest.raises(ProtocolError, match="relay speaks protocol version 2"):
        make_hello({**challenge, "version": 2}, role="rank", secret=None)


def test_address_parsing() -> None:
    assert parse_address("unix:/a/b").path == "/a/b"
    assert parse_address("./x.sock").path == "./x.sock"
    a = parse_address("tcp://[::1]:5")
    assert (a.host, a.port) == ("::1", 5) and str(a) == "tcp://[::1]:5"
    assert parse_address("localhost:7").port == 7
    with pytest.raises(ValueError, match="neither a Unix socket path"):
        parse_address("nohost")


def test_log_survives_a_truncated_tail(tmp_path: Path) -> None:
    path = tmp_path / "run.tlm"
    with open_log_writer(path, flush_interval_s=0.0) as log:
        for step in range(100):
            log.write_message({"type": "records", "records": [{"step": step}]})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 20])  # a crash mid-block
    steps = [r["step"] for m in iter_log(path) if m["type"] == "records" for r in m["records"]]
    assert steps == list(range(len(steps))) and 90 <= len(steps) < 100
    path.write_bytes(b"not a log")
    with pytest.raises(ValueError, match="is not a telemetry log"):
        list(iter_log(path))


def test_log_reading_stops_at_a_bad_frame_keeping_those_before(tmp_path: Path) -> None:
    # A log written by a relay that let a msgpack timestamp in: reading keeps every
    # message before that frame (all in one decompressed chunk) and stops there.
    path = tmp_path / "old.tlm"
    bad = msgpack.packb({"type": "records", "records": [{"time": msgpack.Timestamp(1, 0)}]})
    with open_log_writer(path, flush_interval_s=0.0) as log:
        for step in range(3):
            log.write_message({"type": "records", "records": [{"step": step}]})
        log.write_frame(struct.pack(">I", len(bad)) + bad)
        log.write_message({"type": "records", "records": [{"step": 3}]})
    steps = [r["step"] for m in iter_log(path) if m["type"] == "records" for r in m["records"]]
    assert steps == [0, 1, 2]


# --- a running relay under garbage -----------------------------------------------------


def _bad_payloads(n: int, seed: int = 0) -> list[tuple[str, bytes]]:
    """(kind, bytes) of n bad inputs; kind says whether the relay must count it."""
    rng = random.Random(seed)
    hello_msg, _ = make_hello(
        make_challenge(auth_required=False), role="rank", secret=None, rank=0, host="h", pid=1
    )
    hello = encode_frame(hello_msg)
    good = encode_frame({"type": "records", "records": [{"rank": 0, "host": "h", "step": 1}]})
    out = []
    for i in range(n):
        kind = i % 10
        if kind == 0:  # random bytes, no hello
            out.append(
                ("bad", struct.pack(">I", rng.randint(1, 64)) + rng.randbytes(rng.randint(1, 64)))
            )
        elif kind == 1:  # oversized length
            out.append(
                ("bad", hello + struct.pack(">I", rng.randint(MAX_FRAME_BYTES + 1, 2**32 - 1)))
            )
        elif kind == 2:  # zero length
            out.append(("bad", hello + b"\x00\x00\x00\x00"))
        elif kind == 3:  # valid frame, body not a message
            body = msgpack.packb(rng.choice([[1], 3, "x", {"t": 1}]))
            out.append(("bad", hello + struct.pack(">I", len(body)) + body))
        elif kind == 4:  # bad record shape
            out.append(("bad", hello + encode_frame({"type": "records", "records": [[1, 2]]})))
        elif kind == 5:  # truncated good frame, then the peer goes away
            out.append(("truncated", hello + good[: rng.randint(1, len(good) - 1)]))
        elif kind == 6:  # records before the hello
            out.append(("bad", good))
        elif kind == 7:  # a msgpack timestamp (PROTOCOL.md: extension types are rejected)
            bad: dict[str, Any] = {"type": "records", "records": [{"rank": 0, "host": "h"}]}
            bad["records"][0]["step"] = 2
            bad["records"][0]["time"] = msgpack.Timestamp(rng.randint(0, 2**32), 0)
            body = msgpack.packb(bad)
            out.append(("bad", hello + struct.pack(">I", len(body)) + body))
        elif kind == 8:  # a bytes map key (PROTOCOL.md: string keys)
            body = msgpack.packb({"type": "records", "records": [{b"rank": 0, "step": 3}]})
            out.append(("bad", hello + struct.pack(">I", len(body)) + body))
        else:  # random bytes after a good hello and frame
            junk = rng.randbytes(rng.randint(8, 200))
            out.append(("maybe", hello + good + junk))
    return out


def test_relay_survives_10000_bad_inputs(tmp_path: Path) -> None:
    relay = Relay(str(tmp_path / "r.sock"))
    address = relay.bind()
    relay.start_thread()
    try:
        payloads = _bad_payloads(10_000)
        assert address.path is not None
        for _, data in payloads:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(address.path)
                # Read the challenge: closing a Unix socket with unread data resets the
                # peer's side, and the relay would see a reset instead of the data.
                s.recv(4096)
                s.sendall(data)
        must_count = sum(kind == "bad" for kind, _ in payloads)
        deadline = time.monotonic() + 60
        # Exact, not a sleep: a connection leaves _conns only after every frame read
        # from it was handled (test_frames_of_a_peer_that_left_are_taken_in pins that).
        while relay.stats.accepted < len(payloads) or relay._conns:
            assert time.monotonic() < deadline, relay.stats
            time.sleep(0.05)
        stats = relay.stats
        assert stats.accepted == len(payloads)
        # Every bad one is counted; "maybe" ones count when the junk breaks the framing.
        assert must_count <= stats.bad_connections <= len(payloads) - len(payloads) // 10
        # The good frame ahead of the junk was decoded and taken in every time.
        assert stats.frames_in == stats.records_in == sum(k == "maybe" for k, _ in payloads)
        # Nothing of the timestamp (step 2) and bytes-key (step 3) frames got in.
        kept = [msgpack.unpackb(body) for body in relay.history.frames()]
        assert {r["step"] for m in kept for r in m["records"]} == {1}
        assert relay.history.num_ranks == 1  # (host "h", rank 0) of the "maybe" frames
        # After all that, a good rank and a monitor still work.
        rank = connect(address, role="rank", secret=None, timeout_s=5, rank=3, host="ok", pid=1)
        rank.send({"type": "records", "records": [{"rank": 3, "host": "ok", "step": 42}]})
        monitor = connect(address, role="monitor", secret=None, timeout_s=5)
        seen: list[Any] = []
        deadline = time.monotonic() + 10
        while not any(r.get("host") == "ok" for r in seen) and time.monotonic() < deadline:
            for m in monitor.receive(timeout_s=0.5):
                seen += m.get("records", [])
        assert {"rank": 3, "host": "ok", "step": 42} in seen
        rank.close()
        monitor.close()
    finally:
        relay.stop()
    assert relay._thread is not None and not relay._thread.is_alive()


def test_frames_of_a_peer_that_left_are_taken_in(tmp_path: Path) -> None:
    # A rank sends its hello and a records frame and is gone before the relay serves:
    # the relay's challenge and welcome then fail (EPIPE), but the frame it had sent
    # must still be taken in, and before the connection counts as closed (its
    # "disconnected" event comes after its records). Deterministic: the relay thread
    # starts only after the peer closed.
    relay = Relay(str(tmp_path / "r.sock"), log_path=tmp_path / "r.tlm")
    address = relay.bind()
    assert address.path is not None
    hello, _ = make_hello(
        make_challenge(auth_required=False), role="rank", secret=None, rank=5, host="h", pid=1
    )
    records = {"type": "records", "records": [{"rank": 5, "host": "h", "step": 7}]}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(address.path)
        s.sendall(encode_frame(hello) + encode_frame(records))
    relay.start_thread()
    try:
        deadline = time.monotonic() + 10
        while relay.stats.accepted < 1 or relay._conns:
            assert time.monotonic() < deadline, relay.stats
            time.sleep(0.01)
        assert relay.stats.frames_in == relay.stats.records_in == 1
        assert relay.stats.bad_connections == 0
        assert relay._monitors == {}
    finally:
        relay.stop()
    kinds = [m["type"] for m in iter_log(tmp_path / "r.tlm")]
    assert kinds[-3:] == ["hello", "records", "events"], kinds


def test_stop_takes_in_what_already_arrived(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A rank's last frames are in the relay's socket buffer when stop() comes (a job
    # stopping its relay right after the ranks' exit events): they must reach the log.
    # Deterministic: the loop is held between two select()s while the frame arrives.
    relay = Relay(str(tmp_path / "r.sock"), log_path=tmp_path / "r.tlm")
    address = relay.bind()
    relay.start_thread()
    rank = connect(address, role="rank", secret=None, timeout_s=5, rank=2, host="h", pid=1)
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(10)

    monkeypatch.setattr(relay, "_expire_handshakes", hold)
    assert entered.wait(10)
    rank.send({"type": "records", "records": [{"rank": 2, "host": "h", "step": 9}]})
    rank.close()
    relay.stop(timeout_s=0)  # sets the flag; the held loop sees it on its next check
    release.set()
    assert relay._thread is not None
    relay._thread.join(10)
    assert not relay._thread.is_alive()
    steps = [
        r["step"]
        for m in iter_log(tmp_path / "r.tlm")
        if m["type"] == "records"
        for r in m["records"]
    ]
    assert steps == [9]
