"""Per-rank body of the relay discovery test (module level, so spawned ranks import it):
4 ranks standing in for 2 nodes of 2, each node's local rank 0 running its node's relay
on a socket of its own, and the rendezvous store hosted by the test process (as
torchrun's agent on the master host hosts it)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fsdpx
from fsdpx.telemetry.wire.transport import connect

RANKS_PER_NODE = 2
HANG_S = 120.0  # only ends a wait that has already failed


def two_nodes_publish_their_relays(
    rank: int, world_size: int, sock_dir: str, discovery_file: str
) -> dict[str, Any]:
    node = rank // RANKS_PER_NODE
    # What torchrun / fsdpx launch set per node; fsdpx.shard reads them at start-up.
    os.environ.update(
        LOCAL_RANK=str(rank % RANKS_PER_NODE), FSDPX_NODE=str(node), FSDPX_NODE_HOST=f"node-{node}"
    )
    cfg = fsdpx.Config.from_dict(
        {
            "optimizer": {"lr": 1e-2},
            "telemetry": {
                "enabled": True,
                "relay": str(Path(sock_dir) / f"node{node}.sock"),
                "poll_interval_s": 0.05,
                "measure_flops": False,
                "discovery_file": discovery_file,
                "run_id": "disc",
            },
        }
    )
    torch.manual_seed(0)
    engine = fsdpx.shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)), cfg)
    for _ in range(2):
        loss = engine(torch.ones(2, 4)).sum()
        engine.backward(loss)
        engine.step()
    out: dict[str, Any] = {}
    if rank == 0:
        # The monitor's side, as `fsdpx-monitor --rendezvous HOST:PORT` runs it.
        from monitor.cli import live_addresses

        args = argparse.Namespace(
            addresses=[],
            discovery=None,
            rendezvous=os.environ["FSDPX_RDZV_ENDPOINT"],
            discover_timeout=HANG_S,
        )
        addresses = live_addresses(args)
        out["addresses"] = addresses
        out["seen"] = _records_through(addresses, want=set(range(world_size)))
    dist.barrier()  # the other ranks' relays and senders stay up until rank 0 has seen them
    assert engine.telemetry is not None
    engine.telemetry.close()
    return out


def _records_through(addresses: list[str], want: set[int]) -> dict[str, dict[int, Any]]:
    """Per relay address, the ranks whose records came through it and their `node`, once
    every rank in `want` has sent at least one step's record."""
    conns = {a: connect(a, role="monitor", secret=None, timeout_s=HANG_S) for a in addresses}
    seen: dict[str, dict[int, Any]] = {a: {} for a in addresses}
    deadline = time.monotonic() + HANG_S
    try:
        while {r for ranks in seen.values() for r in ranks} != want:
            assert time.monotonic() < deadline, f"records seen so far: {seen}"
            for address, conn in conns.items():
                for message in conn.receive(timeout_s=0.2):
                    for rec in message.get("records") or []:
                        if isinstance(rec, dict) and rec.get("step"):
                            seen[address][rec["rank"]] = rec.get("node")
    finally:
        for conn in conns.values():
            conn.close()
    return seen
