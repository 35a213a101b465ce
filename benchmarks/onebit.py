"""1-bit Adam (or 0/1 Adam, 1-bit Lamb: --optimizer) against Adam: final validation loss and
communication bytes per step.

Run from the repository root (4 gloo ranks on CPU, DESIGN Round 2 clarification 13)::

    torchrun --standalone --nproc_per_node=4 benchmarks/onebit.py --steps 400 --freeze-step 80

Both runs train the example GPT (fsdpx/demo/gpt.py, its default small config) through
``fsdpx.shard`` at ZeRO stage 0 from the same seed on the same batches (the standard
library's source, the last 10% held out): one with ``optimizer.type = "adamw"`` (weight
decay 0, i.e. Adam), one with ``"onebit_adam"`` and ``freeze_step`` full-precision warmup
steps (at most 20% of the run). The validation loss is the mean over fixed held-out batches
after the last step.

Bytes are counted by fsdpx.comm at the collective calls, per optimizer step, on rank 0
(formulas in fsdpx/comm/counted.py): during 1-bit Adam's warmup every gradient is
all-reduced in fp32 through fsdpx.comm, which is exactly the all-reduce Adam's run makes
(FSDP2's own replicate all-reduce there is not routed through fsdpx.comm, so the script
also prints that all-reduce by the same formula, 2 (W-1)/W * 4 * parameters, as a check);
after the freeze phase only the compressed exchange remains. The last line is JSON.

Results on 2 shared CPU cores, 4 ranks (GPT 875,264 parameters, global batch 16, lr 1e-3):

| steps / freeze_step | Adam val loss | 1-bit Adam val loss | ratio  | bytes/step after freeze |
|---------------------|---------------|---------------------|--------|-------------------------|
| 400 / 80            | 2.2393        | 2.2468              | 1.0034 | 165,768 vs 5,251,584 (1/31.7) |
| 200 / 40            | 2.4662        | 2.4964              | 1.0122 | 165,768 vs 5,251,584 (1/31.7) |

At 200 steps the 40-step warmup leaves the frozen variance too rough for the 1% bound;
tests/test_onebit_convergence.py runs the 400-step setting (the default).

The other two, 400 / 80, same machine and data (one run each; Adam's 2.2393 reproduces to
the last digit). "DeepSpeed's update" is fsdpx's optimizer with ``bias_correction: false``,
which is the update DeepSpeed 0.14-0.16's OnebitAdam / ZeroOneAdam / OnebitLamb computed
whatever their flag said (0.19.8 no longer ships them, so DeepSpeed itself could not be run
side by side):

| optimizer (settings)                                         | val loss | / Adam |
|--------------------------------------------------------------|----------|--------|
| 1-bit Adam, DeepSpeed's update (bias_correction false)       | 2.8417   | 1.2691 |
| 0/1 Adam, DeepSpeed's update (var_update_scaler 16, local_step_scaler 64, clipper 4) | 2.8457 | 1.2708 |
| 0/1 Adam, corrected, same settings                           | 2.2825   | 1.0193 |
| 0/1 Adam, corrected, var_update_scaler 16, no local steps (DeepSpeed's local_step_scaler 32678) | 2.2655 | 1.0117 |
| 0/1 Adam, corrected, var_update_scaler 32, no local steps    | 2.2471   | 1.0035 |
| Lamb (fsdpx.lamb, uncompressed), lr 1e-3                     | 3.8146   | 1.7035 |
| Lamb (fsdpx.lamb, uncompressed), lr 1e-2                     | 2.3479   | 1.0485 |
| 1-bit Lamb (DeepSpeed's update, its coeff/factor defaults), lr 1e-3 | 2.7729 | 1.2383 |
| 1-bit Lamb, same, lr 1e-2 (--onebit-lr 1e-2)                 | 2.1455   | 0.9581 |

The 1.27x of 0/1 Adam was not its compression: 1-bit Adam without bias correction ends at
the same 1.27x. The variance an optimizer freezes after k updates is (1 - 0.999^k) of the
gradients' mean square; uncorrected, every later step is 1 / sqrt(that) times Adam's (3.6x
for 1-bit Adam's 80 updates, 5x for 0/1 Adam's 40: [Note: 0/1 Adam's bias correction] in
fsdpx/zero_one_adam.py). DeepSpeed's configs freeze after tens of thousands of steps, where
that factor is 1. With the correction (fsdpx's default) 0/1 Adam comes within 1.2-1.9%;
what is left is its sparser variance (40 updates before the freeze instead of 80) and the
compressed gradients between them: with var_update_scaler 32 (56 updates) it is within
0.35%, the setting tests/test_onebit_convergence.py runs. In DeepSpeed's terms: a run this
short needs var_update_scaler large enough that most steps up to var_freeze_step update
the variance (56 of 80 here, 40 of 80 with 16). Compared step by step with DeepSpeed
0.16's zoadam.py, the 1.0117x at its defaults is not a deviation: the same 40 variance
steps, compressed gradients between them, error buffers reset at the freeze, and with
local_step_scaler 32678 a synchronisation after every step (README, Measured). The 1.24x of 1-bit
Lamb was its lr: Lamb's trust ratio sets each step to about lr * ||w|| per tensor, and at
lr 1e-3 plain, uncompressed Lamb is further behind (1.70x); at lr 1e-2 1-bit Lamb ends
below Adam's loss. Adam itself was run at lr 1e-3 only. Bytes/step after the freeze:
165,768 for 1-bit and 0/1 Adam, 164,136 for 1-bit Lamb, against 5,251,584 (1/31.7, 1/32.0).

``--trace PATH`` appends one JSON line per step of each run (benchmarks/onebit_trace.py:
loss, lr, phase, variance updates, sqrt(v_hat), update sizes). With it, 200 / 40, loaded
machine, each run reproduced to the last digit (README, Measured -> 1-bit optimizers,
has what the traces show):

| run (200 steps, freeze 40)                             | val loss | / Adam |
|--------------------------------------------------------|----------|--------|
| Adam                                                   | 2.4662   | 1      |
| 1-bit Adam                                             | 2.4964   | 1.0122 |
| 1-bit Adam, --onebit-lr 9.12e-4                        | 2.4538   | 0.9950 |
| 1-bit Adam, --onebit-eps 1e-5                          | 2.4836   | 1.0070 |
| 0/1 Adam, var_update_scaler 16                         | 2.5094   | 1.0175 |
| 0/1 Adam, var_update_scaler 16, --onebit-eps 1e-5      | 2.5214   | 1.0224 |
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fsdpx
from fsdpx.comm import comm_log
from fsdpx.demo.gpt import GPT, GPTConfig, batches, shard_batch, stdlib_corpus

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.onebit_trace import StepTrace  # noqa: E402


def train(
    opt_cfg: dict[str, Any],
    *,
    steps: int,
    batch: int,
    lr: float,
    val_batches: int,
    trace: str | None = None,
) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = fsdpx.Config.from_dict({"zero": {"stage": 0}, "optimizer": {"lr": lr, **opt_cfg}})
    torch.manual_seed(0)
    model_cfg = GPTConfig()
    engine = fsdpx.shard(GPT(model_cfg), cfg)
    data = stdlib_corpus()
    split = data.numel() * 9 // 10
    train_it = batches(data[:split], batch, model_cfg.block_size, generator=_gen(1))
    per_step: list[int] = []
    losses: list[float] = []
    tracer = None
    if trace is not None:
        named = list(engine.module.named_parameters())
        tracer = StepTrace(str(opt_cfg["type"]), engine.optimizer, named)
    start = time.perf_counter()
    for _ in range(steps):
        x, y = next(train_it)
        mark = comm_log().mark()
        loss = engine(shard_batch(x, rank, world), shard_batch(y, rank, world))
        engine.backward(loss)
        if tracer is not None:
            tracer.before_step()
        engine.step()
        if tracer is not None:
            tracer.after_step(loss)
        per_step.append(comm_log().bytes_since(mark))
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - start
    val_it = batches(data[split:], batch, model_cfg.block_size, generator=_gen(2))
    engine.module.eval()
    total = 0.0
    with torch.no_grad():
        for _ in range(val_batches):
            x, y = next(val_it)
            total += float(engine(x, y))
    params = sum(p.numel() for p in engine.module.parameters())
    if tracer is not None and trace is not None:
        tracer.write(trace)
    return {
        "val_loss": total / val_batches,
        "last_train_loss": losses[-1],
        "bytes_per_step": per_step,
        "params": params,
        "seconds": seconds,
    }


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def report_one(name: str, run: dict[str, Any], args: argparse.Namespace) -> None:
    """Prints one side's result (``--only``): its validation loss and bytes per step."""
    if dist.get_rank() != 0:
        return
    after = run["bytes_per_step"][args.freeze_step :]
    result = {
        "optimizer": name,
        "steps": args.steps,
        "freeze_step": args.freeze_step,
        "var_update_scaler": args.var_update_scaler,
        "val_loss": run["val_loss"],
        "max_bytes_per_step_after_freeze": max(after),
        "seconds": run["seconds"],
    }
    print(f"{name} final validation loss {run['val_loss']:.4f}")
    print(json.dumps(result))


def _note_variance_sampling(freeze_step: int, scaler: int) -> None:
    """Say how evenly 0/1 Adam's variance samples the warmup (README, Measured -> 1-bit
    optimizers: the frozen v_hat is the mean of its samples, and the doubling interval puts
    `scaler` of them in the first `scaler` steps, where the gradients are largest)."""
    interval, counter, samples, doublings = 1, 0, 0, 0
    for t in range(1, freeze_step + 1):
        if t % interval == 0:
            samples, counter = samples + 1, counter + 1
            if counter == scaler and t < freeze_step:  # a doubling at the last step does nothing
                interval, counter, doublings = 2 * interval, 0, doublings + 1
    line = (
        f"0/1 Adam: {samples} variance samples in {freeze_step} warmup steps, "
        f"{min(scaler, freeze_step)} of them in the first {min(scaler, freeze_step)}; "
        f"the interval doubles {doublings} times"
    )
    if 3 * scaler < freeze_step:  # the second doubling, at step 3 * scaler, is in the warmup
        line += (
            f" (more than once: the frozen variance over-weights the first steps; "
            f"--var-update-scaler {-(-freeze_step // 3)} or more doubles it at most once)"
        )
    print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--freeze-step", type=int, default=80)
    ap.add_argument("--batch", type=int, default=16, help="global batch per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--val-batches", type=int, default=16)
    ap.add_argument(
        "--optimizer",
        choices=["onebit_adam", "zero_one_adam", "onebit_lamb"],
        default="onebit_adam",
        help="zero_one_adam: 0/1 Adam with var_freeze_step = --freeze-step, variance interval "
        "doubling every --var-update-scaler variance steps, local-step interval doubling "
        "every --local-step-scaler steps up to 4; onebit_lamb: 1-bit Lamb with freeze_step = "
        "--freeze-step",
    )
    ap.add_argument(
        "--local-step-scaler",
        type=int,
        default=32678,
        help="zero_one_adam: steps between doublings of the local-step interval (DeepSpeed's "
        "default 32678: no local steps in a short run)",
    )
    ap.add_argument(
        "--var-update-scaler",
        type=int,
        default=16,
        help="zero_one_adam: variance steps between doublings of the variance interval",
    )
    ap.add_argument(
        "--onebit-lr",
        type=float,
        default=None,
        help="the compressed optimizer's lr (default --lr); Lamb's trust ratio scales each "
        "step to the weights' norm, so Adam's lr is not Lamb's",
    )
    ap.add_argument(
        "--only",
        choices=["adam", "compressed"],
        default=None,
        help="train only one side and print its validation loss (JSON), so the two sides can "
        "run at once on separate cores; the ratio is then taken by hand",
    )
    ap.add_argument(
        "--onebit-eps",
        type=float,
        default=None,
        help="the compressed optimizer's eps (default: the optimizer's, 1e-8 as Adam's run): "
        "a larger eps bounds the steps of elements whose frozen variance is tiny",
    )
    ap.add_argument(
        "--trace",
        default=None,
        help="append a JSON line per step of each run to this file (rank 0): loss, lr, "
        "phase, variance updates, mean sqrt(v_hat), update RMS (benchmarks/onebit_trace.py)",
    )
    args = ap.parse_args()
    if args.freeze_step > args.steps // 5:
        raise SystemExit(
            f"--freeze-step {args.freeze_step} is more than 20% of --steps {args.steps}"
        )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if args.optimizer == "zero_one_adam" and dist.get_rank() == 0:
        _note_variance_sampling(args.freeze_step, args.var_update_scaler)
    common = dict(
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        val_batches=args.val_batches,
        trace=args.trace,
    )
    if args.only == "adam":
        adam = train({"type": "adamw", "weight_decay": 0.0}, **common)  # type: ignore[arg-type]
        report_one("adamw", adam, args)
        dist.destroy_process_group()
        return
    if args.only is None:
        adam = train({"type": "adamw", "weight_decay": 0.0}, **common)  # type: ignore[arg-type]
    opt_cfg: dict[str, Any] = {"type": "onebit_adam", "freeze_step": args.freeze_step}
    if args.optimizer == "zero_one_adam":
        opt_cfg = {
            "type": "zero_one_adam",
            "var_freeze_step": args.freeze_step,
            "var_update_scaler": args.var_update_scaler,
            "local_step_scaler": args.local_step_scaler,
            "local_step_clipper": 4,
        }
    if args.optimizer == "onebit_lamb":
        opt_cfg = {"type": "onebit_lamb", "bias_correction": False, "freeze_step": args.freeze_step}
    if args.onebit_lr is not None:
        common["lr"] = args.onebit_lr
    if args.onebit_eps is not None:
        opt_cfg["eps"] = args.onebit_eps
    onebit = train(opt_cfg, **common)  # type: ignore[arg-type]
    if args.only == "compressed":
        report_one(args.optimizer, onebit, args)
        dist.destroy_process_group()
        return
    if dist.get_rank() == 0:
        warm = onebit["bytes_per_step"][: args.freeze_step]
        after = onebit["bytes_per_step"][args.freeze_step :]
        fsdp_all_reduce = 2 * (world - 1) * 4 * adam["params"] // world
        result = {
            "world_size": world,
            "steps": args.steps,
            "freeze_step": args.freeze_step,
            "optimizer": args.optimizer,
            "onebit_lr": common["lr"],
            "onebit_eps": args.onebit_eps,
            "var_update_scaler": args.var_update_scaler,
            "params": adam["params"],
            "adam_val_loss": adam["val_loss"],
            "onebit_val_loss": onebit["val_loss"],
            "val_loss_ratio": onebit["val_loss"] / adam["val_loss"],
            "adam_all_reduce_bytes_per_step": max(warm),
            "adam_fsdp_all_reduce_bytes_by_formula": fsdp_all_reduce,
            "onebit_bytes_per_step_after_freeze": max(after),
            "bytes_ratio": max(after) / max(warm),
            "adam_seconds": adam["seconds"],
            "onebit_seconds": onebit["seconds"],
        }
        print(f"Adam      final validation loss {adam['val_loss']:.4f}")
        print(
            f"{args.optimizer} final validation loss {onebit['val_loss']:.4f}  (ratio "
            f"{result['val_loss_ratio']:.4f}; freeze_step {args.freeze_step} of {args.steps})"
        )
        print(
            f"bytes/step sent by rank 0: Adam all-reduce {max(warm)} (FSDP's by formula "
            f"{fsdp_all_reduce}), {args.optimizer} after freeze {max(after)} (ratio "
            f"1/{max(warm) / max(after):.1f})"
        )
        print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
