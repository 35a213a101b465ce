"""What a relay checks in a message beyond its framing (monitor/PROTOCOL.md, "What the
relay checks"); stdlib only, the monitor may import it.

`protocol.decode_body` already guarantees a map with a str "type" whose values are plain
msgpack (no extension types, str keys only). Here: the hello's fields (`check_hello`),
the shape of data messages and, on a rank's connection, that every record and event is
that rank's own (`validate_message`). Each failure is a ProtocolError naming the field,
what was expected and what came; the relay sends its text in an "error" frame and closes
that connection only.

Example::

    check_hello(hello)                                   # after accept_hello
    validate_message(message, owner=(hello["rank"], hello["host"]))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fsdpx.telemetry.wire.coalesce import BATCH_S_MAX, BATCH_S_MIN
from fsdpx.telemetry.wire.protocol import ProtocolError

_NONCE_BYTES = 32

# field -> (description, check, roles that must send it). "Required" means present and
# not nil; optional fields may be absent or nil. Unknown fields are ignored (forward
# compatibility), as in every message.
_ALL = ("rank", "relay", "monitor")
_HELLO_FIELDS: tuple[tuple[str, str, Callable[[Any], bool], tuple[str, ...]], ...] = (
    ("host", "a str", lambda v: type(v) is str, _ALL),
    ("pid", "an int", lambda v: type(v) is int, _ALL),
    ("rank", "an int >= 0", lambda v: type(v) is int and v >= 0, ("rank",)),
    ("local_rank", "an int >= 0", lambda v: type(v) is int and v >= 0, ()),
    ("world_size", "an int >= 1", lambda v: type(v) is int and v >= 1, ()),
    ("run_id", "a str", lambda v: type(v) is str, ()),
    ("job", "a str", lambda v: type(v) is str, ()),
    ("nonce", "a bin of 32 bytes", lambda v: type(v) is bytes and len(v) == _NONCE_BYTES, ()),
    ("auth", "a bin of 32 bytes", lambda v: type(v) is bytes and len(v) == _NONCE_BYTES, ()),
    (
        "batch_s",
        f"a number of seconds from {BATCH_S_MIN} to {BATCH_S_MAX}",
        lambda v: type(v) in (int, float) and BATCH_S_MIN <= v <= BATCH_S_MAX,
        (),
    ),
    ("columns", "a bool", lambda v: type(v) is bool, ()),
)
_DATA_LISTS = {"records": ("records",), "events": ("events",), "history": ("records", "events")}


def check_hello(hello: Mapping[str, Any]) -> None:
    """Check the fields of a hello whose type, version, role (and HMAC proof) the relay
    already accepted (`protocol.accept_hello`).

    Raises:
        ProtocolError: a required field is missing or nil, or a field has the wrong type.

    Example::

        check_hello({"type": "hello", "version": 1, "role": "monitor", "host": "h", "pid": 7})
    """
    role = hello["role"]
    for name, expected, ok, required_by in _HELLO_FIELDS:
        value = hello.get(name)
        if value is None:
            if role in required_by:
                raise ProtocolError(
                    f"hello field {name!r} is required for role {role!r} and must be "
                    f"{expected}; it is missing (send it in the hello)"
                )
        elif not ok(value):
            raise ProtocolError(
                f"hello field {name!r} must be {expected}; got {type(value).__name__} {value!r:.80}"
            )


def validate_message(message: Mapping[str, Any], *, owner: tuple[int, str] | None = None) -> None:
    """Check the shape of a data message (records / events / history) a relay accepts.

    Args:
        message: a decoded message; unknown types pass (forward compatibility).
        owner: (rank, host) from the hello of a rank's connection: every record and
            event must carry exactly that rank and host. None on a relay's connection,
            which carries other ranks' items.
    Raises:
        ProtocolError: the lists are not lists of maps, an item's rank/host is not
            int/str (or nil), or an item belongs to another rank than `owner`. Other
            fields are not checked: monitors must tolerate nil and any type anywhere.

    Example::

        validate_message({"type": "events", "events": [event]}, owner=(0, "node-1"))
    """
    kind = message["type"]
    for key in _DATA_LISTS.get(kind, ()):
        items = message.get(key)
        if not isinstance(items, list) or not all(type(i) is dict for i in items):
            raise ProtocolError(f"'{kind}' message needs '{key}': a list of maps")
        for index, item in enumerate(items):
            rank, host = item.get("rank"), item.get("host")
            if not (rank is None or type(rank) is int) or not (host is None or type(host) is str):
                raise ProtocolError(
                    f"'{key}' items need an int 'rank' and a str 'host'; got {rank!r:.80}, {host!r:.80}"
                )
            if owner is not None and (rank, host) != owner:
                raise ProtocolError(
                    f"{key}[{index}] is for rank {rank!r} on host {host!r:.80}, but this "
                    f"connection's hello said rank {owner[0]!r} on host {owner[1]!r}: a "
                    "rank's connection publishes only that rank's records and events"
                )


def validate_dump(message: Mapping[str, Any], *, owner: tuple[int, str] | None = None) -> None:
    """Check a `dump` message (a rank's answer to a dump_request): `dump` is a map with
    an int `rank` and a str `host`, on a rank's connection exactly the hello's.

    Raises:
        ProtocolError: naming what is wrong, as validate_message does.
    """
    dump = message.get("dump")
    if type(dump) is not dict:
        raise ProtocolError(f"'dump' message needs 'dump': a map; got {type(dump).__name__}")
    rank, host = dump.get("rank"), dump.get("host")
    if type(rank) is not int or type(host) is not str:
        raise ProtocolError(
            f"a dump needs an int 'rank' and a str 'host'; got {rank!r:.80}, {host!r:.80}"
        )
    if owner is not None and (rank, host) != owner:
        raise ProtocolError(
            f"dump is for rank {rank!r} on host {host!r:.80}, but this connection's hello "
            f"said rank {owner[0]!r} on host {owner[1]!r}: a rank sends only its own dump"
        )


def check_dump_request(message: Mapping[str, Any]) -> dict[str, Any]:
    """A monitor's `dump_request`, reduced to the fields passed on to ranks.

    Raises:
        ProtocolError: `request_id` is not a str, or `run_id` is neither a str nor nil.
    """
    request_id, run_id = message.get("request_id"), message.get("run_id")
    if type(request_id) is not str:
        raise ProtocolError(
            f"dump_request needs a str 'request_id'; got {type(request_id).__name__} {request_id!r:.80}"
        )
    if run_id is not None and type(run_id) is not str:
        raise ProtocolError(f"dump_request 'run_id' must be a str or nil; got {run_id!r:.80}")
    return {"type": "dump_request", "request_id": request_id, "run_id": run_id}
