"""Publishing every node's relay address for monitors ([Note: relay discovery] in
fsdpx/telemetry/wire/discovery.py): one all-gather at telemetry start, then global rank 0
writes the list into the rendezvous store and, when configured, a file."""

from __future__ import annotations

import datetime
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch.distributed as dist

from fsdpx.telemetry.wire.discovery import (
    ENDPOINT_ENV,
    STORE_KEY,
    RelayEntry,
    advertised,
    relay_list_json,
    write_relay_file,
)
from fsdpx.telemetry.wire.transport import parse_address

if TYPE_CHECKING:
    from fsdpx.config import TelemetryConfig
    from fsdpx.distributed import DistInfo
    from fsdpx.telemetry.publisher import Publisher

log = logging.getLogger("fsdpx.telemetry")

STORE_TIMEOUT_S = 30.0
"""How long rank 0 waits to reach the rendezvous store before logging that it could not."""

# What each rank contributes to the gather: (rank, node, host, relay address or None).
_Contribution = tuple[int, int | None, str, str | None]


def store_endpoint(env: Mapping[str, str]) -> tuple[str, int] | None:
    """Where the ranks publish: `FSDPX_RDZV_ENDPOINT`, else `MASTER_ADDR:MASTER_PORT`.

    Example::

        store_endpoint({"FSDPX_RDZV_ENDPOINT": "node-0:29500"}) == ("node-0", 29500)
    """
    text = env.get(ENDPOINT_ENV) or ""
    if not text and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        text = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    host, sep, port = text.rpartition(":")
    if not text:
        return None
    if not sep or not host or not port.isdigit():
        raise ValueError(
            f"{ENDPOINT_ENV}={text!r} is not a rendezvous endpoint: expected HOST:PORT, "
            "the same as torchrun's --rdzv-endpoint (e.g. node-0:29500)"
        )
    return host.strip("[]"), int(port)


def group_entries(contributions: Sequence[_Contribution]) -> list[RelayEntry]:
    """One entry per node (ranks grouped by node, then host), ordered by node."""
    groups: dict[tuple[int | None, str], list[_Contribution]] = {}
    for c in contributions:
        groups.setdefault((c[1], c[2]), []).append(c)
    entries = []
    for (node, host), members in groups.items():
        addresses = [c[3] for c in members if c[3] is not None]
        if not addresses:
            continue  # no local rank 0 in this group said where its relay is
        ranks = tuple(sorted(c[0] for c in members))
        entries.append(RelayEntry(node, host, addresses[0], ranks))
    return sorted(entries, key=lambda e: (e.node is None, e.node or 0, e.host, e.ranks))


def announce_relays(publisher: Publisher, cfg: TelemetryConfig, info: DistInfo) -> None:
    """Gather every node's relay address and publish the list (every rank calls this).

    A list that cannot be published is logged, never raised: telemetry never stops a run.
    """
    host = os.environ.get("FSDPX_NODE_HOST") or socket.gethostname()
    mine = advertised(parse_address(publisher.address), host) if info.local_rank == 0 else None
    contribution: _Contribution = (info.rank, publisher.node, host, mine)
    gathered: list[_Contribution | None] = [contribution]
    if info.world_size > 1 and dist.is_initialized():
        from fsdpx.distributed import failure_guard

        gathered = [None] * info.world_size
        with failure_guard():  # a peer dying at start-up is named, as in agree_run
            dist.all_gather_object(gathered, contribution)
    if info.rank != 0:
        return
    entries = group_entries([c for c in gathered if c is not None])
    text = relay_list_json(publisher.run.run_id, entries)
    if cfg.discovery_file is not None:
        try:
            write_relay_file(cfg.discovery_file, text)
        except OSError as exc:
            log.warning(
                "telemetry: could not write the relay list to telemetry.discovery_file=%r "
                "(%s); fsdpx-monitor --discovery will not find it",
                cfg.discovery_file,
                exc.strerror or exc,
            )
    if cfg.publish_relays:
        _publish_to_store(text, len(entries))


def _publish_to_store(text: str, count: int) -> None:
    try:
        endpoint = store_endpoint(os.environ)
    except ValueError as exc:
        log.warning("telemetry: relay list not published: %s", exc)
        return
    if endpoint is None:
        return  # no rendezvous store (a single process, or a file:// rendezvous)
    try:
        store = dist.TCPStore(
            endpoint[0],
            endpoint[1],
            is_master=False,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
        )
        store.set(STORE_KEY, text)
    except (RuntimeError, OSError) as exc:  # DistStoreError is a RuntimeError
        log.warning(
            "telemetry: could not publish the relay list in the rendezvous store at %s:%d "
            "(%s); give fsdpx-monitor the relays' addresses, or set "
            "telemetry.discovery_file",
            endpoint[0],
            endpoint[1],
            exc,
        )
        return
    log.info(
        "telemetry: %d relay(s) published at %s:%d (fsdpx-monitor --rendezvous %s:%d)",
        count,
        *endpoint,
        *endpoint,
    )
