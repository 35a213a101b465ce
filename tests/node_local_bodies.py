"""Per-rank bodies of the node-local checkpoint tests (module level, so spawned ranks
import them): 4 ranks standing in for 2 nodes of 2 ranks, each node's "local disk" a
directory of its own (the same root path on every node, simulated).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import fsdpx
from checkpoint_tools.format.root import write_latest
from tests.ckpt_bodies import _odd_train, full_state, odd_net

RANKS_PER_NODE = 2
CFG = {"zero": {"stage": 3}, "optimizer": {"lr": 1e-2}, "checkpoint": {"node_local": True}}


def node_root(base: str, rank: int) -> Path:
    """This rank's node's checkpoint root: `<base>/node<N>/ckpt`."""
    return Path(base) / f"node{rank // RANKS_PER_NODE}" / "ckpt"


def _local(engine: fsdpx.Engine) -> dict[str, torch.Tensor]:
    """This rank's own shards (what an in-place load must restore bit for bit)."""

    def mine(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    out = {f"model/{n}": mine(t) for n, t in engine.module.state_dict().items()}
    for i, p in enumerate(engine.module.parameters()):
        for key, value in engine.optimizer.state.get(p, {}).items():
            out[f"optim/{i}/{key}"] = mine(value)
    return out


def _error(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return ("none", "")


def save_and_load_body(rank: int, world_size: int, base: str) -> dict[str, Any]:
    node = rank // RANKS_PER_NODE
    os.environ["FSDPX_NODE_HOST"] = f"node-{node}"  # what fsdpx launch sets per node
    root = node_root(base, rank)
    cfg = fsdpx.Config.from_dict(CFG)
    engine = fsdpx.shard(odd_net(), cfg)
    _odd_train(engine, 2)
    engine.save_checkpoint(root, tag="s1", client_state={"epoch": 1})
    out: dict[str, Any] = {"saved": _local(engine), "full": full_state(engine)}
    out["files"] = sorted(p.name for p in (root / "s1").iterdir())

    # In place: a fresh engine on the same "nodes" reads each node's part.
    fresh = fsdpx.shard(odd_net(seed=11), cfg)
    _, client = fresh.load_checkpoint(root)
    out["loaded"], out["client"] = _local(fresh), client

    # A shared directory with node_local on: one node, an ordinary checkpoint.
    shared = Path(base) / "shared"
    engine.save_checkpoint(shared, tag="s1")
    out["shared_files"] = sorted(p.name for p in (shared / "s1").iterdir())

    # Node 1's part gone (its disk replaced): every rank fails the same way, nothing read.
    dist.barrier()
    if rank == RANKS_PER_NODE:
        (root / "s1").rename(root.parent / "away")
    dist.barrier()
    out["missing"] = _error(lambda: fresh.load_checkpoint(root, tag="s1"))
    dist.barrier()
    if rank == RANKS_PER_NODE:
        (root.parent / "away").rename(root / "s1")
    dist.barrier()

    # Node 1 still names the older save (a save interrupted between the nodes' commits).
    _odd_train(engine, 1)
    engine.save_checkpoint(root, tag="s2")
    dist.barrier()
    if rank == RANKS_PER_NODE:
        write_latest(root, "s1")
    dist.barrier()
    out["mixed"] = _error(lambda: fresh.load_checkpoint(root))

    # The same node-local directories loaded as if they were shared.
    plain = fsdpx.shard(odd_net(seed=11), fsdpx.Config.from_dict({**CFG, "checkpoint": {}}))
    out["not_node_local"] = _error(lambda: plain.load_checkpoint(root, tag="s2"))
    dist.barrier()
    if rank == 0:  # the files of node 1 gathered next to node 0's
        gathered = Path(base) / "gathered" / "s2"
        shutil.copytree(node_root(base, 0) / "s2", gathered)
        for f in (node_root(base, RANKS_PER_NODE) / "s2").glob("rank-*"):
            shutil.copy2(f, gathered / f.name)
    dist.barrier()
    plain.load_checkpoint(Path(base) / "gathered", tag="s2")
    out["s2"], out["gathered_load"] = _local(engine), _local(plain)
    out["full2"] = full_state(engine)
    return out


def mesh_save_and_load_body(
    rank: int, world_size: int, cfg_dict: dict[str, Any], base: str
) -> dict[str, Any]:
    """Node-local save under a mesh (HSDP or PP) on 2 simulated nodes, then in place into
    a fresh engine (another init) and, gathered onto one directory, into another."""
    from tests import tp_bodies
    from tests.ckpt_bodies import _pp_train, _summary, pp_gpt

    node = rank // RANKS_PER_NODE
    os.environ["FSDPX_NODE_HOST"] = f"node-{node}"
    root = node_root(base, rank)
    local = fsdpx.Config.from_dict({**cfg_dict, "checkpoint": {"node_local": True}})
    batches = tp_bodies.global_batches(3, local.gradient_accumulation_steps)
    engine = fsdpx.shard(pp_gpt(), local, loss_fn=tp_bodies.lm_loss)
    _pp_train(engine, batches[:2])
    engine.save_checkpoint(root, tag="s1", client_state={"tag": "s1"})
    out: dict[str, Any] = {"saved": _summary(engine)}
    out["files"] = sorted(p.name for p in (root / "s1").iterdir())
    out["next_loss"] = _pp_train(engine, batches[2:])

    fresh = fsdpx.shard(pp_gpt(seed=7), local, loss_fn=tp_bodies.lm_loss)
    _, out["client"] = fresh.load_checkpoint(root)
    out["in_place"] = _summary(fresh)
    out["in_place_next_loss"] = _pp_train(fresh, batches[2:])

    dist.barrier()
    gathered = Path(base) / "gathered"
    if rank == 0:  # every node's rank files in one directory, with node 0's MANIFEST
        shutil.copytree(node_root(base, 0) / "s1", gathered / "s1")
        for n in range(1, world_size // RANKS_PER_NODE):
            for f in (node_root(base, n * RANKS_PER_NODE) / "s1").glob("rank-*"):
                shutil.copy2(f, gathered / "s1" / f.name)
    dist.barrier()
    plain = fsdpx.shard(pp_gpt(seed=9), fsdpx.Config.from_dict(cfg_dict), loss_fn=tp_bodies.lm_loss)
    plain.load_checkpoint(gathered, tag="s1")
    out["gathered"] = _summary(plain)
    return out
