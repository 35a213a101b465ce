"""Tiled computation along the sequence with recomputation (ALST's TiledMLP and tiled loss).

[Note: tiles with recomputation] A token-wise function f (an MLP, or the head plus the
cross-entropy of one token) is applied to the sequence in tiles: forward runs each tile
without building a graph and keeps only the input; backward recomputes one tile at a time
with autograd and accumulates the input's and the parameters' gradients. Peak activation
memory is that of one tile instead of the whole sequence (the MLP's 4x-wide hidden states,
the loss's full-vocabulary logits). Values equal the untiled ones up to floating-point
summation order: the forward of each token is the same arithmetic, but a parameter's
gradient is summed tile by tile instead of in one matmul, so results agree to fp32
tolerance, not bitwise (tests/test_sequence_tiled.py). The RNG state is restored before
each tile's recompute, so dropout draws the same masks twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn


def tiled_apply(
    fn: Callable[..., Tensor],
    x: Tensor,
    params: Sequence[Tensor],
    *,
    tile_tokens: int,
    seq_dim: int = 1,
    reduce_sum: bool = False,
    aux: Tensor | None = None,
) -> Tensor:
    """fn applied to tiles of `x` along `seq_dim` ([Note: tiles with recomputation]).

    Args:
        fn: a token-wise function of one tile; it may use `params` (and nothing else that
            needs a gradient).
        x: the input, tokens on `seq_dim`.
        params: the tensors fn uses that need gradients (e.g. module.parameters()).
        tile_tokens: tokens per tile (the last tile may be shorter).
        reduce_sum: False concatenates the tiles' outputs along seq_dim; True sums them
            (fn returns a scalar per tile, e.g. a summed loss).
        aux: a tensor without gradient tiled alongside x (e.g. labels); fn is then called
            as fn(tile, aux_tile).
    Returns:
        What fn(x) returns (for reduce_sum: the sum of the per-tile results).

    Example::

        y = tiled_apply(mlp, x, list(mlp.parameters()), tile_tokens=1024)
    """
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be >= 1; got {tile_tokens=}")
    out: Tensor = _Tiled.apply(fn, tile_tokens, seq_dim, reduce_sum, aux, x, *params)
    return out


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[Tensor, Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        fn: Callable[[Tensor], Tensor],
        tile_tokens: int,
        seq_dim: int,
        reduce_sum: bool,
        aux: Tensor | None,
        x: Tensor,
        *params: Tensor,
    ) -> Tensor:
        ctx.fn, ctx.tile, ctx.dim, ctx.reduce_sum = fn, tile_tokens, seq_dim, reduce_sum
        ctx.aux = aux
        ctx.save_for_backward(x, *params)
        ctx.rng = []
        outs = []
        with torch.no_grad():
            for i, tile in enumerate(x.split(tile_tokens, dim=seq_dim)):
                ctx.rng.append(_rng_state(x.device))
                outs.append(fn(tile, *_aux_tile(aux, i, tile_tokens, seq_dim)))
        if reduce_sum:
            return torch.stack(outs).sum(0)
        return torch.cat(outs, dim=seq_dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, *params = ctx.saved_tensors
        wanted = [p for p in params if p.requires_grad]
        param_grads: list[Tensor | None] = [None] * len(wanted)
        x_grads = []
        tiles = x.split(ctx.tile, dim=ctx.dim)
        grads = [grad] * len(tiles) if ctx.reduce_sum else grad.split(ctx.tile, dim=ctx.dim)
        current = _rng_state(x.device)
        for i, (tile, g, rng) in enumerate(zip(tiles, grads, ctx.rng, strict=True)):
            tile = tile.detach().requires_grad_(x.requires_grad)
            _set_rng_state(rng, x.device)
            with torch.enable_grad():
                y = ctx.fn(tile, *_aux_tile(ctx.aux, i, ctx.tile, ctx.dim))
            inputs = ([tile] if x.requires_grad else []) + wanted
            got = torch.autograd.grad(y, inputs, g, allow_unused=True)
            if x.requires_grad:
                x_grads.append(got[0])
                got = got[1:]
            for i, pg in enumerate(got):
                prev = param_grads[i]
                if pg is not None:
                    param_grads[i] = pg if prev is None else prev + pg
        _set_rng_state(current, x.device)
        x_grad = torch.cat(x_grads, dim=ctx.dim) if x.requires_grad else None
        it = iter(param_grads)
        out_params = [next(it) if p.requires_grad else None for p in params]
        return (None, None, None, None, None, x_grad, *out_params)


def _aux_tile(aux: Tensor | None, i: int, tile_tokens: int, dim: int) -> tuple[Tensor, ...]:
    if aux is None:
        return ()
    return (aux.narrow(dim, i * tile_tokens, min(tile_tokens, aux.shape[dim] - i * tile_tokens)),)


def tile_mlp_(module: nn.Module, *, tile_tokens: int, seq_dim: int = 1) -> None:
    """Make `module` (a token-wise MLP) run in tiles of `tile_tokens`, in place.

    The module keeps its class, parameters and names (state dicts and checkpoints are
    unchanged): only its forward is replaced by one that calls the original through
    `tiled_apply`.

    Example::

        for block in model.blocks:
            tile_mlp_(block.mlp, tile_tokens=2048)
    """
    original = module.forward

    def forward(x: Tensor) -> Tensor:
        # Parameters are read at call time: under FSDP they are the unsharded ones then.
        params = [p for p in module.parameters() if p.requires_grad]
        return tiled_apply(original, x, params, tile_tokens=tile_tokens, seq_dim=seq_dim)

    module.forward = forward  # type: ignore[method-assign]


def apply_tiled_mlp(blocks: Sequence[nn.Module], tile_tokens: int, name: str = "mlp") -> int:
    """Tile the `name` child of every block (context_parallel.mlp_tile_tokens); returns
    how many were tiled. Raises ValueError when tiling is on and no block has one."""
    if tile_tokens == 0:
        return 0
    found = [b.get_submodule(name) for b in blocks if hasattr(b, name)]
    if not found:
        raise ValueError(
            f"context_parallel.mlp_tile_tokens is {tile_tokens} but none of the model's "
            f"{len(blocks)} blocks has a submodule named {name!r} to tile; set "
            "mlp_tile_tokens to 0, or tile your MLP with fsdpx.sequence.tile_mlp_"
        )
    for mlp in found:
        tile_mlp_(mlp, tile_tokens=tile_tokens)
    return len(found)
