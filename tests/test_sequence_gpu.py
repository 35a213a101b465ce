"""Tiled MLP and tiled loss on a real accelerator (one CUDA device): the same values as
untiled, and the peak memory of forward + backward (torch.cuda.max_memory_allocated) falls.

Run with `pytest -m gpu tests/test_sequence_gpu.py` on a machine with a GPU. Ulysses and
ring attention (context_parallel.mode "ring") need two or more ranks: their parity tests
run on CPU/gloo (tests/test_sequence_parallel.py, tests/test_sequence_ring.py); here the
ring's blockwise kernel runs on CUDA on one rank, and benchmarks/long_context.py's
`--device cuda` form runs at small sizes.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from fsdpx.demo.gpt import MLP, GPTConfig
from fsdpx.sequence import loss_fn, tile_mlp_, tiled_loss_fn

pytestmark = pytest.mark.gpu


def _peak(run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """run()'s result and the peak bytes allocated above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = run()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - before


def test_tiled_loss_on_cuda_equals_untiled_without_the_full_logits() -> None:
    torch.manual_seed(0)
    seq, dim, vocab = 8192, 256, 32768  # full logits: 1 GiB in fp32
    hidden = torch.randn(1, seq, dim, device="cuda")
    weight = (torch.randn(vocab, dim, device="cuda") * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (1, seq), device="cuda")
    labels[0, :100] = -100
    ha, hb = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    wb = weight.detach().clone().requires_grad_()

    def untiled() -> torch.Tensor:
        loss = loss_fn(ha @ weight.T, labels)
        loss.backward()
        return loss.detach()

    def tiled() -> torch.Tensor:
        loss = tiled_loss_fn(hb, wb, labels, tile_tokens=512)
        loss.backward()
        return loss.detach()

    la, peak_a = _peak(untiled)
    lb, peak_b = _peak(tiled)
    assert_close(lb, la)
    assert_close(hb.grad, ha.grad)
    assert_close(wb.grad, weight.grad)
    print(f"tiled loss peak: untiled {peak_a / 2**20:.0f} MiB, tiled {peak_b / 2**20:.0f} MiB")
    assert peak_b * 4 < peak_a


def test_tiled_mlp_on_cuda_equals_untiled_with_less_activation_memory() -> None:
    torch.manual_seed(0)
    mlp = MLP(GPTConfig(n_embd=512, dropout=0.0)).cuda()
    tiled = copy.deepcopy(mlp)
    tile_mlp_(tiled, tile_tokens=1024)
    x = torch.randn(1, 16384, 512, device="cuda")
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()

    def forward(module: torch.nn.Module, inp: torch.Tensor) -> Callable[[], torch.Tensor]:
        # Peak over forward only: what the graph keeps for backward is the activation cost.
        return lambda: module(inp)

    ya, peak_a = _peak(forward(mlp, xa))
    yb, peak_b = _peak(forward(tiled, xb))
    assert_close(yb, ya)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert_close(xb.grad, xa.grad)
    for (name, pa), pb in zip(mlp.named_parameters(), tiled.parameters(), strict=True):
        # A weight gradient sums 16384 tokens' products: tile by tile (16 partial sums) the
        # additions run in another order, and fp32 rounding of sums of this size is ~1e-6 of
        # their magnitude (seen on an H200: 2.1e-4 on gradients of magnitude ~100, which the
        # default atol of 1e-5 rejects). Bound the difference relative to the largest entry.
        scale = pa.grad.abs().max().item()
        assert_close(
            pb.grad, pa.grad, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}"
        )
    print(
        f"tiled MLP forward peak: untiled {peak_a / 2**20:.0f} MiB, tiled {peak_b / 2**20:.0f} MiB"
    )
    assert peak_b * 2 < peak_a


def test_ring_attention_kernel_on_cuda_matches_sdpa() -> None:
    """The ring's blockwise kernel on CUDA (one rank: no communication) against CUDA SDPA,
    in fp32 (to fp32 rounding) and under bf16 autocast (the ring computes its blocks in fp32,
    SDPA in bf16: both round to bf16, so within bf16's 2^-8 relative step)."""
    from tests import sp_ring_bodies
    from tests.dist import run_ranks

    # Spawned: CUDA cannot be used in a process forked after its parent touched the driver,
    # and the fork server's imports are only checked not to on CPU machines.
    (result,) = run_ranks(sp_ring_bodies.one_rank_kernel, 1, args=("cuda",), fresh_interpreter=True)
    for name, tolerance in (("fp32", 1e-4), ("bf16", 2e-2)):
        for what, diff, scale in zip(
            ("out", "dq", "dk", "dv"), result[name]["diffs"], result[name]["scales"], strict=True
        ):
            assert diff <= tolerance * max(scale, 1.0), f"{name} {what}: {diff} vs {scale}"


def test_long_context_benchmark_on_cuda_reports_less_peak_memory_when_tiled() -> None:
    """benchmarks/long_context.py --device cuda (one rank): it runs, and at the longest
    sweep length the tiled layout's peak (torch.cuda.max_memory_allocated over the steps)
    is below the untiled one's (the full logits alone are 8192 x 4096 x 4 bytes = 128 MiB,
    their gradient as much)."""
    root = Path(__file__).resolve().parent.parent
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        str(root / "benchmarks" / "long_context.py"),
        *("--device", "cuda", "--dim", "256", "--mlp-tile", "1024", "--seq", "2048"),
        *("--budget-mib", "256", "--sweep", "2048", "8192", "--steps", "2"),
    ]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    print(proc.stdout)
    num = r"\d+\.\d+"
    peaks = {}
    for tile in (0, 1024):
        cell = rf"\s+{num}\s+{num}\s+(\d+)"
        row = re.search(rf"^\s+1\s+{tile}{cell}{cell}$", proc.stdout, re.MULTILINE)
        assert row, f"no sweep row for tile {tile} in:\n{proc.stdout}"
        peaks[tile] = int(row.group(2))  # MiB at 8192 tokens
    assert peaks[1024] < peaks[0], peaks
