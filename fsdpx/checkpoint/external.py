"""Optimizers whose state is not plain torch state, as checkpoint code sees them.

`ExternalState` is the protocol saving and loading rely on (fsdpx.offload.OffloadedAdamW
implements it); the registry lets a model-only save or load find the optimizer that holds
a model's fp32 masters.
"""

from __future__ import annotations

import contextlib
import weakref
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class ExternalState(Protocol):
    """What checkpoint code needs from an optimizer whose state is not plain torch state
    (fsdpx.offload.OffloadedAdamW: fp32 masters and moments in host memory or an NVMe swap
    file, behind device parameters that may be 16-bit).

    [Note: external optimizer state] Such an optimizer's `state` and masters are readable
    only inside `checkpoint_view()`: saving collects (or snapshots) the pieces while it is
    open, saving the masters in place of the device parameters; loading writes into them
    and then calls `after_load()`. `save_synchronously()` says that a snapshot for an async
    save would cost what the store exists to avoid (a swap file copied into host memory),
    so such saves are written before returning.
    """

    def checkpoint_view(self) -> AbstractContextManager[dict[int, Any]]:
        """While open, `state` holds every state tensor; yields id(parameter) -> the fp32
        master that a checkpoint stores as that parameter."""
        ...

    def after_load(self) -> None:
        """Push the loaded masters to the device parameters."""
        ...

    def save_synchronously(self) -> bool:
        """Whether an async save must still be written synchronously."""
        ...


_EXTERNAL_STATE: weakref.WeakKeyDictionary[nn.Module, weakref.ref[ExternalState]] = (
    weakref.WeakKeyDictionary()
)
"""model -> the optimizer holding its parameters' fp32 masters (both held weakly)."""


def register_external_state(model: nn.Module, optimizer: ExternalState) -> None:
    """Record that `optimizer` holds the fp32 masters of `model`'s parameters, so that a
    model-only save or load (optimizer=None) still goes through them."""
    _EXTERNAL_STATE[model] = weakref.ref(optimizer)


def external_state_owner(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> torch.optim.Optimizer | ExternalState | None:
    """`optimizer`, or when None the optimizer registered for `model`: a model-only save or
    load must still go through its masters (the device copy may be 16-bit, and the next
    step would overwrite loaded parameters from stale masters)."""
    if optimizer is not None:
        return optimizer
    ref = _EXTERNAL_STATE.get(model)
    return ref() if ref is not None else None


def external_state_view(owner: object) -> AbstractContextManager[dict[int, Any]]:
    """`owner`'s checkpoint view when it is an ExternalState, else an empty one ({})."""
    if isinstance(owner, ExternalState):
        return owner.checkpoint_view()
    return contextlib.nullcontext({})
