"""A sequential model with parameter-free layers (ReLU, MaxPool, Flatten, Dropout) and
in-place ops, split by fsdpx's pipeline at module boundaries: the model, its
single-process reference and the rank body (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import fsdpx
from fsdpx.distributed import init_distributed
from fsdpx.parallel_dims import ParallelDims
from fsdpx.parallelize import parallelize


class Chain(nn.Module):
    """Children called in order; a pruned (None) child is skipped, as fsdpx's split needs."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__()
        for i, layer in enumerate(layers):
            self.add_module(str(i), layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self._modules.values():
            if layer is not None:
                x = layer(x)
        return x


def make_chain() -> Chain:
    """Units 0..9; 1, 2, 3, 4, 6, 7, 8 hold no parameters. Layer 4 is an in-place ReLU that
    starts the second stage when split at "4", and ends the first when split at "5"."""
    torch.manual_seed(0)
    return Chain(
        nn.Conv2d(1, 4, 3, padding=1),  # 0
        nn.ReLU(inplace=True),  # 1
        nn.MaxPool2d(2),  # 2
        nn.Dropout(0.0),  # 3
        nn.ReLU(inplace=True),  # 4
        nn.Conv2d(4, 4, 3, padding=1),  # 5
        nn.MaxPool2d(2),  # 6
        nn.Flatten(),  # 7
        nn.Dropout(0.0),  # 8
        nn.Linear(4 * 2 * 2, 3),  # 9
    )


def batches(steps: int, gas: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    return [
        [
            (torch.randn(2, 1, 8, 8, generator=g), torch.randint(0, 3, (2,), generator=g))
            for _ in range(gas)
        ]
        for _ in range(steps)
    ]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def reference_grads(split_at: str) -> dict[str, torch.Tensor]:
    """Gradients of one step (2 micro-batches, mean loss) in one process."""
    model = make_chain()
    micro = batches(1, 2)[0]
    loss = sum(loss_fn(model(x), y) for x, y in micro) / len(micro)
    loss.backward()  # type: ignore[union-attr]
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def chain_body(rank: int, world_size: int, split_at: str) -> dict[str, Any]:
    """One schedule step of the chain on 2 pipeline stages split at `split_at`."""
    cfg = fsdpx.Config.from_dict(
        {
            "gradient_accumulation_steps": 2,
            "mesh": {"pp": 2},
            "pipeline": {"schedule": "GPipe", "split_points": [split_at]},
            "zero": {"block_classes": ["Conv2d", "Linear"]},
        }
    )
    info = init_distributed(cfg)
    dims = ParallelDims.from_config(cfg.mesh, info.world_size)
    mesh = dims.build_mesh("cpu")
    model = make_chain()
    blocks = [m for m in model.children() if any(True for _ in m.parameters())]
    built = parallelize(
        model, blocks, cfg=cfg, dims=dims, mesh=mesh, device=info.device, loss_fn=loss_fn
    )
    assert built.pipeline is not None
    loss = built.pipeline.step(batches(1, 2)[0], 1.0, info.device)
    grads = {}
    for name, p in built.module.named_parameters():
        g = p.grad
        if g is not None:
            grads[name] = g.full_tensor() if isinstance(g, DTensor) else g
    held = sorted(n for n, _ in built.parts[0].named_children())
    return {"loss": float(loss), "grads": grads, "held": held}
