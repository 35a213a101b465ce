"""Creating the rank's telemetry Publisher from the config (called by fsdpx.shard)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from fsdpx.config import Config

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

    return Publisher(
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
    )
