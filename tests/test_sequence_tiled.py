"""Tiled MLP and tiled loss against untiled ([Note: tiles with recomputation]).

Tolerance: fp32 defaults of torch.testing.assert_close, not bitwise. Each token's forward is
the same arithmetic, but weight gradients are summed tile by tile instead of by one matmul
over all tokens, and matmuls over fewer rows may take another blocking: the summation order
differs, so the last bits may too.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from fsdpx.demo.gpt import MLP, GPTConfig
from fsdpx.sequence import loss_fn, tile_mlp_, tiled_loss_fn
from fsdpx.sequence.tiled import apply_tiled_mlp


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tile", [1, 5, 16, 64])
def test_tiled_mlp_equals_untiled(tile: int) -> None:
    torch.manual_seed(0)
    mlp = MLP(GPTConfig(n_embd=32, dropout=0.0))
    for p in mlp.parameters():
        nn.init.normal_(p, std=0.2)
    tiled = copy.deepcopy(mlp)
    tile_mlp_(tiled, tile_tokens=tile)
    x = torch.randn(3, 37, 32)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = mlp(xa), tiled(xb)
    assert_close(yb, ya)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert_close(xb.grad, xa.grad)
    assert_close(_grads(tiled), _grads(mlp))
    # Names (and so state dicts and checkpoints) do not change.
    assert list(tiled.state_dict()) == list(mlp.state_dict())


def test_tiled_mlp_replays_dropout_masks() -> None:
    # The recompute in backward must draw the masks the forward drew. Dropout comes last
    # in the MLP, so the output is 0 exactly where the forward dropped, and the gradient of
    # down_proj.bias is sum(g * kept) / (1 - p) only if backward used the same mask.
    torch.manual_seed(0)
    mlp = MLP(GPTConfig(n_embd=16, dropout=0.5))
    tile_mlp_(mlp, tile_tokens=4)
    x = torch.randn(2, 12, 16, requires_grad=True)
    y = mlp(x)
    g = torch.randn_like(y)
    y.backward(g)
    kept = (y != 0).float()
    assert 0.3 < kept.mean().item() < 0.7
    assert_close(mlp.down_proj.bias.grad, (g * kept).sum((0, 1)) * 2.0)


@pytest.mark.parametrize("tile", [1, 7, 64])
def test_tiled_loss_equals_untiled_with_ignored_labels(tile: int) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(2, 23, 16)
    weight = torch.randn(50, 16)
    labels = torch.randint(0, 50, (2, 23))
    labels[0, :5] = -100
    labels[1, -7:] = -100
    ha, hb = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    wa, wb = weight.clone().requires_grad_(), weight.clone().requires_grad_()
    la = loss_fn(ha @ wa.T, labels, num_items_in_batch=40)
    lb = tiled_loss_fn(hb, wb, labels, tile_tokens=tile, num_items_in_batch=40)
    assert_close(lb, la)
    la.backward()
    lb.backward()
    assert_close(hb.grad, ha.grad)
    assert_close(wb.grad, wa.grad)
    # num_items_in_batch None: the plain mean over this rank's valid tokens.
    expected = torch.nn.functional.cross_entropy(
        (hidden @ weight.T).flatten(0, 1), labels.flatten()
    )
    assert_close(loss_fn(hidden @ weight.T, labels), expected)


def test_apply_tiled_mlp_needs_an_mlp_to_tile() -> None:
    blocks = [nn.Linear(2, 2), nn.Linear(2, 2)]
    with pytest.raises(ValueError, match=r"mlp_tile_tokens is 8 but none of the model's 2 blocks"):
        apply_tiled_mlp(blocks, 8)
    assert apply_tiled_mlp(blocks, 0) == 0
