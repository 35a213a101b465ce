"""ZeRO++ (qwZ, qgZ) against plain ZeRO-3: bytes on the wire per step and convergence.

Run from the repository root (4 gloo ranks on CPU)::

    torchrun --standalone --nproc_per_node=4 benchmarks/zeropp.py --steps 300 \
        --seeds 0,1,2 --cases zero3,qwz,qwz_qgz

On GPUs (NCCL, one GPU per rank; any number of ranks, step time for information)::

    torchrun --standalone --nproc_per_node=N benchmarks/zeropp.py --device cuda \
        --steps 50 --val-batches 4 --cases zero3,qgz,qwz_qgz

Every case trains the example GPT (fsdpx/demo/gpt.py, its default small config) through
``fsdpx.shard`` at ZeRO stage 3 with bf16 compute and fp32 gradient reduction, on the
same batches (the standard library's source, the last 10% held out), once per
initialisation seed (``--seeds``):

* ``zero3``: plain ZeRO-3 (bf16 all-gather, fp32 reduce-scatter);
* ``qwz``: + ``zero.quantized_weights`` (int8 all-gather);
* ``qwz_qgz``: + ``zero.quantized_gradients`` (int8 all-to-all reduction);
* ``qwz_qgz4``: the same with int4 gradients;
* ``qgz`` (only when named in ``--cases``): qgZ int8 alone.

Bytes are what rank 0 sends, counted by fsdpx.comm at each collective call (formulas in
fsdpx/comm/counted.py and fsdpx/comm/fsdp_slot.py), per step and per kind; the table gives
each kind's ratio to the first case's. The validation loss is the cross-entropy of the
fp32 logits over ``--val-batches`` fixed held-out batches after the last step (the
model's own loss is a bf16 scalar, whose ulp near 2.3 is 0.7% of it), averaged over
the seeds; the ratio is of those means. The train-loss curves (mean per window of steps
and over seeds) are printed as a text plot. The last line is JSON.

[Note: why several seeds] One seed cannot decide "within 1%": the quantized runs
leave the unquantized trajectory within the first 25 steps (the quantization noise is
unbiased: mean error ~1e-7 on the initial weights of ~0.02, no shrinkage) and the final
validation loss then lands 1.8% below or 0.8% above the unquantized one depending on the
seed. Measured (2 shared CPU cores, 4 gloo ranks, 300 steps, GPT 875,264 parameters,
global batch 16, lr 1e-3, block size 256; seeds 0,1 and 2 run as two invocations, each
seed's runs are deterministic); bytes per step sent by rank 0:

| case     | all-gather bytes    | reduction bytes     | val loss, seeds 0 / 1 / 2 | mean   | ratio  |
|----------|---------------------|---------------------|---------------------------|--------|--------|
| zero3    | 2,502,528 (1.000x)  | 2,625,792 (1.000x)  | 2.3408 / 2.3442 / 2.2793  | 2.3214 | 1.0000 |
| qwz      | 1,270,860 (0.508x)  | 2,625,792 (1.000x)  | 2.3049 / 2.3535 / 2.2853  | 2.3146 | 0.9970 |
| qwz_qgz  | 1,270,860 (0.508x)  |   666,732 (0.254x)  | 2.2991 / 2.3623 / 2.2851  | 2.3155 | 0.9975 |
| qwz_qgz4 | 1,270,860 (0.508x)  |   338,508 (0.129x)  | (bytes from a 2-step run) |        |        |

Train-loss curve (mean per 25 steps over the three seeds)::

    steps           zero3       qwz   qwz_qgz
       1-25        3.7168    3.6997    3.7020
      76-100       2.6118    2.5978    2.5815
     151-175       2.4477    2.4345    2.4290
     276-300       2.3032    2.2907    2.2853

The quantized runs' three-seed mean train loss is 0.3-1.4% below unquantized in every
25-step window, yet their final validation loss is not below it for every seed (seed 1
ends 0.4-0.8% above); the cause of that train-loss lead is not established. Step times on CPU are for information only (gloo,
a loaded machine: 0.4-0.8 s/step, quantizing costs CPU work there and saves nothing since
the "wire" is shared memory). tests/test_zeropp_slow.py runs the 300-step setting;
tests/test_zeropp.py's smoke test runs ``--small`` for one step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import fsdpx
from fsdpx.comm import comm_log
from fsdpx.demo.gpt import GPT, GPTConfig, batches, shard_batch, stdlib_corpus

CASES: dict[str, dict[str, Any]] = {
    "zero3": {},
    "qwz": {"quantized_weights": True},
    "qwz_qgz": {"quantized_weights": True, "quantized_gradients": True},
    "qwz_qgz4": {
        "quantized_weights": True,
        "quantized_gradients": True,
        "quantized_gradients_bits": 4,
    },
    # Not in the default --cases: qgZ alone (unquantized weight all-gathers).
    "qgz": {"quantized_gradients": True},
}
DEFAULT_CASES = ("zero3", "qwz", "qwz_qgz", "qwz_qgz4")
KINDS = ("all_gather_single", "reduce_scatter", "all_to_all_single", "all_reduce")


def train(
    zero: dict[str, Any],
    *,
    steps: int,
    batch: int,
    lr: float,
    val_batches: int,
    model_cfg: GPTConfig,
    seed: int = 0,
    device: str = "cpu",
) -> dict[str, Any]:
    """One run: ``seed`` seeds the model's initialisation only (the batches are the same
    for every seed), so runs differ from each other by the trajectory alone."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = fsdpx.Config.from_dict(
        {
            "device": device,
            "zero": {"stage": 3, **zero},
            "optimizer": {"lr": lr, "weight_decay": 0.0},
            "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
        }
    )
    torch.manual_seed(seed)
    engine = fsdpx.shard(GPT(model_cfg), cfg)
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else None
    data = stdlib_corpus()
    split = data.numel() * 9 // 10
    train_it = batches(data[:split], batch, model_cfg.block_size, generator=_gen(1))
    per_step: list[dict[str, int]] = []
    losses: list[float] = []
    step_seconds: list[float] = []
    for _ in range(steps):
        x, y = next(train_it)
        x, y = shard_batch(x, rank, world), shard_batch(y, rank, world)
        if dev is not None:
            x, y = x.to(dev), y.to(dev)
        _sync(dev)
        start = time.perf_counter()
        before = comm_log().totals()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        _sync(dev)
        step_seconds.append(time.perf_counter() - start)
        after = comm_log().totals()
        per_step.append({k: after[k] - before[k] for k in KINDS})
        losses.append(float(engine.all_reduce_mean(loss.detach().float())))
    val_it = batches(data[split:], batch, model_cfg.block_size, generator=_gen(2))
    engine.module.eval()
    total = 0.0
    with torch.no_grad():
        for _ in range(val_batches):
            x, y = next(val_it)
            x, y = shard_batch(x, rank, world), shard_batch(y, rank, world)
            if dev is not None:
                x, y = x.to(dev), y.to(dev)
            # [Note: validation loss in fp32] The model's own loss is a bf16 scalar (ulp
            # 2**-6 near 2.3, 0.7% of it): cross-entropy of the fp32 logits instead.
            logits = engine(x).float()
            mine = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
            total += float(engine.all_reduce_mean(mine))
    params = sum(p.numel() for p in engine.module.parameters())
    engine.close()
    # The first step builds kernels and buffers: the median of the rest is the step time.
    timed = step_seconds[1:] or step_seconds
    return {
        "val_loss": total / val_batches,
        "train_losses": losses,
        "bytes_per_step": {k: max(s[k] for s in per_step) for k in KINDS},
        "seconds_per_step": statistics.median(timed),
        "params": params,
    }


def _sync(dev: torch.device | None) -> None:
    if dev is not None:
        torch.cuda.synchronize(dev)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def text_plot(curves: dict[str, list[float]], window: int) -> str:
    """Mean train loss per window of steps, one column per case."""
    names = list(curves)
    n = len(next(iter(curves.values())))
    lines = ["steps      " + "".join(f"{name:>10}" for name in names)]
    for lo in range(0, n, window):
        hi = min(n, lo + window)
        row = "".join(f"{sum(curves[c][lo:hi]) / (hi - lo):>10.4f}" for c in names)
        lines.append(f"{lo + 1:>4}-{hi:<5} {row}")
    return "\n".join(lines)


def _ratio(x: int, base: int) -> float:
    """x / base; NaN when the baseline sent nothing (one rank: no peer to send to)."""
    return x / base if base else float("nan")


def _mean_curve(runs: list[dict[str, Any]]) -> list[float]:
    return [statistics.fmean(c) for c in zip(*(r["train_losses"] for r in runs), strict=True)]


def report(runs: dict[str, list[dict[str, Any]]], seeds: list[int], steps: int) -> dict[str, Any]:
    """Print the table and the text plot on rank 0; return the JSON result."""
    names = list(runs)
    base = runs[names[0]]
    base_val = statistics.fmean(r["val_loss"] for r in base)
    base_ag = base[0]["bytes_per_step"]["all_gather_single"]
    base_red = base[0]["bytes_per_step"]["reduce_scatter"]
    result: dict[str, Any] = {
        "world_size": dist.get_world_size(),
        "steps": steps,
        "seeds": seeds,
        "params": base[0]["params"],
    }
    print(
        f"bytes sent per step by rank 0 (ratio to {names[0]}), val loss (mean over seeds "
        f"{seeds}; ratio of means), median s/step"
    )
    for name, seed_runs in runs.items():
        sent = seed_runs[0]["bytes_per_step"]  # the same for every seed
        ag = sent["all_gather_single"]
        red = sent["reduce_scatter"] + sent["all_to_all_single"]
        vals = [r["val_loss"] for r in seed_runs]
        row = {
            "all_gather_bytes": ag,
            "all_gather_ratio": _ratio(ag, base_ag),
            "reduction_bytes": red,
            "reduction_ratio": _ratio(red, base_red),
            "val_loss": statistics.fmean(vals),
            "val_losses": vals,
            "val_loss_ratio": statistics.fmean(vals) / base_val,
            "seconds_per_step": statistics.fmean(r["seconds_per_step"] for r in seed_runs),
        }
        result[name] = row
        per_seed = " ".join(f"{v:.4f}" for v in vals)
        print(
            f"{name:>9}: all-gather {ag:>9} ({row['all_gather_ratio']:.3f}x)  reduction "
            f"{red:>9} ({row['reduction_ratio']:.3f}x)  val loss {row['val_loss']:.4f} "
            f"({row['val_loss_ratio']:.4f}x; per seed {per_seed})  "
            f"{row['seconds_per_step']:.3f} s/step"
        )
    print("train loss, mean over seeds:")
    print(text_plot({n: _mean_curve(r) for n, r in runs.items()}, max(1, steps // 12)))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16, help="global batch per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--val-batches", type=int, default=64)
    ap.add_argument(
        "--cases",
        default=",".join(DEFAULT_CASES),
        help=f"comma-separated, the first is the baseline; of {', '.join(CASES)}",
    )
    ap.add_argument(
        "--seeds", default="0", help="comma-separated initialisation seeds; every case runs each"
    )
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu: gloo; cuda: NCCL, one GPU per rank (LOCAL_RANK)",
    )
    ap.add_argument(
        "--small", action="store_true", help="a 2-layer, 32-wide GPT (the smoke test's)"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    # fsdpx.shard starts the default group (gloo, or NCCL + gloo on CUDA) from the config.
    fsdpx.init_distributed(fsdpx.Config.from_dict({"device": args.device}))
    names = args.cases.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    model_cfg = (
        GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=32) if args.small else GPTConfig()
    )
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for seed in seeds:
        for name in names:
            run = train(
                CASES[name],
                steps=args.steps,
                batch=args.batch,
                lr=args.lr,
                val_batches=args.val_batches,
                model_cfg=model_cfg,
                seed=seed,
                device=args.device,
            )
            runs[name].append(run)
            if dist.get_rank() == 0:  # one line per run as it ends: a killed run keeps these
                print(
                    f"run {name} seed {seed}: val loss {run['val_loss']:.4f}, "
                    f"{run['seconds_per_step']:.3f} s/step",
                    flush=True,
                )
    if dist.get_rank() == 0:
        print(json.dumps(report(runs, seeds, args.steps)))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
