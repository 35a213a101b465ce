"""The model and data of the DeepSpeed checkpoint fixtures (tests/data/deepspeed_ckpt/).

Plain torch only: scripts/make_deepspeed_fixtures.py imports this file by path in the
separate DeepSpeed environment, and the import tests build the same model under fsdpx.
Odd sizes on purpose: DeepSpeed pads its flat partitions, and the importer must undo it.
"""

from __future__ import annotations

import torch
from torch import nn

GLOBAL_MICRO_BATCH = 4
"""Rows per micro-batch over all data-parallel ranks."""


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.norm = nn.LayerNorm(13)
        self.fc2 = nn.Linear(13, 3)
        self.register_buffer("out_scale", torch.tensor([1.0, 2.0, 0.5]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.fc1(x.to(self.fc1.weight.dtype))))
        out = self.fc2(h).float() * self.out_scale.float()
        return ((out - y) ** 2).mean()


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def param_groups(model: nn.Module) -> list[dict[str, object]]:
    """Two groups (weights with decay, the rest without): two flat groups in DeepSpeed."""
    decay = [p for _, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for _, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0}]


def micro_batch(index: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s rows of global micro-batch `index` (counting every micro-batch of
    the run from 0), the same data at any world size dividing GLOBAL_MICRO_BATCH."""
    g = torch.Generator().manual_seed(1000 + index)
    x = torch.randn(GLOBAL_MICRO_BATCH, 7, generator=g)
    y = torch.randn(GLOBAL_MICRO_BATCH, 3, generator=g)
    rows = GLOBAL_MICRO_BATCH // world_size
    return x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
