"""Step time and per-rank memory of each 3D layout (data x tensor x pipeline) on the
example GPT, against the pure-FSDP run of the same model and data.

Run from the repository root (4 gloo ranks on CPU)::

    torchrun --standalone --nproc_per_node=4 benchmarks/parallel3d.py --steps 6 --warmup 2

8 ranks (adds the dp2 x tp2 x pp2 layout)::

    torchrun --standalone --nproc_per_node=8 benchmarks/parallel3d.py --steps 6 --warmup 2

Smallest run::

    torchrun --standalone --nproc_per_node=4 benchmarks/parallel3d.py --steps 1 --warmup 1 --tiny

Every layout trains the same GPT (same seed) with `engine.train_batch` on the same global
batches (`--batch` sequences per micro-batch, split over the data-parallel ranks,
`--gas` micro-batches per step; the pipeline runs them as its micro-batches). A step is
timed on every rank after a barrier; its time is the slowest rank's; the table gives the
median step and its ratio to the FSDP run. Memory, per rank (max over ranks):

* params / grads / optimizer: bytes of the local shards (DTensor local tensors) of the
  parameters, of the gradients right before the optimizer step, and of the optimizer
  state, i.e. what each layout leaves on one rank;
* peak RSS: the process's resident-set high-water mark during the layout's steps (reset
  before each layout through /proc/self/clear_refs; it includes torch itself and the
  activations).

CPU/gloo timings say little about GPUs (no overlap of communication and compute, two
cores shared by all ranks); the memory split is what carries over.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

# Run as a script: the repository root on the path (this checkout's fsdpx and tests).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fsdpx  # noqa: E402
from fsdpx.demo.gpt import GPT, GPTConfig, shard_batch  # noqa: E402
from fsdpx.parallel_dims import ParallelDims  # noqa: E402

LAYOUTS_4: dict[str, dict[str, Any]] = {
    "fsdp_dp4": {},
    "dp2_tp2": {"mesh": {"tp": 2}},
    "dp2_tp2_sp": {"mesh": {"tp": 2}, "tensor_parallel": {"sequence_parallel": True}},
    "dp2_pp2_1f1b": {"mesh": {"pp": 2}},
    "dp2_pp2_zbv": {
        "mesh": {"pp": 2},
        "pipeline": {"schedule": "ZBVZeroBubble", "stages_per_rank": 2},
    },
    "tp2_pp2_1f1b": {"mesh": {"tp": 2, "pp": 2}},
    "pp4_1f1b": {"mesh": {"pp": 4}},
}
LAYOUTS_8: dict[str, dict[str, Any]] = {
    "fsdp_dp8": {},
    "dp4_tp2": {"mesh": {"tp": 2}},
    "dp4_pp2_1f1b": {"mesh": {"pp": 2}},
    "dp2_tp2_pp2_1f1b": {"mesh": {"tp": 2, "pp": 2}},
    "dp2_tp2_pp2_sp_interleaved": {
        "mesh": {"tp": 2, "pp": 2},
        "tensor_parallel": {"sequence_parallel": True},
        "pipeline": {"schedule": "Interleaved1F1B", "stages_per_rank": 2},
    },
}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="sequences per micro-batch (global)")
    p.add_argument("--gas", type=int, default=4, help="micro-batches per step")
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--tiny", action="store_true", help="a 4-block 64-wide model, seq 16")
    p.add_argument("--layouts", nargs="*", default=None, help="names from the table")
    return p.parse_args()


def _local_bytes(tensors: Iterator[torch.Tensor]) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (Linux >= 4.0)
    except OSError:
        pass


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _max(value: float) -> float:
    t = torch.tensor(float(value))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def run_layout(
    name: str, sections: dict[str, Any], args: argparse.Namespace, gcfg: GPTConfig
) -> dict[str, float]:
    cfg = fsdpx.Config.from_dict(
        {
            "gradient_accumulation_steps": args.gas,
            "optimizer": {"type": "adamw", "lr": 1e-4},
            **sections,
        }
    )
    torch.manual_seed(0)
    _reset_peak_rss()
    engine = fsdpx.shard(GPT(gcfg), cfg, loss_fn=lm_loss)
    dp_mesh = ParallelDims.dp_mesh(engine.mesh)
    dp_rank, dp = dp_mesh.get_local_rank(), dp_mesh.size()
    grad_bytes = [0]
    params = list(engine.parameters())

    def count_grads(opt: Any, a: Any, k: Any) -> None:
        grad_bytes[0] = _local_bytes(p.grad for p in params if p.grad is not None)

    engine.optimizer.register_step_pre_hook(count_grads)
    g = torch.Generator().manual_seed(1)
    times: list[float] = []
    losses: list[float] = []
    for step in range(args.warmup + args.steps):
        micro = []
        for _ in range(args.gas):
            x = torch.randint(0, gcfg.vocab_size, (args.batch, args.seq), generator=g)
            y = torch.randint(0, gcfg.vocab_size, (args.batch, args.seq), generator=g)
            micro.append((shard_batch(x, dp_rank, dp), shard_batch(y, dp_rank, dp)))
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine.train_batch(iter(micro))
        elapsed = _max(time.perf_counter() - t0)
        if step >= args.warmup:
            times.append(elapsed)
            losses.append(float(loss))
    state = engine.optimizer.state.values()
    opt_bytes = _local_bytes(
        t for s in state for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    out = {
        "step_s": statistics.median(times),
        "params": _max(_local_bytes(iter(params))),
        "grads": _max(grad_bytes[0]),
        "optim": _max(opt_bytes),
        "rss": _max(_peak_rss()),
        "loss": losses[-1],
    }
    return out


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    if args.tiny:
        args.n_layer, args.n_embd, args.seq = 4, 64, 16
    gcfg = GPTConfig(
        block_size=args.seq, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, bias=False
    )
    table = LAYOUTS_8 if world == 8 else LAYOUTS_4
    if world not in (4, 8):
        raise SystemExit(f"run with 4 or 8 ranks; got {world}")
    names = args.layouts or list(table)
    baseline = next(iter(table))
    if baseline not in names:
        names.insert(0, baseline)
    results = {n: run_layout(n, table[n], args, gcfg) for n in names}
    if dist.get_rank() == 0:
        n_params = sum(p.numel() for p in GPT(gcfg).parameters())
        print(
            f"GPT {gcfg.n_layer} blocks x {gcfg.n_embd} wide ({n_params / 1e6:.2f} M params), "
            f"{world} gloo ranks, micro-batch {args.batch} x {args.seq} tokens, "
            f"{args.gas} micro-batches/step, {args.steps} timed steps; cores: {os.cpu_count()}"
        )
        base = results[baseline]
        head = (
            f"{'layout':30s} {'step s':>7s} {'x fsdp':>7s} {'params MiB':>10s} {'grads MiB':>9s} "
        )
        print(head + f"{'optim MiB':>9s} {'states x fsdp':>13s} {'peak RSS MiB':>12s} {'loss':>7s}")
        for n, r in results.items():
            states = r["params"] + r["grads"] + r["optim"]
            base_states = base["params"] + base["grads"] + base["optim"]
            print(
                f"{n:30s} {r['step_s']:7.3f} {r['step_s'] / base['step_s']:7.2f} "
                f"{r['params'] / 2**20:10.2f} {r['grads'] / 2**20:9.2f} {r['optim'] / 2**20:9.2f} "
                f"{states / base_states:13.2f} {r['rss'] / 2**20:12.0f} {r['loss']:7.4f}"
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
