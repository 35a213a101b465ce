"""The relay list: where a monitor finds every node's relay (torch-free; see
[Note: the wire package is torch-free] in fsdpx/telemetry/wire/__init__.py).

[Note: relay discovery]
Each node's relay listens where that node's config says (`telemetry.relay`), so no single
process knows every address until they are put together. At telemetry start-up every
rank contributes its node's relay address to one all-gather (local rank 0 knows it: it
started the relay, or found one answering at the address) and global rank 0 publishes
the list, once, in two places:

- the rendezvous store: key STORE_KEY of the TCPStore at `FSDPX_RDZV_ENDPOINT` (what
  `fsdpx launch` sets: its `--master_addr:--master_port`, where torchrun's c10d
  rendezvous store lives for the whole job; with plain torchrun, export it as the
  `--rdzv-endpoint`), else at `MASTER_ADDR:MASTER_PORT` (under torchrun a port torchrun
  picks for the workers' store, which a user cannot easily name); read by
  `fsdpx-monitor --rendezvous HOST:PORT`;
- a file, when `telemetry.discovery_file` names one (written whole, then renamed into
  place, so a reader never sees half a list); read by `fsdpx-monitor --discovery FILE`.

One writer (rank 0, after the gather) rather than one per node: no two nodes race on a
key or a file, and the list is complete the moment it appears. A wildcard listening host
(0.0.0.0, ::) is published as the node's host name (`FSDPX_NODE_HOST`, else the
hostname). A loopback or Unix-socket relay is published as it is: a monitor on another
machine cannot reach it, and shows that node unreachable. The secret is never published.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpx.telemetry.wire.transport import Address, parse_address

STORE_KEY = "fsdpx/telemetry/relays"
"""The rendezvous-store key holding the relay list (JSON, see `relay_list_json`)."""
ENDPOINT_ENV = "FSDPX_RDZV_ENDPOINT"
"""The rendezvous endpoint (host:port) the ranks publish into; `fsdpx launch` sets it."""
FORMAT_VERSION = 1
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class RelayEntry:
    """One node's relay: where to reach it and which ranks send to it."""

    node: int | None
    host: str
    address: str
    ranks: tuple[int, ...]


def advertised(address: Address, host: str) -> str:
    """The address a monitor elsewhere should dial: a wildcard TCP host becomes `host`.

    Example::

        advertised(parse_address("0.0.0.0:7077"), "node-1") == "tcp://node-1:7077"
    """
    if address.path is None and address.host in _WILDCARD_HOSTS:
        return str(Address(host=host, port=address.port))
    return str(address)


def relay_list_json(run_id: str | None, entries: list[RelayEntry]) -> str:
    """The published relay list (store value and file content)."""
    return json.dumps(
        {
            "version": FORMAT_VERSION,
            "run_id": run_id,
            "relays": [
                {"node": e.node, "host": e.host, "address": e.address, "ranks": list(e.ranks)}
                for e in entries
            ],
        },
        indent=1,
    )


def parse_relay_list(text: str | bytes, source: str) -> list[RelayEntry]:
    """The entries of a published relay list; ValueError naming `source` when it is not one.

    Raises:
        ValueError: not JSON, another format version, or an entry without an address.
    """
    try:
        data: Any = json.loads(text)
    except ValueError:
        raise ValueError(
            f"{source} is not a relay list (expected the JSON that fsdpx ranks publish at "
            "telemetry start-up)"
        ) from None
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
        found = data.get("version") if isinstance(data, dict) else type(data).__name__
        raise ValueError(
            f"{source}: expected a relay list of format version {FORMAT_VERSION}, found "
            f"{found!r}; use the fsdpx-monitor of the fsdpx version that ran the job"
        )
    entries = []
    for item in data.get("relays", []):
        if not isinstance(item, dict) or not isinstance(item.get("address"), str):
            raise ValueError(f"{source}: a relay entry without an address: {item!r}")
        parse_address(item["address"])  # a bad address fails here, naming itself
        node = item.get("node")
        ranks = tuple(int(r) for r in item.get("ranks", []))
        host = str(item.get("host", ""))
        entries.append(
            RelayEntry(node if isinstance(node, int) else None, host, item["address"], ranks)
        )
    if not entries:
        raise ValueError(f"{source}: the relay list is empty (no rank published a relay)")
    return entries


def write_relay_file(path: str | os.PathLike[str], text: str) -> None:
    """Write the list whole under a temporary name, then rename it into place."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, target)
