"""A telemetry client written only from monitor/PROTOCOL.md: raw sockets, msgpack, hmac
and zstandard, nothing imported from fsdpx. It starts the relay the way the page says
(`python -m fsdpx.telemetry.relay`), authenticates with a secret from the environment,
publishes as a rank, reads as a monitor, is refused the way the page says, and reads the
replay log. If this test needs fsdpx's code to pass, the page is not enough."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zstandard

SPEC = Path(__file__).resolve().parent.parent / "monitor" / "PROTOCOL.md"
SECRET_TEXT = "correct horse battery staple"
MAX_FRAME_BYTES = 1 << 20


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _proof(k: bytes, ns: bytes, nc: bytes, role: str) -> bytes:
    return _mac(k, b"fsdpx-telemetry-v1 hello", ns, nc, role.encode("ascii"))


def _session_key(k: bytes, ns: bytes, nc: bytes) -> bytes:
    return _mac(k, b"fsdpx-telemetry-v1 session", ns, nc)


def _tag(s: bytes, direction: bytes, seq: int, body: bytes) -> bytes:
    return _mac(s, direction, struct.pack(">Q", seq), body)


class RefusedError(Exception):
    """The relay sent an error frame (its reason is the message)."""


class Client:
    """One connection, as PROTOCOL.md describes it."""

    def __init__(self, port: int, role: str, secret: bytes, **hello: Any) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=20)
        self.buf = b""
        self.key: bytes | None = None
        self.seq = {b"C": 0, b"S": 0}
        challenge = self.read()
        assert challenge["type"] == "challenge" and challenge["version"] == 1
        assert challenge["auth"] == "hmac-sha256" and len(challenge["nonce"]) == 32
        ns, nc = challenge["nonce"], os.urandom(32)
        message = {"type": "hello", "version": 1, "role": role, **hello}
        message.update(nonce=nc, auth=_proof(secret, ns, nc, role))
        self.write(message)
        welcome = self.read()  # plain; an "error" raises
        self.key = _session_key(secret, ns, nc)
        assert welcome["type"] == "welcome"
        assert hmac.compare_digest(welcome["auth"], _mac(self.key, b"welcome"))

    def write(self, message: dict[str, Any]) -> None:
        body = msgpack.packb(message, use_bin_type=True)
        if self.key is not None:
            body = _tag(self.key, b"C", self.seq[b"C"], body) + body
            self.seq[b"C"] += 1
        assert 1 <= len(body) <= MAX_FRAME_BYTES
        self.sock.sendall(struct.pack(">I", len(body)) + body)

    def read(self) -> dict[str, Any]:
        """The next message; RefusedError for an error frame, EOFError when closed."""
        while True:
            if len(self.buf) >= 4:
                (length,) = struct.unpack(">I", self.buf[:4])
                assert 1 <= length <= MAX_FRAME_BYTES
                if len(self.buf) >= 4 + length:
                    body, self.buf = self.buf[4 : 4 + length], self.buf[4 + length :]
                    break
            data = self.sock.recv(1 << 16)
            if not data:
                raise EOFError("relay closed the connection")
            self.buf += data
        if self.key is not None:
            tag, body = body[:32], body[32:]
            expected = _tag(self.key, b"S", self.seq[b"S"], body)
            assert hmac.compare_digest(tag, expected), "relay frame with a wrong tag"
            self.seq[b"S"] += 1
        message: dict[str, Any] = msgpack.unpackb(body, raw=False)
        if message["type"] == "error":
            raise RefusedError(message["reason"])
        return message

    def read_until_closed(self) -> None:
        """Read until the relay closes (an error frame raises RefusedError)."""
        while True:
            try:
                self.read()
            except EOFError:
                return

    def close(self) -> None:
        self.sock.close()


def _record(rank: int, step: int) -> dict[str, Any]:
    # A subset of the record keys: a reader treats a missing one as nil.
    return {"rank": rank, "host": "spec-host", "step": step, "time": 1e9 + step, "loss": 2.0}


def test_the_spec_test_vector() -> None:
    """The hex values in PROTOCOL.md's test vector come out of the page's arithmetic."""
    text = SPEC.read_text()
    vector = dict(re.findall(r"^\| (.+?) \| `([0-9a-f]{64})` \|$", text, re.MULTILINE))
    k, ns, nc = SECRET_TEXT.encode("utf-8"), bytes(range(32)), bytes(range(32, 64))
    s = _session_key(k, ns, nc)
    golden = bytes.fromhex(
        "82 a4 74 79 70 65 a6 65 76 65 6e 74 73 a6 65 76 65 6e 74 73 90".replace(" ", "")
    )
    assert golden == msgpack.packb({"type": "events", "events": []})
    computed = [_proof(k, ns, nc, "rank"), s, _mac(s, b"welcome"), _tag(s, b"C", 0, golden)]
    assert list(vector.values()) == [v.hex() for v in computed], vector


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[tuple[int, Path, subprocess.Popen[str]]]:
    """`python -m fsdpx.telemetry.relay --listen 127.0.0.1:0 --log ...` with the secret in
    the environment; yields (port, log path, process) once it printed its address."""
    log = tmp_path / "spec.tlm"
    env = {**os.environ, "FSDPX_TELEMETRY_SECRET": SECRET_TEXT}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fsdpx.telemetry.relay",
            "--listen",
            "127.0.0.1:0",
            "--log",
            str(log),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.fullmatch(r"fsdpx relay listening on tcp://127\.0\.0\.1:(\d+)\n", line)
        assert found, line
        yield int(found.group(1)), log, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def _history(monitor: Client) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    records: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    while True:
        message = monitor.read()
        assert message["type"] == "history"
        records += message["records"]
        events += message["events"]
        if not message["more"]:
            return records, events


def _live(monitor: Client, kind: str) -> list[dict[str, Any]]:
    """Items of the next live frame of `kind` (frames of other types are skipped)."""
    while (message := monitor.read())["type"] != kind:
        pass
    items: list[dict[str, Any]] = message[kind]
    return items


def test_a_client_written_from_the_spec(
    relay: tuple[int, Path, subprocess.Popen[str]],
) -> None:
    port, log, proc = relay
    secret = SECRET_TEXT.encode("utf-8")
    me = {"host": "spec-host", "pid": os.getpid()}
    rank = Client(port, "rank", secret, rank=0, local_rank=0, world_size=2, **me)
    rank.write({"type": "records", "records": [_record(0, 1), _record(0, 2)]})
    start = {"rank": 0, "host": "spec-host", "time": 1e9, "kind": "start", "step": 0}
    rank.write({"type": "events", "events": [{**start, "detail": {"world_size": 2}}]})
    rank.write({"type": "future-type", "x": 1})  # unknown types are ignored

    monitor = Client(port, "monitor", secret, **me)
    # The rank's frames and the monitor's hello arrive on two connections: wait for
    # the history to hold them (a fresh monitor each time), never for a time.
    records, events = _history(monitor)
    deadline = time.monotonic() + 30
    while len(records) < 2 or not events:
        assert time.monotonic() < deadline, (records, events)
        monitor.close()
        monitor = Client(port, "monitor", secret, **me)
        records, events = _history(monitor)
    assert [(r["rank"], r["step"]) for r in records] == [(0, 1), (0, 2)]
    assert [e["kind"] for e in events] == ["start"]

    rank.write({"type": "records", "records": [_record(0, 3)]})
    assert [r["step"] for r in _live(monitor, "records")] == [3]

    # Not the spec: a timestamp, then a record of another rank. Each: a tagged error,
    # the close, and the monitor hears the rank is gone and why.
    bad = {"type": "records", "records": [{**_record(0, 4), "time": msgpack.Timestamp(1, 0)}]}
    rank.write(bad)
    with pytest.raises(RefusedError, match=r"msgpack timestamp at records\[0\]\.time"):
        rank.read_until_closed()
    (gone,) = _live(monitor, "events")
    assert (gone["kind"], gone["rank"], gone["step"]) == ("disconnected", 0, 3)
    assert gone["detail"]["reason"].startswith("rejected: msgpack timestamp")

    impostor = Client(port, "rank", secret, rank=1, **me)
    impostor.write({"type": "records", "records": [_record(0, 5)]})
    with pytest.raises(RefusedError, match=r"records\[0\] is for rank 0 on host 'spec-host'"):
        impostor.read_until_closed()
    assert _live(monitor, "events")[0]["rank"] == 1

    # A hello without host/pid, and a wrong secret: a plain error, then the close.
    with pytest.raises(RefusedError, match="hello field 'host' is required for role 'rank'"):
        Client(port, "rank", secret, rank=2, pid=1)
    with pytest.raises(RefusedError, match="wrong HMAC proof"):
        Client(port, "monitor", b"not the secret", **me)

    monitor.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0

    # The replay log: zstd, whose content is plain frames.
    with open(log, "rb") as f:
        content = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True).read()
    messages = []
    while content:
        (length,) = struct.unpack(">I", content[:4])
        messages.append(msgpack.unpackb(content[4 : 4 + length], raw=False))
        content = content[4 + length :]
    assert messages[0]["type"] == "log" and messages[0]["version"] == 1
    hellos = [m for m in messages if m["type"] == "hello"]
    # The rank, the monitor(s), the impostor: not the refused hellos.
    assert [h["role"] for h in hellos[:: len(hellos) - 1]] == ["rank", "rank"]
    assert {h["role"] for h in hellos[1:-1]} == {"monitor"}
    assert all("auth" not in h and "nonce" not in h for h in hellos)
    steps = [r["step"] for m in messages if m["type"] == "records" for r in m["records"]]
    assert steps == [1, 2, 3]  # never the refused step 4 or 5
    kinds = [e["kind"] for m in messages if m["type"] == "events" for e in m["events"]]
    assert kinds == ["start", "disconnected", "disconnected"]
    assert "future-type" not in {m["type"] for m in messages}
