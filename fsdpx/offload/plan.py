"""From zero.offload_optimizer / zero.offload_param to an `OffloadPlan`: where each model
state lives, decided once, read by fsdpx.shard (what to build) and fsdpx.estimate (what to
count).

[Note: the offload table]

| offload_param | offload_optimizer | params | master | moments | grads  | optimizer |
|---------------|-------------------|--------|--------|---------|--------|-----------|
| none          | none              | device | device | device  | device | cfg.optimizer (torch) |
| none          | cpu               | device | host   | host    | host   | OffloadedAdamW, HostState (device params 16-bit with bf16/fp16 precision) |
| none          | nvme              | device | nvme   | nvme    | device | OffloadedAdamW, NvmeState (gradients read chunk by chunk from the device) |
| cpu           | none / cpu        | host   | host   | host    | host   | fsdpx.optim.AdamW on the host fp32 params (fused adam_step, in place) |
| cpu           | nvme              | host   | nvme   | nvme    | host   | OffloadedAdamW over the host params, NvmeState |

"master" is where the fp32 weights the optimizer updates live: where it equals "params",
the optimizer steps the parameters in place. Everything else follows from the placements,
so a new placement (NVMe parameters) is a new row here and a store in fsdpx/offload.

`CPUOffloadPolicy()` pins host memory by default, which fails on a machine without an
accelerator: pin_memory defaults to whether one exists, and an explicit request to pin is
ignored (said once) where none does ([Note: pin_memory without an accelerator] in pin.py).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal

from fsdpx.config import Config, OffloadConfig
from fsdpx.optimizers import OPTIMIZERS

Placement = Literal["device", "host", "nvme"]

_PLACEMENT: dict[str, Placement] = {"none": "device", "cpu": "host", "nvme": "nvme"}
"""OffloadConfig.device -> where the state it governs lives."""

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class OffloadPlan:
    """Where each model state of one rank lives ([Note: the offload table])."""

    params: Placement
    """The sharded parameters between uses."""
    master: Placement
    """The fp32 weights the optimizer updates (== params: stepped in place)."""
    moments: Placement
    """The optimizer's moments."""
    grads: Placement
    """Where the optimizer step reads the gradients."""
    device_param_dtype: str | None
    """"bf16"/"fp16" when the device parameters are kept 16-bit behind host or NVMe
    masters, else None (they keep their dtype)."""
    optimizer_offload: OffloadConfig
    """zero.offload_optimizer (nvme_path, buffer_mb, pin_memory for the store)."""
    param_pin_memory: bool | None
    """zero.offload_param.pin_memory (None: pin when an accelerator exists)."""

    @property
    def steps_in_place(self) -> bool:
        """The optimizer updates the parameters themselves (no separate master)."""
        return self.master == self.params

    @property
    def offloaded(self) -> bool:
        """Any state lives off the device."""
        return self.params != "device" or self.master != "device"

    @property
    def streaming_buffer_bytes(self) -> int:
        """Host memory of the NVMe streaming buffers (0 without NVMe state)."""
        return self.optimizer_offload.buffer_mb << 20 if self.master == "nvme" else 0

    @property
    def host_gradient_copy(self) -> bool:
        """The step copies device gradients into host buffers of their own."""
        return self.grads == "host" and self.params == "device"

    def device_param_bytes(self, default: int) -> int:
        """Bytes per element of the device parameters (`default`: their own dtype's)."""
        if self.device_param_dtype is None:
            return default
        return _DTYPE_BYTES[self.device_param_dtype]


def resolve_offload(cfg: Config) -> OffloadPlan:
    """The OffloadPlan of `cfg` (no checks beyond the config's own; see check_offload).

    Example::

        plan = resolve_offload(Config.from_dict({"zero": {"offload_optimizer": {"device": "cpu"}}}))
        assert plan.master == "host"
    """
    opt_off, param_off = cfg.zero.offload_optimizer, cfg.zero.offload_param
    params = _PLACEMENT[param_off.device]
    master = _PLACEMENT[opt_off.device]
    if master == "device" or (params == "host" and master == "host"):
        master = params  # no optimizer offload of its own: step where the params are
    grads: Placement = "device" if params == "device" and master != "host" else "host"
    dtype = None
    if params == "device" and master != "device" and cfg.precision.param_dtype in ("bf16", "fp16"):
        dtype = cfg.precision.param_dtype
    return OffloadPlan(
        params=params,
        master=master,
        moments=master,
        grads=grads,
        device_param_dtype=dtype,
        optimizer_offload=opt_off,
        param_pin_memory=param_off.pin_memory,
    )


def check_offload(cfg: Config, optimizer: Any) -> OffloadPlan:
    """Reject offload settings fsdpx cannot honour, before anything is built, and return
    the plan.

    Example::

        plan = check_offload(cfg, optimizer=None)
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
    plan = resolve_offload(cfg)
    if not plan.offloaded:
        return plan
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
    if OPTIMIZERS[cfg.optimizer.type].decoupled_weight_decay is None:
        raise ValueError(
            f"offload supports optimizer.type 'adam' and 'adamw' (the fused CPU Adam), got "
            f"{cfg.optimizer.type!r}"
        )
    return plan
