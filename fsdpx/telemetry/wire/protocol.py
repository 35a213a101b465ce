"""The telemetry wire protocol: length-prefixed msgpack frames (monitor/PROTOCOL.md).

The same framing is used at every hop (rank -> relay -> monitor) and in the relay's log
file. This module is stdlib + msgpack only (the monitor imports it; no torch) and does no
I/O: it turns messages into bytes and bytes into messages, and holds the handshake's
arithmetic. Sockets live in fsdpx/telemetry/wire/transport.py.

Byte layout of one frame::

    +----------------------+---------------------------------------------+
    | length: uint32, BE   | body: `length` bytes                        |
    +----------------------+---------------------------------------------+
    body, plain:         msgpack map (a message, a dict with a str "type")
    body, authenticated: 32-byte HMAC-SHA256 tag || msgpack map

`1 <= length <= MAX_FRAME_BYTES`; anything else is a ProtocolError and the receiver drops
the connection. Authenticated frames exist only on connections to a relay started with a
shared secret, after the handshake (see `make_hello` / `accept_hello`).

Example::

    data = encode_frame({"type": "records", "records": [record]})
    decoder = FrameDecoder()
    for message in decoder.feed(data):
        ...
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change; a relay refuses a hello with another version."""
PROTOCOL_MINOR = 1
"""Backward-compatible additions (monitor/PROTOCOL.md "Versions"): 1 = columnar batches
(fsdpx/telemetry/wire/columns.py). Sent in the relay's welcome (`minor`) for information;
nothing is refused on it, and a welcome without it is from a 1.0 relay."""
MAX_FRAME_BYTES = 1 << 20
"""Largest frame body (tag included). Senders split batches to stay under it."""
HEADER = struct.Struct(">I")
TAG_BYTES = 32
NONCE_BYTES = 32
AUTH_SCHEME = "hmac-sha256"
ROLES = ("rank", "relay", "monitor")
MESSAGE_TYPES = (
    "challenge",
    "hello",
    "welcome",
    "error",
    "records",
    "events",
    "history",
    "log",
    "dump_request",
    "dump",
    "batch",
)

PHASE_FIELDS: tuple[str, ...] = (
    "data_wait_s",
    "forward_s",
    "backward_s",
    "optimizer_s",
    "comm_wait_s",
    "h2d_s",
)
"""Per-step phase times in seconds (fsdpx/telemetry/phases.py [Note: phase spans]); added
after version 1 shipped, so optional: records of older publishers and logs lack them and
readers treat a missing one as nil (DESIGN, Round 2 clarification 5: no version bump)."""

COMM_SPLIT_FIELDS: tuple[str, ...] = (
    "comm_wait_forward_s",
    "comm_wait_backward_s",
    "comm_wait_optimizer_s",
)
"""The part of `comm_wait_s` spent while forward, backward or the optimizer step was open,
in seconds (fsdpx/telemetry/phases.py [Note: comm wait by phase]): 0.0 when the phase ran
with no wait in it, nil when the phase was not timed. Optional, added after the
PHASE_FIELDS (no version bump): older records lack them, read as nil, and the monitor
then scores forward and backward as before (monitor/stragglers.py)."""

MOE_FIELDS: tuple[str, ...] = ("moe_tokens", "moe_dropped", "moe_imbalance")
"""Per-step expert load of a rank with mixture-of-experts layers (fsdpx/telemetry/moe_load.py):
expert rows computed (int), assignments dropped by capacity (int), the worst layer's
max / mean expert load (float, 1.0 = balanced); nil without MoE layers. Optional, added
after version 1 shipped (no version bump): older records lack them, read as nil."""

RECORD_FIELDS: tuple[str, ...] = (
    "rank",
    "local_rank",
    "host",
    # The rank's node rank (fsdpx/telemetry/node.py), int or None; optional: older
    # publishers' records lack it and readers take a missing one as None (no version bump).
    "node",
    "pid",
    "step",
    "time",
    "loss",
    "lr",
    "grad_norm",
    "loss_scale",
    "skipped",
    "step_time_s",
    "tokens_per_s",
    "mem_allocated",
    "mem_reserved",
    "mem_peak",
    "alloc_retries",
    "ooms",
    "device_mem_used",
    "device_mem_total",
    "device_util",
    "device_power_w",
    "device_temp_c",
    "host_rss",
    "tflops",
    "mfu",
    "comm_bytes",
    "dropped",
    "run_id",
    "job",
    "sent_all_gather",
    "sent_reduce_scatter",
    "sent_all_to_all",
    "sent_all_reduce",
    *MOE_FIELDS,
    *PHASE_FIELDS,
    *COMM_SPLIT_FIELDS,
)
"""Keys of a per-step record, in this order; every key is present, None where unknown.
Units: time in Unix seconds, memory and comm_bytes in bytes, device_util in percent
(0-100), mfu as a fraction (0-1), dropped = records this rank lost so far. `run_id` and
`job` say which launch and job (fsdpx/telemetry/wire/runs.py); readers treat a record without
them (older publishers) as part of one unnamed run. `sent_*` (optional, no version bump:
DESIGN Round 2 clarification 5) are the bytes this rank sent during the step through
fsdpx.comm, per collective kind (FSDP's all-gathers, its reduce-scatters or qgZ's
all-to-alls, fsdpx's all-reduces; formulas in fsdpx/comm/counted.py); older publishers
omit them and readers take a missing one as None; so are the MOE_FIELDS (see there).
The PHASE_FIELDS, then the COMM_SPLIT_FIELDS, come last and may be absent (see there)."""

EVENT_KINDS: tuple[str, ...] = (
    "start",
    "checkpoint_saved",
    "checkpoint_loaded",
    "overflow",
    "exception",
    "exit",
    "disconnected",
)
"""Event kinds. An event is {rank, host, time, kind, step, detail: str | dict, run_id}.
"disconnected" is made by the relay when a rank's connection closes without an "exit"."""

EVENT_FIELDS: tuple[str, ...] = ("rank", "host", "time", "kind", "step", "detail", "run_id")

_HELLO_LABEL = b"fsdpx-telemetry-v1 hello"
_SESSION_LABEL = b"fsdpx-telemetry-v1 session"


class ProtocolError(Exception):
    """A frame or message that breaks the protocol; the receiver drops the connection."""


class AuthError(ProtocolError):
    """A failed handshake or a frame with a missing or wrong HMAC tag."""


@dataclass
class FrameAuth:
    """Per-connection HMAC state after a successful handshake (one per side).

    Every frame's tag is HMAC-SHA256(session_key, direction || seq (uint64 BE) || body);
    `seq` counts frames per direction from 0, so a replayed, reordered, dropped or
    reflected frame fails verification.
    """

    key: bytes
    send_label: bytes
    recv_label: bytes
    send_seq: int = field(default=0)
    recv_seq: int = field(default=0)

    def sign(self, body: bytes) -> bytes:
        tag = self._tag(self.send_label, self.send_seq, body)
        self.send_seq += 1
        return tag + body

    def verify(self, payload: bytes) -> bytes:
        if len(payload) <= TAG_BYTES:
            raise AuthError(f"authenticated frame of {len(payload)} bytes has no body")
        tag, body = payload[:TAG_BYTES], payload[TAG_BYTES:]
        expected = self._tag(self.recv_label, self.recv_seq, body)
        if not hmac.compare_digest(tag, expected):
            raise AuthError(f"frame {self.recv_seq} has a missing or wrong HMAC tag")
        self.recv_seq += 1
        return body

    def welcome_proof(self) -> bytes:
        """The relay's proof of the secret, carried by its (untagged) welcome."""
        return hmac.new(self.key, b"welcome", hashlib.sha256).digest()

    def _tag(self, label: bytes, seq: int, body: bytes) -> bytes:
        mac = hmac.new(self.key, label + seq.to_bytes(8, "big"), hashlib.sha256)
        mac.update(body)
        return mac.digest()


def encode_frame(message: Mapping[str, Any], *, auth: FrameAuth | None = None) -> bytes:
    """One frame: the uint32 big-endian body length, then the msgpack body.

    Args:
        message: a dict with a str "type" (see monitor/PROTOCOL.md); values are None,
            bool, int, float, str, bytes, lists and dicts with str keys.
        auth: the connection's FrameAuth after an authenticated handshake, else None.
    Returns:
        The frame's bytes.
    Raises:
        ProtocolError: the message is not encodable or the body exceeds MAX_FRAME_BYTES.

    Example::

        sock.sendall(encode_frame({"type": "events", "events": [event]}))
    """
    try:
        body = msgpack.packb(message, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"message is not encodable as msgpack: {exc}") from exc
    if auth is not None:
        body = auth.sign(body)
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(
            f"frame body of {len(body)} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}; "
            "split the batch"
        )
    return HEADER.pack(len(body)) + body


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed")


def decode_body(body: bytes) -> dict[str, Any]:
    """Parse one frame body (tag already removed) into a message dict."""
    try:
        message = msgpack.unpackb(
            body, raw=False, strict_map_key=True, ext_hook=_reject_ext, timestamp=0
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise ProtocolError(f"frame body is not valid msgpack: {type(exc).__name__}") from exc
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ProtocolError(
            f"a message must be a map with a str 'type'; got {type(message).__name__}"
        )
    check_values(message)
    return message


_LEAF_TYPES = frozenset({type(None), bool, int, float, str, bytes})
_STR_ONLY = frozenset({str})


def check_values(message: dict[str, Any]) -> None:
    """Reject what msgpack decodes but the protocol forbids, in one walk of the message.

    See [Note: one validation walk].

    Raises:
        ProtocolError: a map key that is not a str (msgpack's `strict_map_key` lets
            bytes keys through), or a value that is not nil, bool, int, float, str, bin,
            array or map (a msgpack timestamp: `timestamp=0` decodes that extension
            itself, without calling `ext_hook`). The message names where it is.
    """
    # [Note: one validation walk]
    # msgpack's own options catch most of the spec (ext_hook: extension types;
    # strict_map_key: int/nil/... keys) but not two cases: the Timestamp extension
    # (-1), which the unpacker decodes itself, and bytes map keys. Both would travel on
    # to monitors, history, logs and CSV exports, so every decoded message is walked
    # once here. Iterative (nesting may be deeper than Python's recursion limit), and
    # the per-container type checks run in C (set operations over map(type, ...)):
    # records are flat maps, so a records frame costs about one check per record. Only
    # a message found bad is walked again, with paths, to say where.
    stack: list[Any] = [message]
    while stack:
        node = stack.pop()
        if type(node) is dict:
            if not _STR_ONLY.issuperset(map(type, node)):
                _locate(message)
            values: Any = node.values()
        elif type(node) is list:
            values = node
        else:
            _locate(message)
        if not _LEAF_TYPES.issuperset(map(type, values)):
            stack.extend(v for v in values if type(v) not in _LEAF_TYPES)


def _locate(message: dict[str, Any]) -> None:
    """Raise the ProtocolError for the first bad key or value of a message that
    check_values found bad, naming where it is (the slow walk, with paths)."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(message, ())]
    while stack:
        node, path = stack.pop()
        if type(node) is dict:
            for key, value in node.items():
                if type(key) is not str:
                    raise ProtocolError(
                        f"map key {key!r:.80} at {_where(path)} is a {type(key).__name__}; "
                        "map keys must be str"
                    )
                stack.append((value, (*path, key)))
        elif type(node) is list:
            stack.extend((value, (*path, index)) for index, value in enumerate(node))
        elif isinstance(node, msgpack.Timestamp):
            raise ProtocolError(
                f"msgpack timestamp at {_where(path)} is not allowed (extension types "
                "are rejected); send Unix time as a float"
            )
        elif type(node) not in _LEAF_TYPES:
            raise ProtocolError(f"value of type {type(node).__name__} at {_where(path)}")
    raise AssertionError("check_values found a bad value that _locate did not")


def _where(path: tuple[str | int, ...]) -> str:
    """'records[0].time' style location of a value inside a message."""
    out = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
    return out.lstrip(".") or "the top level"


class FrameDecoder:
    """Incremental frame decoder: feed it bytes as they arrive, get whole messages back.

    After a ProtocolError the decoder is unusable (the stream position is lost): drop
    the connection. Set `auth` after a successful handshake to verify and strip tags.

    Example::

        decoder = FrameDecoder()
        while data := sock.recv(65536):
            for message in decoder.feed(data):
                handle(message)
    """

    def __init__(
        self, *, max_frame_bytes: int = MAX_FRAME_BYTES, auth: FrameAuth | None = None
    ) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.auth = auth
        self._buf = bytearray()
        self._failed: ProtocolError | None = None
        self.last_body = b""
        """The msgpack body (tag removed) of the message last returned: relays forward
        it unchanged instead of re-encoding."""

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as a message (a partial frame)."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Buffer `data` and return every message completed by it, in order."""
        self.push(data)
        out = []
        while (message := self.next_message()) is not None:
            out.append(message)
        return out

    def push(self, data: bytes) -> None:
        """Buffer `data` without decoding (pair with next_message to switch `auth`
        between two frames of one read, as a relay does after the hello)."""
        if self._failed is not None:
            raise self._failed
        self._buf += data
        # Reject an oversized length as soon as the header is in, not after buffering it.
        if len(self._buf) >= HEADER.size:
            self._check_length(HEADER.unpack_from(self._buf)[0])

    def next_message(self) -> dict[str, Any] | None:
        """The next complete message, or None when the buffer holds no whole frame."""
        if self._failed is not None:
            raise self._failed
        if len(self._buf) < HEADER.size:
            return None
        (length,) = HEADER.unpack_from(self._buf)
        self._check_length(length)
        end = HEADER.size + length
        if len(self._buf) < end:
            return None
        payload = bytes(self._buf[HEADER.size : end])
        del self._buf[:end]
        try:
            body = self.auth.verify(payload) if self.auth is not None else payload
            message = decode_body(body)
            self.last_body = body
            return message
        except ProtocolError as exc:
            self._failed = exc
            raise

    def _check_length(self, length: int) -> None:
        if length == 0 or length > self.max_frame_bytes:
            self._failed = ProtocolError(
                f"frame length {length} outside 1..{self.max_frame_bytes}; dropping connection"
            )
            raise self._failed


# --- handshake ------------------------------------------------------------------------


def make_challenge(*, auth_required: bool) -> dict[str, Any]:
    """The relay's first frame on every connection: version, auth scheme and a nonce."""
    return {
        "type": "challenge",
        "version": PROTOCOL_VERSION,
        "auth": AUTH_SCHEME if auth_required else None,
        "nonce": os.urandom(NONCE_BYTES),
    }


def _proof(secret: bytes, server_nonce: bytes, client_nonce: bytes, role: str) -> bytes:
    msg = _HELLO_LABEL + server_nonce + client_nonce + role.encode()
    return hmac.new(secret, msg, hashlib.sha256).digest()


def _session(secret: bytes, server_nonce: bytes, client_nonce: bytes, client: bool) -> FrameAuth:
    key = hmac.new(secret, _SESSION_LABEL + server_nonce + client_nonce, hashlib.sha256).digest()
    c2s, s2c = b"C", b"S"
    return FrameAuth(key, c2s if client else s2c, s2c if client else c2s)


def make_hello(
    challenge: Mapping[str, Any], *, role: str, secret: bytes | None, **fields: Any
) -> tuple[dict[str, Any], FrameAuth | None]:
    """The client's answer to a relay's challenge.

    Args:
        challenge: the relay's first message.
        role: "rank", "relay" or "monitor".
        secret: the shared secret, or None.
        fields: hello fields (rank, local_rank, host, pid, run_id).
    Returns:
        (hello message, FrameAuth for the frames after it or None when the relay does
        not authenticate).
    Raises:
        AuthError: the relay requires a secret and none was given.
        ProtocolError: the challenge is malformed or of another protocol version.

    Example::

        hello, auth = make_hello(challenge, role="monitor", secret=None, host="h", pid=1)
        sock.sendall(encode_frame(hello))
    """
    if challenge.get("type") != "challenge":
        raise ProtocolError(f"expected a 'challenge' first; got {challenge.get('type')!r}")
    if challenge.get("version") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"relay speaks protocol version {challenge.get('version')!r}; this side speaks "
            f"{PROTOCOL_VERSION}: use the same fsdpx version on both sides"
        )
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}; got {role!r}")
    hello: dict[str, Any] = {"type": "hello", "version": PROTOCOL_VERSION, "role": role}
    hello.update(fields)
    scheme, server_nonce = challenge.get("auth"), challenge.get("nonce")
    if scheme is None:
        return hello, None
    if scheme != AUTH_SCHEME or not isinstance(server_nonce, bytes):
        raise ProtocolError(f"unsupported auth scheme {scheme!r}; expected {AUTH_SCHEME!r}")
    if not secret:
        raise AuthError(
            "the relay requires a shared secret and none was given; set the same secret "
            "on both sides (FSDPX_TELEMETRY_SECRET, or --secret-env NAME)"
        )
    client_nonce = os.urandom(NONCE_BYTES)
    hello["nonce"] = client_nonce
    hello["auth"] = _proof(secret, server_nonce, client_nonce, role)
    return hello, _session(secret, server_nonce, client_nonce, client=True)


def accept_hello(
    hello: Mapping[str, Any], challenge: Mapping[str, Any], *, secret: bytes | None
) -> FrameAuth | None:
    """Check a client's hello against the challenge the relay sent.

    Returns:
        The relay side's FrameAuth (None when the relay does not authenticate).
    Raises:
        AuthError: missing or wrong proof. ProtocolError: not a valid hello.
    """
    if hello.get("type") != "hello":
        raise ProtocolError(f"expected 'hello' first; got {hello.get('type')!r}")
    if hello.get("version") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"client speaks protocol version {hello.get('version')!r}; relay speaks "
            f"{PROTOCOL_VERSION}"
        )
    role = hello.get("role")
    if role not in ROLES:
        raise ProtocolError(f"hello role must be one of {ROLES}; got {role!r}")
    if secret is None:
        return None
    proof, client_nonce = hello.get("auth"), hello.get("nonce")
    if not isinstance(proof, bytes) or not isinstance(client_nonce, bytes):
        raise AuthError("hello has no HMAC proof; this relay requires a shared secret")
    expected = _proof(secret, challenge["nonce"], client_nonce, role)
    if not hmac.compare_digest(proof, expected):
        raise AuthError("hello has a wrong HMAC proof (different shared secret)")
    return _session(secret, challenge["nonce"], client_nonce, client=False)


def make_welcome(auth: FrameAuth | None, **fields: Any) -> dict[str, Any]:
    """The relay's answer to an accepted hello. It is sent untagged (so a client can
    tell it from an "error"); with auth it carries the relay's proof of the secret, and
    every later frame in both directions is tagged."""
    welcome: dict[str, Any] = {"type": "welcome", "version": PROTOCOL_VERSION, **fields}
    if auth is not None:
        welcome["auth"] = auth.welcome_proof()
    return welcome


def check_welcome(welcome: Mapping[str, Any], auth: FrameAuth | None) -> None:
    """Client side: the relay's welcome (or error) after the hello.

    Raises:
        ProtocolError: the relay sent an "error" (its reason is in the message) or
            something else than a welcome. AuthError: the relay's proof is wrong.
    """
    if welcome.get("type") == "error":
        raise ProtocolError(f"relay refused the connection: {welcome.get('reason')}")
    if welcome.get("type") != "welcome":
        raise ProtocolError(f"expected 'welcome'; got {welcome.get('type')!r}")
    if auth is not None:
        proof = welcome.get("auth")
        if not isinstance(proof, bytes) or not hmac.compare_digest(proof, auth.welcome_proof()):
            raise AuthError("the relay's welcome has a wrong HMAC proof (different secret)")
