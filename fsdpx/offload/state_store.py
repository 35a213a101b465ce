"""Where an offloaded optimizer keeps its fp32 masters and Adam moments: the state-store
interface, and what every store is built from.

[Note: state stores] OffloadedAdamW (fsdpx/offload/optimizer.py) owns what does not depend
on where the state lives: the param groups, the slots, the step counters in `state` and
the copy stream. A store owns the rest: the master and moment tensors, the gradient copies
into host memory and the fused step over them, and the checkpoint view of the state.
`HostState` (host_state.py) keeps them in (pinned) host memory; `NvmeState` (nvme_state.py)
keeps them in a swap file and streams them through fixed host buffers. Which one a run
gets is decided once, by the offload plan (plan.py); a new placement is a new store.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from fsdpx.config import OffloadConfig
from fsdpx.offload.copies import DeviceCopies
from fsdpx.offload.slots import Slot


@dataclass(frozen=True)
class StoreContext:
    """What OffloadedAdamW hands its store."""

    slots: list[Slot]
    param_groups: list[dict[str, Any]]
    state: dict[torch.Tensor, dict[str, Any]]
    """The optimizer's `state` (torch.optim.AdamW's layout), shared, not copied."""
    copies: DeviceCopies
    offload: OffloadConfig
    """zero.offload_optimizer (nvme_path, buffer_mb)."""
    pin_memory: bool
    copy_dtype: torch.dtype | None
    """16-bit dtype of the device parameters, or None (fp32 on device: copy the master)."""
    model: nn.Module | None
    """The sharded model (gradient streaming hooks), or None."""
    rank: int
    """Global rank (names swap files)."""


class StateStore(Protocol):
    """The offloaded state of one OffloadedAdamW ([Note: state stores])."""

    host_bytes: int
    """Host bytes of streaming buffers (0 when the state itself is in host memory)."""
    file_bytes: int
    """Bytes of swap files on disk (0 when none)."""
    saves_synchronously: bool
    """Whether a checkpoint must be written while the view is open: an async snapshot
    would copy all of the state into host memory."""

    def host_tensors(self) -> list[torch.Tensor]:
        """The per-parameter host tensors it holds (masters, moments, gradient and 16-bit
        copies); streaming buffers are counted in host_bytes instead."""

    def prepare_backward(self, is_boundary: bool) -> None:
        """Called before each backward; `is_boundary`: it ends an accumulation window."""

    def step(self, inv_grad_scale: float) -> None:
        """One Adam step over every slot with a gradient, gradients times `inv_grad_scale`;
        the new parameters are copied back to the device."""

    def checkpoint_view(self) -> AbstractContextManager[dict[int, torch.Tensor]]:
        """While open, `state` holds every state tensor and the yielded dict maps
        id(device parameter) to its fp32 master (see OffloadedAdamW.checkpoint_view)."""

    def push_masters(self) -> None:
        """Copy every master to its device parameter (after a checkpoint load)."""

    def close(self) -> None:
        """Release hooks and files (idempotent)."""
