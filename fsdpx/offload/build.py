"""What fsdpx.shard builds from an OffloadPlan: FSDP2's offload policy for the parameters,
and the optimizer with the engine's step strategy ([Note: the offload table] in plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from fsdpx.config import Config, OptimizerConfig
from fsdpx.dtensor import to_local as local
from fsdpx.offload.pin import host_pin
from fsdpx.offload.plan import OffloadPlan, resolve_offload
from fsdpx.optim import AdamW
from fsdpx.optimizer_step import OptimizerStep
from fsdpx.optimizers import OPTIMIZERS
from fsdpx.precision import torch_dtype


@dataclass(frozen=True)
class OffloadBuild:
    """The optimizer an offload plan needs and the step strategy the engine runs it with;
    both None when the plan keeps the optimizer on the device (build cfg.optimizer)."""

    optimizer: torch.optim.Optimizer | None
    step: OptimizerStep | None


def fsdp_offload_policy(plan: OffloadPlan) -> OffloadPolicy | None:
    """FSDP2's offload policy for the plan's parameters (None: they stay on device)."""
    if plan.params != "host":
        return None
    pin = host_pin(
        plan.param_pin_memory, section="offload_param", default=torch.cuda.is_available()
    )
    return CPUOffloadPolicy(pin_memory=pin)


def offload_policy(cfg: Config) -> OffloadPolicy | None:
    """FSDP2's offload policy for zero.offload_param (None: parameters stay on device)."""
    return fsdp_offload_policy(resolve_offload(cfg))


def build_offload(
    plan: OffloadPlan,
    params: list[Any],
    model: nn.Module,
    optimizer: OptimizerConfig,
    rank: int,
) -> OffloadBuild:
    """The optimizer (and step strategy) that `plan` needs.

    Args:
        plan: from check_offload / resolve_offload.
        params: the sharded parameters that require grad, or parameter groups of them
            (dicts with "params" and per-group options).
        model: the sharded model (gradient streaming hooks, parameter casting).
        optimizer: cfg.optimizer (an Adam type whenever the plan offloads; check_offload).
        rank: global rank (names NVMe swap files).
    Returns:
        OffloadedAdamW with OffloadedStep, fsdpx.optim.AdamW (parameters stepped in place
        on the host) with the engine's plain step, or nothing.

    Example::

        built = build_offload(check_offload(cfg, None), params, model, cfg.optimizer, 0)
    """
    if plan.steps_in_place and plan.params == "device":
        return OffloadBuild(None, None)
    # Only a plan that offloads gets here ([Note: offload imports on first use]).
    from fsdpx.offload.nvme_nodes import check_nvme_nodes
    from fsdpx.offload.optimizer import OffloadedAdamW
    from fsdpx.offload.step import OffloadedStep

    o = optimizer
    decoupled = OPTIMIZERS[o.type].decoupled_weight_decay
    assert decoupled is not None  # check_offload refused non-Adam optimizers
    hyper = dict(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    hyper["bias_correction"] = o.bias_correction
    if plan.steps_in_place:
        # The parameters are fp32 on the host already: step them in place.
        return OffloadBuild(AdamW(params, decoupled_weight_decay=decoupled, **hyper), None)  # type: ignore[arg-type]
    if plan.master == "nvme":  # every node's disk, on every rank ([Note: NVMe paths per node])
        assert plan.optimizer_offload.nvme_path is not None  # OffloadConfig checks it
        tensors = [t for g in params for t in (g["params"] if isinstance(g, dict) else [g])]
        check_nvme_nodes(plan.optimizer_offload.nvme_path, sum(local(t).numel() for t in tensors))
    dtype = plan.device_param_dtype
    opt = OffloadedAdamW(
        params,
        decoupled_weight_decay=decoupled,
        offload=plan.optimizer_offload,
        model=model,
        device_dtype=torch_dtype(dtype) if dtype is not None else None,  # type: ignore[arg-type]
        rank=rank,
        **hyper,  # type: ignore[arg-type]
    )
    flat = [p for group in opt.param_groups for p in group["params"]]
    return OffloadBuild(opt, OffloadedStep(opt, flat))
