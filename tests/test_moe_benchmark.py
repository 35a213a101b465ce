"""benchmarks/moe.py at any world size: the layouts it skips (with the reason) and, slow /
gpu, the whole script on one rank (gloo on CPU; NCCL on one GPU, the lead's single-GPU row).
The 4-rank run is tests/test_benchmarks_smoke.py::test_moe_script_runs (slow)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import benchmarks.moe as moe_benchmark
import benchmarks.moe_grouped as moe_grouped
from fsdpx.moe.experts import Experts
from tests.benchmark_run import NUM, run_benchmark

REPLICATED = ("replicated", "replicated_padded", "replicated_grouped_mm", "replicated_fused")


def test_layouts_that_need_more_ranks_are_skipped_with_the_reason() -> None:
    names = list(moe_benchmark.LAYOUTS)
    one = moe_benchmark.skipped(names, 1)
    assert sorted(one) == ["ep2", "ep4"]
    assert re.fullmatch(
        r"mesh\.ep = 4 must divide the world size, which is 1: run with a multiple of 4 "
        r"ranks \(4 runs every layout\)",
        one["ep4"],
    ), one["ep4"]
    assert list(moe_benchmark.skipped(names, 2)) == ["ep4"]
    assert moe_benchmark.skipped(names, 4) == {}
    assert list(moe_benchmark.skipped(names, 6)) == ["ep4"]


def _one_rank(*args: str) -> str:
    out = run_benchmark(["moe.py", *args], ranks=1)
    for name in ("ep2", "ep4"):
        assert re.search(rf"^skipped {name}: mesh\.ep = \d must divide", out, re.M), out
    losses = []
    for name in REPLICATED:
        row = re.search(rf"^{name}\s+{NUM}\s+{NUM}(\s+{NUM}){{7}}\s+-\s+{NUM}$", out, re.M)
        assert row, f"no row for {name} in:\n{out}"
        cells = row.group(0).split()
        assert cells[3] == cells[5], row.group(0)  # model-state bytes: measured = estimated
        losses.append(float(cells[-1]))
    assert max(losses) - min(losses) <= 5e-2, losses  # same model and batches (bf16 on GPU)
    assert re.search(r"^  fused \(grouped_mlp\) .* speedup vs module loop", out, re.M), out
    return out


@pytest.mark.slow  # ~1 min on the loaded 2-core machine; default-tier twin: the skip test above
def test_moe_script_runs_on_one_cpu_rank() -> None:
    out = _one_rank("--steps", "1", "--warmup", "1", "--tiny", "--repeat", "1")
    assert "1 gloo rank(s), fp32 parameters" in out and "grouped='auto' runs 'fused'" in out


@pytest.mark.gpu
def test_moe_script_runs_on_one_gpu() -> None:
    """The single-GPU row: NCCL, bf16 parameters, the replicated layouts, ep skipped."""
    out = _one_rank("--device", "cuda", "--steps", "2", "--warmup", "1", "--tiny", "--repeat", "2")
    assert "1 NCCL rank(s)" in out and "bf16 parameters" in out, out


def test_grouped_benchmark_floor_computes_the_same_experts() -> None:
    """benchmarks/moe_grouped.py --floor: the kernels alone (no autograd) and the fused node
    alone compute the experts' output (measure() checks them against the module loop the
    same way before timing)."""
    torch.manual_seed(0)
    template = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    experts = Experts(template, 4, grouped="loop", reinit=True)
    counts = [5, 0, 11, 2]
    x = torch.randn(sum(counts), 16)
    ref = experts(x, counts)
    p = dict(experts.expert.named_parameters())
    weights = (p["0.weight"], p["0.bias"], p["2.weight"], p["2.bias"])
    torch.testing.assert_close(moe_grouped._kernels_alone(x, counts, *weights)(), ref)
    torch.testing.assert_close(moe_grouped._node_alone(x, counts, *weights)(), ref)
