"""One autograd node for a Linear -> activation -> Linear expert over all local experts.

`grouped_mlp(x, w1, b1, w2, b2, counts, act)` computes, for the rows of `x` sorted by local
expert (counts[j] rows for expert j), `act(x_j @ w1[j].T + b1[j]) @ w2[j].T + b2[j]` and
writes every expert's rows into one preallocated output; its backward writes every
expert's weight gradients into one stacked gradient and the input gradient into one
buffer. `gated_mlp` does the same for the gated (SwiGLU) experts of Hugging Face MoE
models: `(act(x_j @ gate[j].T) * (x_j @ up[j].T)) @ down[j].T`, with gate and up fused in
one [2 * ffn, d] weight (transformers' `gate_up_proj`) or given as two.

[Note: fused grouped MLP] A per-expert loop under autograd (DeepSpeed's module list, or
fsdpx's sorted loop) spends a large share of its time outside the matmuls on CPU, as
benchmarks/moe_grouped.py's profile shows: each expert's input slice has its own
SliceBackward, which allocates a zero-filled gradient the size of the whole input and
adds it into the input's gradient (E full-size fills and adds per layer), the outputs
are concatenated, the bias is a separate pass in backward, and the activation runs over
the full [rows, ffn] hidden state after every expert's matmul, out of cache.
torch._grouped_mm on CPU is itself a per-group loop of matmuls, and its bias has to be
gathered per row. Here every matmul writes with `out=` into its expert's rows of one
buffer (addmm fuses the bias), the activation and its derivative run on each expert's
rows right after its matmul (cache-hot), the activation's input gradient is reused in
place, and the backward keeps one [max rows, ffn] scratch buffer instead of a [rows, ffn]
gradient. The matmuls and their summation order are the loop's (row block by row
block, one GEMM per expert), so the results equal the loop's to fp32 rounding
(tests/test_moe_grouped_mlp.py). On CPU this node runs within 1-5% of its kernels alone
(benchmarks/moe_grouped.py --floor; README, Measured): what is left is autograd, per-op
dispatch and the first touch of freshly allocated buffers. On an H100-class GPU torch._grouped_mm is one kernel for all experts instead, and
grouped="auto" picks it there for small experts ([Note: auto grouped choice]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# (forward into out, backward (grad, input) -> grad in place) for the activations with
# aten kernels; any other parameterless activation is differentiated by autograd.
_Fwd = Callable[[Tensor, Tensor], Any]
_Bwd = Callable[[Tensor, Tensor], Any]


def _known(act: nn.Module) -> tuple[_Fwd, _Bwd] | None:
    aten = torch.ops.aten
    if type(act) is nn.GELU:
        approx = act.approximate
        return (
            lambda h, out: aten.gelu.out(h, approximate=approx, out=out),
            lambda g, h: aten.gelu_backward.grad_input(g, h, approximate=approx, grad_input=g),
        )
    if type(act) is nn.SiLU:
        return (
            lambda h, out: aten.silu.out(h, out=out),
            lambda g, h: aten.silu_backward.grad_input(g, h, grad_input=g),
        )
    if type(act) is nn.ReLU:
        return (
            lambda h, out: torch.clamp_min(h, 0, out=out),
            lambda g, h: g.masked_fill_(h <= 0, 0),
        )
    return None


class _Act:
    """An activation's forward into a buffer and its backward in place, resolved once per
    call (aten kernels where _known has them, else the module and autograd)."""

    def __init__(self, act: nn.Module) -> None:
        self.act = act
        self.known = _known(act)

    def forward(self, h: Tensor, out: Tensor) -> None:
        if self.known is not None:
            self.known[0](h, out)
        else:
            out.copy_(self.act(h))

    def backward(self, grad: Tensor, h: Tensor) -> Tensor:
        """d act / d h at `h` times `grad`, in place into `grad` where a kernel allows."""
        if self.known is not None:
            self.known[1](grad, h)
            return grad
        with torch.enable_grad():
            leaf = h.detach().requires_grad_()
            (dh,) = torch.autograd.grad(self.act(leaf), leaf, grad)
        return dh


def _bounds(counts: list[int]) -> list[tuple[int, int, int]]:
    """(expert, start row, end row) of every expert with rows."""
    out, start = [], 0
    for j, n in enumerate(counts):
        if n:
            out.append((j, start, start + n))
        start += n
    return out


def _zero_idle(counts: list[int], *grads: Tensor | None) -> None:
    """Zero the stacked gradients of the experts without rows (the loop writes the rest)."""
    for j, n in enumerate(counts):
        if n == 0:
            for g in grads:
                if g is not None:
                    g[j].zero_()


class _GroupedMLP(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        w1: Tensor,
        b1: Tensor | None,
        w2: Tensor,
        b2: Tensor | None,
        counts: list[int],
        act: nn.Module,
    ) -> Tensor:
        x = x.contiguous()
        h = x.new_empty(x.shape[0], w1.shape[1])
        a = torch.empty_like(h)
        out = x.new_empty(x.shape[0], w2.shape[1])
        fn = _Act(act)
        for j, s, e in _bounds(counts):
            if b1 is None:
                torch.mm(x[s:e], w1[j].t(), out=h[s:e])
            else:
                torch.addmm(b1[j], x[s:e], w1[j].t(), out=h[s:e])
            fn.forward(h[s:e], a[s:e])
            if b2 is None:
                torch.mm(a[s:e], w2[j].t(), out=out[s:e])
            else:
                torch.addmm(b2[j], a[s:e], w2[j].t(), out=out[s:e])
        ctx.save_for_backward(x, w1, w2, h, a)
        ctx.counts, ctx.act, ctx.bias = counts, fn, (b1 is not None, b2 is not None)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, w1, w2, h, a = ctx.saved_tensors
        need = ctx.needs_input_grad
        grad = grad.contiguous()
        dx = torch.empty_like(x) if need[0] else None
        dw1 = torch.empty_like(w1) if need[1] else None
        db1 = w1.new_empty(w1.shape[:2]) if ctx.bias[0] and need[2] else None
        dw2 = torch.empty_like(w2) if need[3] else None
        db2 = w2.new_empty(w2.shape[:2]) if ctx.bias[1] and need[4] else None
        bounds = _bounds(ctx.counts)
        _zero_idle(ctx.counts, dw1, db1, dw2, db2)
        width = max((e - s for _, s, e in bounds), default=0)
        scratch = h.new_empty(width, h.shape[1])  # d loss / d a, then d loss / d h
        for j, s, e in bounds:
            g = grad[s:e]
            if dw2 is not None:
                torch.mm(g.t(), a[s:e], out=dw2[j])
            if db2 is not None:
                torch.sum(g, 0, out=db2[j])
            dh = ctx.act.backward(torch.mm(g, w2[j], out=scratch[: e - s]), h[s:e])
            if dw1 is not None:
                torch.mm(dh.t(), x[s:e], out=dw1[j])
            if db1 is not None:
                torch.sum(dh, 0, out=db1[j])
            if dx is not None:
                torch.mm(dh, w1[j], out=dx[s:e])
        return dx, dw1, db1, dw2, db2, None, None


def grouped_mlp(
    x: Tensor,
    w1: Tensor,
    b1: Tensor | None,
    w2: Tensor,
    b2: Tensor | None,
    counts: list[int],
    act: nn.Module,
) -> Tensor:
    """Expert j's `act(x_j @ w1[j].T + b1[j]) @ w2[j].T + b2[j]` on its counts[j] rows.

    Args:
        x: rows sorted by local expert [sum(counts), d].
        w1, b1: the first Linear's stacked weight [E, ffn, d] and bias [E, ffn] (or None).
        w2, b2: the second Linear's stacked weight [E, d, ffn] and bias [E, d] (or None).
        counts: rows per local expert, len E.
        act: a parameterless activation module.
    """
    out: Tensor = _GroupedMLP.apply(x, w1, b1, w2, b2, counts, act)
    return out


class _GatedMLP(torch.autograd.Function):
    """(act(x @ gate.T) * (x @ up.T)) @ down.T per expert, gate and up as one weight
    [E, 2 * ffn, d] (gate rows first: transformers' `gate_up_proj` / `chunk(2)`)."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, gate_up: Tensor, down: Tensor, counts: list[int], act: nn.Module
    ) -> Tensor:
        x = x.contiguous()
        ffn = down.shape[2]
        gu = x.new_empty(x.shape[0], 2 * ffn)  # [gate | up] pre-activations, saved
        a = x.new_empty(x.shape[0], ffn)  # act(gate) * up, saved for down's weight grad
        out = x.new_empty(x.shape[0], down.shape[1])
        fn = _Act(act)
        for j, s, e in _bounds(counts):
            torch.mm(x[s:e], gate_up[j].t(), out=gu[s:e])
            fn.forward(gu[s:e, :ffn], a[s:e])
            a[s:e].mul_(gu[s:e, ffn:])
            torch.mm(a[s:e], down[j].t(), out=out[s:e])
        ctx.save_for_backward(x, gate_up, down, gu, a)
        ctx.counts, ctx.act = counts, fn
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, gate_up, down, gu, a = ctx.saved_tensors
        need = ctx.needs_input_grad
        grad = grad.contiguous()
        ffn = down.shape[2]
        dx = torch.empty_like(x) if need[0] else None
        dgu_w = torch.empty_like(gate_up) if need[1] else None
        ddown = torch.empty_like(down) if need[2] else None
        bounds = _bounds(ctx.counts)
        _zero_idle(ctx.counts, dgu_w, ddown)
        width = max((e - s for _, s, e in bounds), default=0)
        da = gu.new_empty(width, ffn)
        dgu = gu.new_empty(width, 2 * ffn)
        act_gate = gu.new_empty(width, ffn)
        for j, s, e in bounds:
            n, g = e - s, grad[s:e]
            if ddown is not None:
                torch.mm(g.t(), a[s:e], out=ddown[j])
            torch.mm(g, down[j], out=da[:n])
            gate, up = gu[s:e, :ffn], gu[s:e, ffn:]
            ctx.act.forward(gate, act_gate[:n])
            torch.mul(da[:n], act_gate[:n], out=dgu[:n, ffn:])  # d up
            torch.mul(da[:n], up, out=dgu[:n, :ffn])  # d act(gate)
            dgate = ctx.act.backward(dgu[:n, :ffn], gate)
            if dgate.data_ptr() != dgu[:n, :ffn].data_ptr():
                dgu[:n, :ffn].copy_(dgate)
            if dgu_w is not None:
                torch.mm(dgu[:n].t(), x[s:e], out=dgu_w[j])
            if dx is not None:
                torch.mm(dgu[:n], gate_up[j], out=dx[s:e])
        return dx, dgu_w, ddown, None, None


def gated_mlp(
    x: Tensor, gate_up: Tensor, down: Tensor, counts: list[int], act: nn.Module
) -> Tensor:
    """Expert j's `(act(x_j @ gate[j].T) * (x_j @ up[j].T)) @ down[j].T` on its rows.

    Args:
        x: rows sorted by local expert [sum(counts), d].
        gate_up: [E, 2 * ffn, d], the gate projection's rows then the up projection's.
        down: [E, d, ffn].
        counts: rows per local expert, len E.
        act: a parameterless activation module (the gate's).
    """
    out: Tensor = _GatedMLP.apply(x, gate_up, down, counts, act)
    return out


def as_module(fn: Callable[[Tensor], Tensor]) -> nn.Module:
    """An activation given as a function (transformers' `act_fn`) as a module."""
    if isinstance(fn, nn.Module):
        return fn
    if fn is F.silu:
        return nn.SiLU()
    return _Fn(fn)


class _Fn(nn.Module):
    def __init__(self, fn: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(x)
