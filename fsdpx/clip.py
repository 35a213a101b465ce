"""Gradient-norm clipping that works when gradients live on different meshes.

`torch.nn.utils.clip_grad_norm_` fails when DTensor gradients come from several meshes
(FSDP-only parameters next to FSDP x TP ones). Here the norm is computed per mesh (DTensor
reductions resolve their own placements), the per-mesh norms are combined, and under
pipeline parallelism the stages' contributions are summed over the pp group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def total_grad_norm(
    params: Iterable[torch.nn.Parameter],
    *,
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | None = None,
    in_fp32: bool = False,
) -> torch.Tensor:
    """The norm of all gradients together, as a plain tensor equal on every rank.

    Args:
        params: parameters whose .grad is a tensor or a DTensor (any mesh).
        norm_type: p of the p-norm; inf supported.
        pp_group: when given, norms of the pipeline stages are combined over it.
        in_fp32: accumulate 16-bit gradients' norms in fp32 (loss-scaled fp16 gradients
            overflow a 16-bit norm); else each norm comes in its gradient's dtype, as in
            torch.nn.utils.clip_grad_norm_.
    """
    parts: list[torch.Tensor] = []
    for group in _params_by_mesh(params):
        grads = [p.grad for p in group if p.grad is not None]
        if in_fp32:
            per_tensor = [
                torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads
            ]
            norm = torch.linalg.vector_norm(torch.stack(per_tensor), norm_type)
        else:
            norm = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=None)
        parts.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not parts:
        device = torch.device("cpu")
        total = torch.zeros((), device=device)
    elif math.isinf(norm_type):
        total = torch.stack(parts).max()
    else:
        total = torch.stack(parts).pow(norm_type).sum()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op, group=pp_group)
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


def clip_grad_norm_(
    params: Iterable[torch.nn.Parameter],
    max_norm: float,
    *,
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | None = None,
    replicas: Sequence[torch.nn.Parameter] = (),
) -> torch.Tensor:
    """Scale gradients in place so their total norm is at most max_norm; returns the norm
    before clipping (like torch's clip_grad_norm_). `replicas` are clipped but not counted
    in the norm: copies of a parameter another pipeline stage holds and counts
    ([Note: tied parameters across stages] in fsdpx/pipeline_tied.py).

    Example::

        norm = clip_grad_norm_(model.parameters(), 1.0)
    """
    params = [p for p in params if p.grad is not None]
    skip = {id(p) for p in replicas}
    counted = [p for p in params if id(p) not in skip]
    total = total_grad_norm(counted, norm_type=norm_type, pp_group=pp_group)
    # clip_grads_with_norm_ takes the *parameters* and scales their .grad: handed the
    # gradients themselves it finds no .grad on them and silently clips nothing.
    for group in _params_by_mesh(params):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=None)
    return total


def _params_by_mesh(params: Iterable[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """Parameters with a gradient, grouped by their gradient's mesh (None: plain tensors)."""
    groups: dict[object, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    return list(groups.values())
