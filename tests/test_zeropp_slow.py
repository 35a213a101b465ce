"""Issue 20's heavier acceptance (slow tier): ZeRO++ composed with hpZ, HSDP, TP, activation
checkpointing, the two-level qgZ and CPU offload on 4 gloo ranks against the
single-process reference, and convergence of the example GPT (benchmarks/zeropp.py, 300
steps, 4 ranks, 3 seeds). Their default-tier twins are in
tests/test_zeropp.py (2-rank parity and bytes) and tests/test_zeropp_4ranks.py (the
4-rank hpZ payload check, qwZ under PP)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist import run_ranks
from tests.parity import make_model, reference_run
from tests.test_zeropp import _drift
from tests.zeropp_bodies import train_cases

ROOT = Path(__file__).resolve().parent.parent
BASE: dict[str, Any] = {"optimizer": {"lr": 1e-2}}
# name -> (config, data-parallel degree of the reference)
COMPOSED: dict[str, tuple[dict[str, Any], int]] = {
    "hpz_qwz": ({**BASE, "zero": {"hpz_partition_size": 2, "quantized_weights": True}}, 4),
    "hsdp_qgz": (
        {**BASE, "mesh": {"dp_replicate": 2, "dp_shard": 2}, "zero": {"quantized_gradients": True}},
        4,
    ),
    # tests/parity.fsdpx_run splits batches over all 4 ranks, not over the 2 data-parallel
    # ones, so TP's unquantized run is its reference (dp 0: compared with "tp2").
    "tp2": ({**BASE, "mesh": {"tp": 2}}, 0),
    "tp2_qwz": ({**BASE, "mesh": {"tp": 2}, "zero": {"quantized_weights": True}}, 0),
    "ac_qwz_qgz": (
        {
            **BASE,
            "activation_checkpointing": {"mode": "full"},
            "zero": {"quantized_weights": True, "quantized_gradients": True},
        },
        4,
    ),
    # Two-level qgZ on 4 ranks as 2 simulated nodes x 2 (measured: losses within 0.42% of
    # the reference, drift 0.32).
    "hier_qwz_qgz": (
        {
            **BASE,
            "zero": {
                "quantized_weights": True,
                "quantized_gradients": True,
                "quantized_gradients_hierarchical": True,
                "quantized_gradients_node_size": 2,
            },
        },
        4,
    ),
    "offload_qwz": (
        {
            **BASE,
            "zero": {
                "quantized_weights": True,
                "offload_optimizer": {"device": "cpu"},
                "offload_param": {"device": "cpu"},
            },
        },
        4,
    ),
}


@pytest.mark.slow
def test_zeropp_composes_with_hpz_hsdp_tp_ac_and_offload() -> None:
    """Losses within 1% of the reference each step; parameters no farther from the
    reference than half of how far the reference moved, over all tensors together (the
    2-rank twin's criterion)."""
    results = run_ranks(train_cases, 4, ({k: v[0] for k, v in COMPOSED.items()},))
    init = {n: p.detach() for n, p in make_model().named_parameters()}
    for name, (_, dp) in COMPOSED.items():
        if name == "tp2":
            continue
        if dp:
            ref_losses, ref_params = reference_run(BASE, dp)
        else:
            ref_losses, ref_params, _ = results[0]["tp2"]
        losses, params, sent = results[0][name]
        for a, b in zip(losses, ref_losses, strict=True):
            assert abs(a - b) <= 1e-2 * abs(b), (name, losses, ref_losses)
        assert _drift(params, ref_params, init) <= 0.5, name
        quantized = "all_to_all_single" if name == "hsdp_qgz" else "all_gather_single"
        assert sent[quantized] > 0, (name, sent)
    assert torch.equal(
        results[0]["hpz_qwz"][1]["wte.weight"], results[3]["hpz_qwz"][1]["wte.weight"]
    )


@pytest.mark.slow
def test_example_gpt_converges_with_qwz_and_qgz() -> None:
    """300 steps on 4 ranks, seeds 0, 1 and 2: qwZ and qwZ + qgZ (int8) end with a mean
    validation loss within 1% (either side) of unquantized ZeRO-3's; bytes at the
    collectives meet the issue's ratios.

    Over seeds, not one: one seed's final loss lands 1.8% below or 0.8% above unquantized
    depending on the seed (the trajectories part within the first 25 steps; [Note: why
    several seeds] in benchmarks/zeropp.py). Measured mean ratios 0.9970 (qwz) and 0.9975
    (qwz_qgz)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=4",
        str(ROOT / "benchmarks" / "zeropp.py"),
        "--steps",
        "300",
        "--seeds",
        "0,1,2",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=9000)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("qwz", "qwz_qgz"):
        assert abs(result[name]["val_loss_ratio"] - 1.0) <= 0.01, result
    assert result["qwz"]["all_gather_ratio"] <= 0.53
    assert result["qwz_qgz"]["reduction_ratio"] <= 0.3
    assert result["qwz_qgz4"]["reduction_ratio"] <= 0.17
