"""grouped="grouped_mm" (torch._grouped_mm per Linear over all local experts) against the
sorted per-expert loop on the same stacked weights: outputs and gradients, uneven and empty
expert loads included; and the templates it refuses."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fsdpx.moe import MoE
from fsdpx.moe.experts import Experts


def _mlp(bias: bool = True) -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 12, bias=bias), nn.GELU(), nn.Linear(12, 8, bias=bias))


@pytest.mark.parametrize("bias", [True, False])
def test_grouped_mm_equals_the_loop(bias: bool) -> None:
    torch.manual_seed(0)
    loop = Experts(_mlp(bias), 4, grouped="loop", reinit=True)
    grouped = copy.deepcopy(loop)
    grouped.grouped = "grouped_mm"
    counts = [5, 0, 11, 2]  # uneven, one expert without rows
    x = torch.randn(sum(counts), 8)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [m(xi, counts) for m, xi in zip((loop, grouped), xs, strict=True)]
    torch.testing.assert_close(outs[1], outs[0])
    for out in outs:
        out.square().sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad)
    for (name, p), q in zip(loop.named_parameters(), grouped.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")


def test_moe_layer_with_grouped_mm() -> None:
    torch.manual_seed(0)
    layer = MoE(8, _mlp(), 4, k=2, capacity_factor=None, reinit_experts=True)
    torch.manual_seed(0)
    grouped = MoE(
        8, _mlp(), 4, k=2, capacity_factor=None, reinit_experts=True, grouped="grouped_mm"
    )
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(grouped(x)[0], layer(x)[0])


def test_grouped_mm_refuses_other_experts() -> None:
    with pytest.raises(ValueError, match=r"grouped='grouped_mm': it computes experts of the form"):
        Experts(nn.Linear(8, 8), 4, grouped="grouped_mm")
    with pytest.raises(ValueError, match=r"grouped must be one of 'auto', 'fused'"):
        Experts(_mlp(), 4, grouped="fast")  # type: ignore[arg-type]
