"""Materialising a model built on the meta device after it was sharded (DeepSpeed's
`zero.Init`, the FSDP2 way): each rank allocates only its shards.

[Note: init on shards] `reset_parameters()` on sharded parameters runs on each rank's
local shard. On CUDA, DTensor's RNG tracker makes that equal to initialising the full
tensor; on CPU it does not, so the default seeds each rank differently (shards must not
repeat each other's values). For results that are bitwise independent of the world size
and equal to an unsharded model, use `per_param_init`: it builds one full parameter at a
time from a generator seeded by (seed, parameter name) and keeps this rank's shard, so the
peak extra memory is one parameter, not the model.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

ParamInit = Callable[[str, torch.Tensor, torch.Generator], None]


def materialize_(
    model: nn.Module,
    device: torch.device,
    *,
    seed: int,
    init_fn: Callable[[nn.Module], None] | None = None,
) -> None:
    """Allocate the (sharded) parameters of a meta-built model on `device` and initialise
    them with init_fn(model), else model.reset_parameters() (see [Note: init on shards])."""
    model.to_empty(device=device)
    if init_fn is not None:
        init_fn(model)
        return
    reset = getattr(model, "reset_parameters", None)
    if not callable(reset):
        raise ValueError(
            f"{type(model).__name__} was built on the meta device but has no "
            "reset_parameters(); pass init_fn= to fsdpx.shard (e.g. "
            "fsdpx.per_param_init(...)) to initialise it"
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed + (rank if device.type == "cpu" else 0))
        reset()


def per_param_init(fn: ParamInit, *, seed: int = 0) -> Callable[[nn.Module], None]:
    """Turn `fn(name, full_tensor, generator)` into an init_fn whose result depends only on
    (seed, parameter name): the same for any world size, stage, and for an unsharded model.

    Example::

        def gpt_init(name, t, g):
            if name.endswith("bias"): t.zero_()
            elif t.ndim == 1: t.fill_(1.0)
            else: t.normal_(0.0, 0.02, generator=g)
        engine = fsdpx.shard(meta_model, cfg, init_fn=fsdpx.per_param_init(gpt_init))
    """

    @torch.no_grad()
    def init(model: nn.Module) -> None:
        for name, param in model.named_parameters():
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            full = torch.empty(param.shape, dtype=param.dtype)  # CPU: generator is CPU
            fn(name, full, generator)
            if isinstance(param, DTensor):
                local = param.to_local()
                local.copy_(_local_piece(full, param))
            else:
                param.copy_(full)

    return init


def _local_piece(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    return full[index]
