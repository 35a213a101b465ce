"""grouped="fused" (fsdpx/moe/grouped_mlp.py: one autograd node for Linear -> activation ->
Linear experts over all local experts) and the gated (SwiGLU) form against per-expert
loops on the same weights: outputs and every gradient, uneven and empty expert loads, with
and without biases, each activation kind (aten kernels and the autograd fallback)."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fsdpx.moe import MoE
from fsdpx.moe.experts import Experts
from fsdpx.moe.grouped_mlp import gated_mlp

COUNTS = [5, 0, 11, 2]  # uneven, one expert without rows


def _mlp(act: nn.Module, bias: bool = True) -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 12, bias=bias), act, nn.Linear(12, 8, bias=bias))


@pytest.mark.parametrize(
    "act", [nn.GELU(), nn.GELU(approximate="tanh"), nn.SiLU(), nn.ReLU(), nn.Tanh()], ids=str
)
@pytest.mark.parametrize("bias", [True, False])
def test_fused_equals_the_loop(act: nn.Module, bias: bool) -> None:
    torch.manual_seed(0)
    loop = Experts(_mlp(act, bias), 4, grouped="loop", reinit=True)
    fused = copy.deepcopy(loop)
    fused.grouped = "fused"
    x = torch.randn(sum(COUNTS), 8)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [m(xi, COUNTS) for m, xi in zip((loop, fused), xs, strict=True)]
    # Bitwise: the same matmuls on the same row blocks ([Note: fused grouped MLP]).
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    for out in outs:
        out.square().sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=0, atol=0)
    for (name, p), q in zip(loop.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)


def test_auto_picks_fused_for_mlps_and_the_loop_otherwise() -> None:
    mlp = Experts(_mlp(nn.GELU()), 2)
    assert mlp.grouped == "auto" and mlp.mode(torch.randn(3, 8)) == "fused"  # on CPU
    assert Experts(nn.Linear(8, 8), 2).grouped == "loop"
    with pytest.raises(ValueError, match=r"grouped='fused': it computes experts of the form"):
        Experts(nn.Linear(8, 8), 2, grouped="fused")
    with pytest.raises(ValueError, match=r"grouped must be one of 'auto', 'fused'"):
        Experts(_mlp(nn.GELU()), 2, grouped="fast")  # type: ignore[arg-type]


def test_moe_layer_fused_equals_loop() -> None:
    """The dropless MoE layer's output, aux loss and gradients with the fused experts."""
    torch.manual_seed(0)
    layers = [
        MoE(8, _mlp(nn.GELU()), 4, k=2, capacity_factor=None, reinit_experts=True, grouped=g)
        for g in ("loop", "fused")
    ]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(3, 5, 8)
    outs = [layer(x) for layer in layers]
    for i in range(2):
        torch.testing.assert_close(outs[1][i], outs[0][i])
    for out in outs:
        (out[0].square().sum() + out[1]).backward()
    for (name, p), q in zip(layers[0].named_parameters(), layers[1].parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


@pytest.mark.parametrize("act", [nn.SiLU(), nn.GELU(), nn.Tanh()], ids=str)
def test_gated_equals_the_loop(act: nn.Module) -> None:
    """transformers' experts: down(act(gate(x)) * up(x)), gate and up fused as [E, 2F, d]."""
    torch.manual_seed(0)
    gate_up = torch.randn(4, 2 * 12, 8, requires_grad=True)
    down = torch.randn(4, 8, 12, requires_grad=True)
    x = torch.randn(sum(COUNTS), 8, requires_grad=True)
    out = gated_mlp(x, gate_up, down, COUNTS, act)
    outs, start = [], 0
    for j, n in enumerate(COUNTS):
        gate, up = F.linear(x[start : start + n], gate_up[j]).chunk(2, dim=-1)
        outs.append(F.linear(act(gate) * up, down[j]))
        start += n
    ref = torch.cat(outs)
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.square().sum(), (x, gate_up, down))
    ref_grads = torch.autograd.grad(ref.square().sum(), (x, gate_up, down))
    for name, g, r in zip(("x", "gate_up", "down"), grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, msg=name)


def test_grouped_benchmark_refuses_cuda_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: test_grouped_benchmark_on_cuda runs instead")
    proc = _benchmark("--device", "cuda")
    assert proc.returncode != 0
    assert re.search(r"--device cuda: torch \S+ sees no CUDA device", proc.stderr), proc.stderr


@pytest.mark.gpu
def test_fused_and_grouped_mm_on_cuda_equal_the_loop() -> None:
    """bf16 on a GPU: the fused node and torch._grouped_mm against the sorted loop.

    The fused node runs the loop's kernels (torch's defaults). torch._grouped_mm rounds
    each matmul to bf16 before the bias is added (the loop's addmm rounds once), so its
    outputs differ by a few bf16 ulps: measured on an H100 (torch 2.11) at most 0.0059 on
    outputs up to 0.91, 1.5 ulps at the top binade. Bound: 4 ulps of the largest output."""
    torch.manual_seed(0)
    # 16 / 32 features: torch._grouped_mm on CUDA wants 16-byte-aligned rows.
    template = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    loop = Experts(template, 4, grouped="loop", reinit=True).cuda().bfloat16()
    x = torch.randn(sum(COUNTS) * 8, 16, device="cuda", dtype=torch.bfloat16)
    counts = [c * 8 for c in COUNTS]
    ref = loop(x, counts)
    for mode in ("fused", "grouped_mm"):
        other = copy.deepcopy(loop)
        other.grouped = mode  # type: ignore[assignment]
        got = other(x, counts)
        if mode == "fused":
            torch.testing.assert_close(got, ref, msg=mode)
            continue
        diff = (got.float() - ref.float()).abs()
        rows = torch.tensor([0, *counts]).cumsum(0).tolist()
        per_expert = [
            float(diff[a:b].max()) if b > a else 0.0
            for a, b in zip(rows[:-1], rows[1:], strict=True)
        ]
        bound = 2**-6 * float(ref.abs().max())
        assert max(per_expert) <= bound, (mode, per_expert, bound)


@pytest.mark.gpu
def test_grouped_benchmark_on_cuda() -> None:
    """benchmarks/moe_grouped.py --device cuda end to end (bf16, every way checked against
    the module loop before timing)."""
    proc = _benchmark("--device", "cuda", "--tokens", "1024", "--repeat", "3")
    assert proc.returncode == 0, proc.stderr
    assert "torch._grouped_mm" in proc.stdout and "bfloat16" in proc.stdout, proc.stdout


def _benchmark(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "moe_grouped.py"
    cmd = [sys.executable, str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)
