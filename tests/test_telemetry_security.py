"""Relay security: loopback/Unix by default (checked with getsockname), no public bind
without a secret, HMAC challenge-response per connection, tagged frames verified."""

from __future__ import annotations

import re
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsdpx.telemetry.wire.protocol import (
    AuthError,
    FrameAuth,
    FrameDecoder,
    ProtocolError,
    check_welcome,
    encode_frame,
    make_hello,
    make_welcome,
)
from fsdpx.telemetry.wire.relay import Relay
from fsdpx.telemetry.wire.transport import default_address, open_socket

SECRET = b"correct horse battery staple"


@pytest.fixture
def secure_relay() -> Iterator[Relay]:
    relay = Relay("127.0.0.1:0", secret=SECRET)
    relay.bind()
    relay.start_thread()
    yield relay
    relay.stop()


def _wait(pred: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():  # type: ignore[operator]
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_default_bind_is_a_private_unix_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    relay = Relay()
    address = relay.bind()
    try:
        assert address == default_address() and address.path is not None
        assert relay._listener is not None
        assert relay._listener.family == socket.AF_UNIX
        assert relay._listener.getsockname() == str(tmp_path / "fsdpx" / "telemetry.sock")
        assert stat.S_IMODE((tmp_path / "fsdpx").stat().st_mode) == 0o700
        assert stat.S_IMODE(Path(address.path).stat().st_mode) == 0o600
        with pytest.raises(ValueError, match="a relay already listens on"):
            Relay().bind()
    finally:
        relay.start_thread()
        relay.stop()
    assert not Path(address.path).exists()  # removed on stop


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_tcp_binds_loopback(host: str) -> None:
    relay = Relay(f"[{host}]:0" if ":" in host else f"{host}:0")
    try:
        relay.bind()
    except OSError:
        pytest.skip(f"{host} not available here")
    assert relay._listener is not None
    bound = relay._listener.getsockname()[0]
    relay.start_thread()
    relay.stop()
    assert bound in ("127.0.0.1", "::1")


@pytest.mark.parametrize("address", ["0.0.0.0:0", "[::]:0", "192.0.2.1:0"])
def test_public_bind_without_secret_refuses(address: str) -> None:
    with pytest.raises(ValueError, match=r"refusing to listen on .* without a shared secret"):
        Relay(address).bind()


def test_public_bind_with_secret_is_allowed() -> None:
    relay = Relay("0.0.0.0:0", secret=SECRET)
    relay.bind()
    assert relay._listener is not None and relay._listener.getsockname()[0] == "0.0.0.0"
    relay.start_thread()
    relay.stop()


def test_right_secret_connects_and_frames_arrive(secure_relay: Relay) -> None:
    from fsdpx.telemetry.wire.transport import connect

    rank = connect(secure_relay.address, role="rank", secret=SECRET, timeout_s=5, rank=0, host="h")
    rank.send({"type": "records", "records": [{"rank": 0, "host": "h", "step": 1}]})
    monitor = connect(secure_relay.address, role="monitor", secret=SECRET, timeout_s=5)
    _wait(lambda: secure_relay.stats.records_in == 1)
    history = monitor.receive(timeout_s=5)
    assert history[0]["type"] == "history" and history[0]["records"][0]["step"] == 1
    rank.close()
    monitor.close()
    assert secure_relay.stats.auth_failures == 0


def test_missing_or_wrong_secret_is_refused(secure_relay: Relay) -> None:
    from fsdpx.telemetry.wire.transport import connect

    with pytest.raises(AuthError, match="requires a shared secret and none was given"):
        connect(secure_relay.address, role="monitor", secret=None, timeout_s=5)
    with pytest.raises(ProtocolError, match="wrong HMAC proof"):
        connect(secure_relay.address, role="monitor", secret=b"guess", timeout_s=5)
    _wait(lambda: secure_relay.stats.auth_failures == 1)


def _handshake(relay: Relay) -> tuple[socket.socket, FrameAuth]:
    sock = open_socket(relay.address, 5.0)
    decoder = FrameDecoder()
    challenge = None
    while challenge is None:
        challenge = next(iter(decoder.feed(sock.recv(4096))), None)
    hello, auth = make_hello(challenge, role="rank", secret=SECRET, rank=0, host="h", pid=1)
    sock.sendall(encode_frame(hello))
    welcome: list[dict[str, object]] = []
    while not welcome:
        welcome = decoder.feed(sock.recv(4096))
    check_welcome(welcome[0], auth)
    assert auth is not None
    return sock, auth


def _error_then_close(sock: socket.socket, auth: FrameAuth | None) -> str:
    """The reason of the relay's "error" frame (tagged when `auth` is set: it comes after
    the welcome), which must be followed by the relay closing the connection."""
    sock.settimeout(10.0)
    decoder = FrameDecoder(auth=auth)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    (error,) = decoder.feed(data)
    assert error["type"] == "error" and decoder.buffered == 0
    return str(error["reason"])


@pytest.mark.parametrize("attack", ["untagged", "wrong_tag", "replayed", "reflected"])
def test_frames_without_or_with_wrong_hmac_are_rejected(secure_relay: Relay, attack: str) -> None:
    sock, auth = _handshake(secure_relay)
    message = {"type": "records", "records": [{"rank": 0, "host": "h", "step": 7}]}
    good = encode_frame(message, auth=auth)
    if attack == "untagged":
        bad = encode_frame(message)
    elif attack == "wrong_tag":
        bad = good[:4] + bytes([good[4] ^ 1]) + good[5:]
    elif attack == "replayed":
        sock.sendall(good)
        _wait(lambda: secure_relay.stats.records_in == 1)
        bad = good  # same frame again: its sequence number is spent
    else:  # a frame signed in the relay's direction
        bad = encode_frame(message, auth=FrameAuth(auth.key, b"S", b"C"))
    sock.sendall(bad)
    # Told why, in a frame the relay tagged (so a client can trust the reason), then closed.
    assert re.search(r"frame \d has a missing or wrong HMAC tag", _error_then_close(sock, auth))
    sock.close()
    _wait(lambda: secure_relay.stats.auth_failures == 1)
    assert secure_relay.stats.records_in == (1 if attack == "replayed" else 0)


def test_client_checks_the_relays_proof() -> None:
    mine = FrameAuth(b"a" * 32, b"C", b"S")
    impostor = FrameAuth(b"b" * 32, b"S", b"C")
    with pytest.raises(AuthError, match="welcome has a wrong HMAC proof"):
        check_welcome(make_welcome(impostor), mine)
    with pytest.raises(AuthError, match="wrong HMAC proof"):
        check_welcome(make_welcome(None), mine)
    with pytest.raises(ProtocolError, match="relay refused the connection: nope"):
        check_welcome({"type": "error", "reason": "nope"}, None)


def test_relay_cli_refuses_public_bind_and_serves_loopback(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "FSDPX_TELEMETRY_SECRET"}
    cmd = [sys.executable, "-m", "fsdpx.telemetry.wire.relay"]
    refused = subprocess.run(
        [*cmd, "--listen", "0.0.0.0:0"], capture_output=True, text=True, env=env, timeout=60
    )
    assert refused.returncode == 2
    assert "refusing to listen on tcp://0.0.0.0:0 without a shared secret" in refused.stderr
    log = tmp_path / "cli.tlm"
    sock_path = tmp_path / "cli.sock"
    proc = subprocess.Popen(
        [*cmd, "--listen", str(sock_path), "--log", str(log)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"fsdpx relay listening on unix:{sock_path}"
        from fsdpx.telemetry.wire.transport import connect

        conn = connect(str(sock_path), role="rank", secret=None, timeout_s=10, rank=0, host="h")
        conn.send({"type": "records", "records": [{"rank": 0, "host": "h", "step": 5}]})
        conn.close()
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    from fsdpx.telemetry.wire.logfile import iter_log

    steps = [r["step"] for m in iter_log(log) if m["type"] == "records" for r in m["records"]]
    assert steps == [5] and not sock_path.exists()


def test_relay_cli_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    """`kill <relay>` (SIGTERM, what process managers send) shuts down like Ctrl-C: the
    socket file is removed and the exit code is 0."""
    import os
    import signal
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "FSDPX_TELEMETRY_SECRET"}
    sock_path = tmp_path / "term.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsdpx.telemetry.wire.relay", "--listen", str(sock_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("fsdpx relay listening on unix:")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert not sock_path.exists()
