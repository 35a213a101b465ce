"""Generate tests/data/deepspeed_lamb_0.19.8.json: DeepSpeed's own Lamb numbers.

Run once, in a SEPARATE environment that has DeepSpeed installed (never fsdpx's own: fsdpx
and its tests must not import deepspeed)::

    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python scripts/gen_lamb_fixture.py \
        tests/data/deepspeed_lamb_0.19.8.json

DeepSpeed's FusedLamb (deepspeed/ops/lamb/fused_lamb.py) calls a kernel `lamb(p, p_copy, m,
v, grad, lr, beta1, beta2, max_coeff, min_coeff, eps, combined_scale, step, eps_mode,
bias_correction, weight_decay)` once per parameter. Its CUDA kernel needs a GPU; 0.19.8 also
ships the same kernel in pure torch (deepspeed/ops/op_builder/npu/fused_lamb.py,
NPUFusedLamb.lamb), which runs on CPU. This script drives that torch kernel exactly as
FusedLamb.step does (state step counted per parameter from 1, combined_scale 1) over a few
steps of seeded random gradients, for several option sets, and writes the inputs, the
per-step trust ratios and the final params and moments. tests/test_ops_lamb.py replays the
inputs through fsdpx's Lamb and compares.
"""

from __future__ import annotations

import json
import sys

import deepspeed
import torch
from deepspeed.ops.op_builder.npu.fused_lamb import NPUFusedLamb

CASES = [
    dict(
        lr=1e-2,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.01,
        bias_correction=True,
        max_coeff=10.0,
        min_coeff=0.01,
        eps_inside_sqrt=False,
    ),
    dict(
        lr=5e-3,
        betas=(0.8, 0.99),
        eps=1e-6,
        weight_decay=0.0,
        bias_correction=False,
        max_coeff=10.0,
        min_coeff=0.01,
        eps_inside_sqrt=True,
    ),
    # Small clamps, so the trust ratio hits max_coeff / min_coeff.
    dict(
        lr=1e-2,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.1,
        bias_correction=True,
        max_coeff=0.28,
        min_coeff=0.2,
        eps_inside_sqrt=False,
    ),
]
SHAPES = [[7, 5], [33], [4]]  # the last starts at zero: ||p|| = 0 gives a trust ratio of 1
STEPS = 4


def run(case: dict, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    params[-1].zero_()
    scales = [1.0, 10.0, 0.01]
    grads = [
        [torch.randn(s, generator=gen) * scales[i] for i, s in enumerate(SHAPES)]
        for _ in range(STEPS)
    ]
    init = [p.clone() for p in params]
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    coeffs = []
    beta1, beta2 = case["betas"]
    for step in range(1, STEPS + 1):
        row = []
        for i, p in enumerate(params):
            c = NPUFusedLamb.lamb(
                p,
                torch.tensor([], dtype=torch.float),
                ms[i],
                vs[i],
                grads[step - 1][i],
                case["lr"],
                beta1,
                beta2,
                case["max_coeff"],
                case["min_coeff"],
                case["eps"],
                1.0,
                step,
                0 if case["eps_inside_sqrt"] else 1,
                1 if case["bias_correction"] else 0,
                case["weight_decay"],
            )
            row.append(float(c))
        coeffs.append(row)
    return {
        "options": {**case, "betas": list(case["betas"])},
        "shapes": SHAPES,
        "init": [p.flatten().tolist() for p in init],
        "grads": [[g.flatten().tolist() for g in gs] for gs in grads],
        "coeffs": coeffs,
        "params": [p.flatten().tolist() for p in params],
        "exp_avgs": [m.flatten().tolist() for m in ms],
        "exp_avg_sqs": [v.flatten().tolist() for v in vs],
    }


def main(out: str) -> None:
    torch.manual_seed(0)
    data = {
        "deepspeed": deepspeed.__version__,
        "kernel": "NPUFusedLamb.lamb (pure torch)",
        "cases": [run(c, seed) for seed, c in enumerate(CASES)],
    }
    with open(out, "w") as f:
        json.dump(data, f)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
