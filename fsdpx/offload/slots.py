"""The parameters an offloaded optimizer steps, as both state stores see them: one `Slot`
per parameter (its param group and its place in the flat layout), DTensor wrapping of
host state, and per-parameter step counting.

[Note: the flat layout] The parameters' local shards, concatenated in param-group order,
form one flat index space: `Slot.offset` is where a parameter starts. The NVMe store keeps
each of its regions (master, exp_avg, exp_avg_sq) in this layout; the host store keeps one
tensor per parameter and ignores the offsets.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from fsdpx.dtensor import to_local as local


@dataclass(frozen=True)
class Slot:
    """One parameter of an offloaded optimizer (host state holds this rank's local shard)."""

    param: torch.Tensor
    group: int
    """Index of its param group."""
    numel: int
    """Elements of its local shard."""
    offset: int
    """Start in the flat layout (elements; [Note: the flat layout])."""


def make_slots(param_groups: Iterable[dict[str, Any]]) -> list[Slot]:
    """One Slot per parameter, in param-group order, laid out back to back."""
    slots = []
    offset = 0
    for gi, group in enumerate(param_groups):
        for p in group["params"]:
            n = local(p).numel()
            slots.append(Slot(p, gi, n, offset))
            offset += n
    return slots


def wrap_like(param: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """`host` (this rank's local shard) as a tensor laid out like `param`: a DTensor with
    the parameter's mesh and placements when it is one (what checkpoints record)."""
    if isinstance(param, DTensor):
        # Not DTensor.from_local: it moves a host tensor to the mesh's device (a GPU copy
        # of the state, disconnected from the host buffers). The wrapper shares `host`.
        spec = DTensorSpec(
            param.device_mesh,
            param.placements,
            tensor_meta=TensorMeta(param.shape, param.stride(), host.dtype),
        )
        return DTensor(host, spec, requires_grad=False)
    return host


def count_steps(
    slots: Iterable[Slot], state: dict[torch.Tensor, dict[str, Any]]
) -> dict[int, list[Slot]]:
    """Advance the `step` counter in `state` of every slot whose parameter has a gradient,
    and group those slots by their new step number (each parameter counts its own steps,
    like torch: one without a gradient is not stepped)."""
    by_step: dict[int, list[Slot]] = {}
    for slot in slots:
        if slot.param.grad is None:
            continue
        entry = state.setdefault(slot.param, {})
        step_t = entry.get("step")
        if not isinstance(step_t, torch.Tensor):
            step_t = torch.zeros((), dtype=torch.float32)
            entry["step"] = step_t
        step_t += 1
        by_step.setdefault(int(step_t.item()), []).append(slot)
    return by_step
