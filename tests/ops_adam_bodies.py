"""Rank bodies for tests/test_ops_adam.py (spawned ranks import them from here)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import fsdpx.optim
from fsdpx.ops import adam_step, load_ops

STEPS = 4
GLOBAL_BATCH = 8


def make_mlp(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    # 33 and 29: shard sizes that do not divide evenly over 2 ranks (FSDP pads the last shard).
    return torch.nn.Sequential(
        torch.nn.Linear(33, 29), torch.nn.Tanh(), torch.nn.Linear(29, 7), torch.nn.Tanh()
    )


def batches(seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(GLOBAL_BATCH, 33, generator=g) for _ in range(STEPS)]


OPT_KW: dict[str, Any] = dict(lr=3e-2, weight_decay=0.1, amsgrad=True)


def reference_params() -> dict[str, torch.Tensor]:
    """One process, torch.optim.AdamW, the whole global batch (FSDP averages the ranks'
    gradients, so the per-rank mean losses average to this mean loss)."""
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), **OPT_KW)
    for x in batches():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def fsdp_adamw_body(rank: int, world_size: int) -> dict[str, Any]:
    """FSDP2-shard the MLP, step it with fsdpx.optim.AdamW; return the full params and
    whether every parameter went through the native kernel on its local shard."""
    model = make_mlp()
    fully_shard(model[0])
    fully_shard(model)
    opt = fsdpx.optim.AdamW(model.parameters(), **OPT_KW)
    per_rank = GLOBAL_BATCH // world_size
    native: list[bool] = []
    for x in batches():
        opt.zero_grad()
        model(x[rank * per_rank : (rank + 1) * per_rank]).square().mean().backward()
        native = [
            fsdpx.optim._native_fits(p, p.grad, opt.state[p] or _zero_state(p), True)
            for p in model.parameters()
            if p.grad is not None
        ]
        opt.step()
    full = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), f"{name} is not sharded"
        full[name] = p.full_tensor().detach().clone()
    dist.barrier()
    return {
        "params": full,
        "native": native,
        "ops": load_ops().available,
        "errors": _layout_errors(model[0].weight.device_mesh),
    }


def _layout_errors(mesh: Any) -> list[str]:
    """adam_step's messages for a gradient laid out unlike its DTensor parameter."""
    p = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])
    state = [distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]) for _ in range(2)]
    errors = []
    for grad in (distribute_tensor(torch.zeros(8, 4), mesh, [Replicate()]), torch.zeros(4, 4)):
        try:
            adam_step([p], [grad], [state[0]], [state[1]], lr=1e-3, step=1)
        except ValueError as e:
            errors.append(str(e))
    return errors


def _zero_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
    z = torch.zeros_like(p)
    return {"exp_avg": z, "exp_avg_sq": z, "max_exp_avg_sq": z}
