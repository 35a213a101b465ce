"""Addresses, default socket locations, secrets and a blocking client connection for the
telemetry protocol (stdlib + msgpack; the monitor may import it).

Address strings:
    "unix:/run/x.sock", "/run/x.sock", "./x.sock"   a Unix socket path
    "tcp://127.0.0.1:29687", "127.0.0.1:29687"      TCP (host may be a name; [::1]:p)
    None                                             this user's per-node default

The default is a Unix socket at $XDG_RUNTIME_DIR/fsdpx/telemetry.sock, else
/tmp/fsdpx-<uid>/telemetry.sock (folder mode 0700, checked to be ours). Where Unix
sockets are unavailable or the path is too long for sun_path, the fallback is loopback
TCP 127.0.0.1:DEFAULT_TCP_PORT.

Example::

    conn = connect(None, role="monitor", secret=None, timeout_s=2.0)
    for message in conn.receive(timeout_s=1.0):
        ...
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpx.telemetry.wire.protocol import (
    FrameAuth,
    FrameDecoder,
    ProtocolError,
    check_welcome,
    encode_frame,
    make_hello,
)

DEFAULT_TCP_PORT = 29687
DEFAULT_SECRET_ENV = "FSDPX_TELEMETRY_SECRET"
_MAX_UNIX_PATH = 100  # sun_path is 108 bytes on Linux, 104 on macOS


@dataclass(frozen=True)
class Address:
    """A parsed relay address: `path` for a Unix socket, else `host` and `port`."""

    path: str | None = None
    host: str | None = None
    port: int | None = None

    @property
    def is_unix(self) -> bool:
        return self.path is not None

    def __str__(self) -> str:
        if self.path is not None:
            return f"unix:{self.path}"
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    def is_loopback(self) -> bool:
        """True for Unix sockets and TCP hosts that resolve only to loopback addresses."""
        if self.path is not None:
            return True
        assert self.host is not None
        if self.host == "localhost":
            return True
        try:
            infos = socket.getaddrinfo(self.host, None)
        except OSError:
            return False
        return bool(infos) and all(
            ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos
        )


def default_socket_dir() -> Path:
    """This user's folder for the default relay socket (see the module docstring)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "fsdpx"
    return Path(f"/tmp/fsdpx-{os.getuid()}")


def default_address() -> Address:
    """This user's per-node relay address: a Unix socket, or loopback TCP as fallback."""
    path = default_socket_dir() / "telemetry.sock"
    if hasattr(socket, "AF_UNIX") and len(str(path)) <= _MAX_UNIX_PATH:
        return Address(path=str(path))
    return Address(host="127.0.0.1", port=DEFAULT_TCP_PORT)


def parse_address(text: str | Address | None) -> Address:
    """Parse an address string (module docstring); None gives `default_address()`.

    Raises:
        ValueError: a TCP address without a valid port.

    Example::

        parse_address("127.0.0.1:29687").port == 29687
    """
    if isinstance(text, Address):
        return text
    if text is None:
        return default_address()
    if text.startswith("unix:"):
        return Address(path=text[5:])
    rest = text[6:] if text.startswith("tcp://") else text
    if not text.startswith("tcp://") and ("/" in rest or rest.endswith(".sock")):
        return Address(path=rest)
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(
            f"telemetry address {text!r} is neither a Unix socket path (with a '/' or "
            "ending in .sock) nor host:port with a port 0-65535; e.g. '127.0.0.1:29687' "
            "or '/tmp/fsdpx.sock'"
        )
    return Address(host=host.strip("[]") or "127.0.0.1", port=int(port))


def ensure_private_dir(path: Path) -> None:
    """Create `path` with mode 0700, or check an existing one is ours and not shared:
    another local user must not be able to place or read our socket."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise ValueError(
            f"telemetry socket folder {path} must be owned by uid {os.getuid()} with mode "
            f"0700; found uid {st.st_uid}, mode {oct(stat.S_IMODE(st.st_mode))}. Remove it or "
            "give another address (telemetry.relay / --listen)"
        )


def read_secret(env_name: str = DEFAULT_SECRET_ENV) -> bytes | None:
    """The shared secret from environment variable `env_name` (None when unset/empty)."""
    value = os.environ.get(env_name)
    return value.encode() if value else None


def open_socket(address: Address, timeout_s: float) -> socket.socket:
    """A connected, blocking socket to `address` (raises OSError when nobody listens)."""
    if address.path is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(address.path)
        except OSError:
            sock.close()
            raise
        return sock
    assert address.host is not None and address.port is not None
    sock = socket.create_connection((address.host, address.port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class Connection:
    """A handshaken client connection to a relay (blocking socket with timeouts).

    Made by `connect`. Not thread-safe: one thread sends, or one thread receives.
    """

    def __init__(self, sock: socket.socket, decoder: FrameDecoder, auth: FrameAuth | None):
        self.sock = sock
        self.decoder = decoder
        self.auth = auth
        self.welcome: dict[str, Any] = {}

    def send(self, message: Mapping[str, Any], *, timeout_s: float = 1.0) -> None:
        """Send one message (OSError/TimeoutError when the relay does not take it in time)."""
        self.sock.settimeout(timeout_s)
        self.sock.sendall(encode_frame(message, auth=self.auth))

    def receive(self, *, timeout_s: float) -> list[dict[str, Any]]:
        """Messages that arrive within timeout_s ([] on timeout). Raises ConnectionError
        when the relay closed the connection, ProtocolError on a bad frame."""
        # Frames that arrived with the welcome (a monitor's history) wait in the decoder:
        # return them before reading, or they would wait for the next frame to come.
        if buffered := self.decoder.feed(b""):
            return buffered
        self.sock.settimeout(timeout_s)
        try:
            data = self.sock.recv(1 << 16)
        except TimeoutError:
            return []
        if not data:
            raise ConnectionError("relay closed the connection")
        return self.decoder.feed(data)

    def poll(self) -> list[dict[str, Any]]:
        """Messages already arrived, without waiting ([] when none). Raises as `receive`.
        A rank's sender thread reads the relay's requests (`dump_request`) so."""
        if buffered := self.decoder.feed(b""):
            return buffered
        self.sock.settimeout(0.0)
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return []
        if not data:
            raise ConnectionError("relay closed the connection")
        return self.decoder.feed(data)

    def close(self) -> None:
        self.sock.close()


def _receive_one(sock: socket.socket, decoder: FrameDecoder, deadline: float) -> dict[str, Any]:
    while (message := decoder.next_message()) is None:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionError("relay closed the connection during the handshake")
        decoder.push(data)
    if message.get("type") == "error":
        raise ProtocolError(f"relay refused the connection: {message.get('reason')}")
    return message


def connect(
    address: str | Address | None,
    *,
    role: str,
    secret: bytes | None,
    timeout_s: float,
    **hello_fields: Any,
) -> Connection:
    """Connect to a relay and do the handshake (challenge, hello, welcome).

    Args:
        address: relay address (module docstring); None for this node's default.
        role: "rank", "relay" or "monitor".
        secret: the shared secret when the relay requires one, else None.
        timeout_s: limit for connecting and for each handshake step.
        hello_fields: rank, local_rank, world_size, host, pid, run_id for the hello
            message; host and pid default to this process's (socket.gethostname(),
            os.getpid()).
    Returns:
        The Connection (its `welcome` holds the relay's welcome message).
    Raises:
        OSError: nobody listens there. ProtocolError / AuthError: the relay refused.

    Example::

        conn = connect("127.0.0.1:29687", role="monitor", secret=None, timeout_s=2.0)
    """
    sock = open_socket(parse_address(address), timeout_s)
    try:
        deadline = time.monotonic() + timeout_s
        decoder = FrameDecoder()
        challenge = _receive_one(sock, decoder, deadline)
        # The relay requires host and pid in every hello (monitor/PROTOCOL.md).
        identity = {"host": socket.gethostname(), "pid": os.getpid(), **hello_fields}
        hello, auth = make_hello(challenge, role=role, secret=secret, **identity)
        sock.settimeout(timeout_s)
        sock.sendall(encode_frame(hello))
        welcome = _receive_one(sock, decoder, time.monotonic() + timeout_s)
        check_welcome(welcome, auth)
        decoder.auth = auth  # every frame after the welcome is tagged
        conn = Connection(sock, decoder, auth)
        conn.welcome = welcome
        return conn
    except BaseException:
        sock.close()
        raise
