"""From zero.offload_optimizer / zero.offload_param to what fsdpx.shard builds.

| offload_param | offload_optimizer | FSDP offload policy | optimizer |
|---------------|-------------------|---------------------|-----------|
| none          | none              | none                | cfg.optimizer (torch) |
| none          | cpu / nvme        | none                | OffloadedAdamW (device params 16-bit with bf16/fp16 precision) |
| cpu           | none / cpu        | CPUOffloadPolicy    | fsdpx.optim.AdamW on the host fp32 params (fused adam_step) |
| cpu           | nvme              | CPUOffloadPolicy    | OffloadedAdamW over the host params, states on NVMe |

`CPUOffloadPolicy()` pins host memory by default, which fails on a machine without an
accelerator: pin_memory defaults to whether one exists.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from fsdpx.config import Config
from fsdpx.offload.cpu import OffloadedAdamW
from fsdpx.optim import AdamW
from fsdpx.precision import torch_dtype


def check_offload(cfg: Config, optimizer: Any) -> None:
    """Reject offload settings fsdpx cannot honour, before anything is built.

    Example::

        check_offload(cfg, optimizer=None)
    """
    opt_off, param_off = cfg.zero.offload_optimizer, cfg.zero.offload_param
    if param_off.device == "nvme":
        raise ValueError(
            "zero.offload_param.device='nvme' is not supported: parameters offload to 'cpu' "
            "only (optimizer state can go to NVMe with zero.offload_optimizer.device='nvme')"
        )
    if param_off.device == "cpu" and cfg.zero.stage != 3:
        raise ValueError(
            f"zero.offload_param needs zero.stage 3 (as in DeepSpeed), got stage "
            f"{cfg.zero.stage}; set stage 3 or drop offload_param"
        )
    if opt_off.device == "nvme" and cfg.checkpoint.async_save:
        warnings.warn(
            "checkpoint.async_save with zero.offload_optimizer.device='nvme': checkpoints are "
            "written synchronously, since a background save would first copy the whole "
            "optimizer state from the swap file into host memory",
            stacklevel=3,
        )
    if opt_off.device == "none" and param_off.device == "none":
        return
    if cfg.mesh.tp > 1 or cfg.mesh.pp > 1:
        raise ValueError(
            "offload (zero.offload_optimizer / zero.offload_param) is supported with data "
            f"parallelism only, got mesh.tp={cfg.mesh.tp}, mesh.pp={cfg.mesh.pp}"
        )
    if optimizer is not None:
        raise ValueError(
            "zero.offload_optimizer / zero.offload_param run fsdpx's fused CPU Adam, built "
            "from cfg.optimizer; pass optimizer=None and set cfg.optimizer (type 'adam' or "
            "'adamw') instead of an optimizer callable"
        )
    if cfg.optimizer.type not in ("adam", "adamw"):
        raise ValueError(
            f"offload supports optimizer.type 'adam' and 'adamw' (the fused CPU Adam), got "
            f"{cfg.optimizer.type!r}"
        )


def offload_policy(cfg: Config) -> OffloadPolicy | None:
    """FSDP2's offload policy for zero.offload_param (None: parameters stay on device)."""
    param_off = cfg.zero.offload_param
    if param_off.device != "cpu":
        return None
    pin = torch.cuda.is_available() if param_off.pin_memory is None else param_off.pin_memory
    return CPUOffloadPolicy(pin_memory=pin)


def build_offload_optimizer(
    params: list[nn.Parameter], model: nn.Module, cfg: Config, rank: int
) -> torch.optim.Optimizer | None:
    """The optimizer an offload setting needs, or None when offload is off.

    Args:
        params: the sharded parameters that require grad.
        model: the sharded model (gradient streaming hooks, parameter casting).
        cfg: the run's config.
        rank: global rank (names NVMe swap files).
    Returns:
        OffloadedAdamW, fsdpx.optim.AdamW (parameter offload), or None.

    Example::

        opt = build_offload_optimizer(params, model, cfg, rank=0) or build_optimizer(...)
    """
    opt_off, param_off = cfg.zero.offload_optimizer, cfg.zero.offload_param
    o = cfg.optimizer
    hyper: dict[str, Any] = dict(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    hyper["bias_correction"] = o.bias_correction
    decoupled = o.type == "adamw"
    if param_off.device == "cpu" and opt_off.device in ("none", "cpu"):
        # The parameters are fp32 on the host already: step them in place.
        return AdamW(params, decoupled_weight_decay=decoupled, **hyper)
    if opt_off.device == "none":
        return None
    device_dtype = None
    if param_off.device == "none":
        dtype = torch_dtype(cfg.precision.param_dtype)
        if dtype in (torch.bfloat16, torch.float16):
            device_dtype = dtype
    return OffloadedAdamW(
        params,
        decoupled_weight_decay=decoupled,
        offload=opt_off,
        model=model,
        device_dtype=device_dtype,
        rank=rank,
        **hyper,
    )
