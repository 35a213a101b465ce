"""The one helper for "this rank's tensor": a DTensor's local shard, any other tensor itself.

Gradient passes, materialisation, checkpoint pieces and the gradient stream all work on
local tensors whether or not a parameter is sharded; they call `to_local` here rather than
each keeping its own `isinstance(..., DTensor)` switch.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def to_local(t: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor: `t.to_local()` for a DTensor, else `t` unchanged.

    Args:
        t: a plain tensor or a DTensor.

    Returns:
        A view sharing storage with `t` (no copy, no communication); still attached to
        autograd, so callers that must not record or write through autograd detach it.

    Example::

        grads = [to_local(p.grad) for p in model.parameters() if p.grad is not None]
    """
    return t.to_local() if isinstance(t, DTensor) else t
