"""Creating the rank's telemetry Publisher from the config (called by fsdpx.shard)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from fsdpx.config import Config, TelemetryConfig
from fsdpx.telemetry.wire.runs import RunIdentity

if TYPE_CHECKING:
    from fsdpx.distributed import DistInfo
    from fsdpx.telemetry.publisher import Publisher


def start_telemetry(
    cfg: Config, info: DistInfo, module: nn.Module, optimizer: torch.optim.Optimizer
) -> Publisher | None:
    """The rank's Publisher when cfg.telemetry.enabled, else None (nothing imported).

    Args:
        cfg: the run's config (telemetry section, precision for MFU, compile).
        info: this rank's place in the job (from init_distributed).
        module: the sharded root module (for the one-time FLOP count).
        optimizer: the engine's optimizer (the first step's learning rate).
    Returns:
        A started Publisher, or None.

    Example::

        engine.telemetry = start_telemetry(cfg, info, engine.module, engine.optimizer)
    """
    if not cfg.telemetry.enabled:
        return None
    from fsdpx.telemetry.publisher import Publisher

    publisher = Publisher(
        cfg.telemetry,
        rank=info.rank,
        local_rank=info.local_rank,
        world_size=info.world_size,
        device=torch.device(info.device),
        module=module,
        optimizer=optimizer,
        param_dtype=cfg.precision.param_dtype,
        compiled=cfg.compile,
        total_steps=cfg.telemetry.total_steps or cfg.scheduler.total_num_steps,
        run=agree_run(cfg.telemetry, info),
    )
    # Every node's relay address, for monitors ([Note: relay discovery]).
    from fsdpx.telemetry.announce import announce_relays

    announce_relays(publisher, cfg.telemetry, info)
    return publisher


def agree_run(cfg: TelemetryConfig, info: DistInfo) -> RunIdentity:
    """This launch's run id and job, the same on every rank (fsdpx/telemetry/wire/runs.py).

    Global rank 0 resolves them (a fresh run id unless `telemetry.run_id` is set) and
    broadcasts them: one small collective at start, so ranks agree without relying on
    a launcher's environment, and a second engine in the same job gets a new run id.
    Every rank calls this (as every rank calls `fsdpx.shard`).
    """
    run = RunIdentity.for_launch(cfg.run_id, cfg.job, env=os.environ)
    if info.world_size > 1 and dist.is_initialized():
        from fsdpx.distributed import failure_guard

        box: list[RunIdentity | None] = [run if info.rank == 0 else None]
        # On the training device: a cuda:nccl,cpu:gloo or nccl-only group both take it.
        # Guarded like every engine collective: a peer dying during start-up gives a
        # RankFailureError naming it, not a raw backend error out of telemetry code.
        with failure_guard():
            dist.broadcast_object_list(box, src=0, device=torch.device(info.device))
        assert box[0] is not None
        run = box[0]
    return run
