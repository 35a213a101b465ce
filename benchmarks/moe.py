"""Mixture of experts on 4 CPU ranks: replicated experts under FSDP vs expert parallelism
(ep = 2, ep = 4), the dispatch all-to-all bytes against their formula, and grouped expert
compute against a per-expert loop.

Run from the repository root (4 gloo ranks)::

    torchrun --standalone --nproc_per_node=4 benchmarks/moe.py --steps 6 --warmup 2

Smallest run (the smoke test's)::

    torchrun --standalone --nproc_per_node=4 benchmarks/moe.py --steps 1 --warmup 1 --tiny

On GPUs (NCCL, one GPU per rank, bf16 parameters with fp32 reductions by default)::

    torchrun --standalone --nproc_per_node=1 benchmarks/moe.py --device cuda --steps 20 --warmup 3

Any world size runs: a layout whose mesh.ep does not divide it (ep2 / ep4 on one GPU) is
skipped with the reason printed, so one GPU gives the replicated rows (step time and
per-rank model-state bytes; nothing is gathered or sent at one rank).

The model is a small MoE GPT: token embedding, `--layers` blocks of causal attention and
an `fsdpx.moe.MoE` (8 experts, dropless top-2, GELU MLP experts), a head; loss = cross
entropy + 0.01 * the summed load-balancing losses. Every layout trains it from the same
seed on the same batches (`--batch` sequences per rank) at ZeRO-3 with AdamW:

- `replicated`: mesh.ep = 1, every rank computes all 8 experts; FSDP shards the experts
  over all 4 ranks like any weight (gathered whole for each layer);
- `replicated_padded`: the same with `grouped="padded"` (one batched matmul per expert
  layer over tokens padded to the busiest expert) instead of the sorted per-expert loop;
- `replicated_grouped_mm`: the same with `grouped="grouped_mm"` (one torch._grouped_mm
  per expert Linear over all experts' rows);
- `replicated_fused`: the same with `grouped="fused"` (fsdpx/moe/grouped_mlp.py: one
  autograd node for all local experts; the default "auto" picks it for these experts);
- `ep2`, `ep4`: mesh.ep = 2 / 4, each rank owns 4 / 2 experts, tokens travel by
  all_to_all, experts are FSDP-sharded over the remaining 2 / 1 ranks.

Per layout: the median step (slowest rank, after a barrier; the layouts' steps
interleaved round by round on the same batches) and its ratio to `replicated`; per-rank model-state bytes (local shards of parameters, gradients at the
optimizer step and AdamW state, max over ranks) with the experts' share, and the
estimator's figure for the same (`fsdpx.estimate_memory`); bytes sent per step by FSDP's
all-gathers (the expert weights every rank gathers; with the estimator's
`comm_volume(...).all_gather`) and by the dispatch all-to-alls,
measured through fsdpx's comm layer, next to the estimator's even-routing formula
(`fsdpx.estimate_comm.comm_volume(..., tokens_per_micro_step=)`: (ep-1)/ep * (8 E + 4 T k
d c) per layer and micro-step) and the measured / formula ratio; the final loss (the same
model and data: the layouts agree up to reduction order).

Then rank 0 times the expert compute alone at 8 local experts (benchmarks/moe_grouped.py's
measure(): per-expert module loop, fsdpx's sorted loop, padded bmm, fused and grouped_mm;
on CUDA in the run's dtype, wall time) while the other ranks wait, the issue's
grouped-vs-loop comparison (goal >= 1.5x). The header says what `grouped="auto"` picks for
these experts on this device ([Note: auto grouped choice]). CPU/gloo timings say little
about GPUs (two cores shared by four ranks, no overlap).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

# Run as a script: the repository root on the path (this checkout's fsdpx and benchmarks).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fsdpx  # noqa: E402
from benchmarks.moe_grouped import DTYPES, measure  # noqa: E402
from fsdpx.comm import comm_log  # noqa: E402
from fsdpx.estimate import estimate_memory  # noqa: E402
from fsdpx.estimate_comm import comm_volume  # noqa: E402
from fsdpx.moe import MoE  # noqa: E402
from fsdpx.moe.auto_grouped import choose_grouped, grouped_mm_kernel  # noqa: E402
from fsdpx.moe.experts import Grouped  # noqa: E402
from fsdpx.parallel_dims import ParallelDims  # noqa: E402

EXPERTS, TOP_K, AUX = 8, 2, 0.01
LAYOUTS: dict[str, tuple[int, Grouped]] = {  # name -> (mesh.ep, grouped)
    "replicated": (1, "loop"),
    "replicated_padded": (1, "padded"),
    "replicated_grouped_mm": (1, "grouped_mm"),
    "replicated_fused": (1, "fused"),
    "ep2": (2, "loop"),
    "ep4": (4, "loop"),
}


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int, ep: int, grouped: Grouped) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        expert = nn.Sequential(nn.Linear(d, ffn), nn.GELU(), nn.Linear(ffn, d))
        self.moe = MoE(
            d, expert, EXPERTS, ep_size=ep, k=TOP_K, capacity_factor=None, grouped=grouped
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        out, l_aux, _ = self.moe(self.ln2(x))
        return x + out, l_aux


class MoEGPT(nn.Module):
    def __init__(self, args: argparse.Namespace, ep: int, grouped: Grouped) -> None:
        super().__init__()
        d = args.hidden
        self.emb = nn.Embedding(args.vocab, d)
        self.blocks = nn.ModuleList(
            [Block(d, 4, args.ffn, ep, grouped) for _ in range(args.layers)]
        )
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, args.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.emb(idx)
        aux = torch.zeros((), device=h.device)
        for block in self.blocks:
            h, l_aux = block(h)
            aux = aux + l_aux
        return self.head(self.ln(h)), aux


def loss_fn(outputs: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    logits, aux = outputs
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + AUX * aux


def _local_bytes(named: Sequence[tuple[str, torch.Tensor]], experts: bool | None = None) -> int:
    total = 0
    for name, t in named:
        if experts is not None and ("experts" in name) != experts:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def skipped(names: list[str], world: int) -> dict[str, str]:
    """The layouts of `names` that cannot run at this world size (or torch build), each with
    the reason; the rest run."""
    out: dict[str, str] = {}
    for name in names:
        ep, grouped = LAYOUTS[name]
        if world % ep:
            out[name] = (
                f"mesh.ep = {ep} must divide the world size, which is {world}: run with a "
                f"multiple of {ep} ranks (4 runs every layout)"
            )
        elif grouped == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
            out[name] = f"torch {torch.__version__} has no torch._grouped_mm"
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max(value: float) -> float:
    t = torch.tensor(float(value))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


class Layout:
    """One layout's engine and what its steps measured; `step` runs one optimizer step."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        ep, grouped = LAYOUTS[name]
        sections: dict[str, Any] = {
            "device": args.device,
            "mesh": {"ep": ep},
            "zero": {"stage": 3},
            "optimizer": {"type": "adamw", "lr": 1e-3},
        }
        if args.dtype == "bf16":
            sections["precision"] = {"param_dtype": "bf16", "reduce_dtype": "fp32"}
        cfg = fsdpx.Config.from_dict(sections)
        torch.manual_seed(0)
        model = MoEGPT(args, ep, grouped)
        world = dist.get_world_size()
        self.args = args
        self.estimate = estimate_memory(model, cfg, world)
        self.volume = comm_volume(model, cfg, world, tokens_per_micro_step=args.batch * args.seq)
        self.engine = fsdpx.shard(model, cfg, loss_fn=loss_fn)
        self.device = torch.device(self.engine.device)
        self.dp_rank = ParallelDims.dp_mesh(self.engine.mesh).get_local_rank()
        self.named = list(self.engine.module.named_parameters())
        self.grads: dict[str, int] = {}
        self.engine.optimizer.register_step_pre_hook(self._count_grads)
        self.times: list[float] = []
        self.a2a: list[int] = []
        self.gathered: list[int] = []
        self.loss = 0.0

    def _count_grads(self, opt: Any, a: Any, k: Any) -> None:
        with_grad = [(n, p.grad) for n, p in self.named if p.grad is not None]
        self.grads["all"] = _local_bytes(with_grad)
        self.grads["experts"] = _local_bytes(with_grad, experts=True)

    def step(self, batch: torch.Tensor, timed: bool) -> None:
        """One step on this rank's rows of the global `batch` [world * B, seq + 1]."""
        b = self.args.batch
        mine = batch[self.dp_rank * b : (self.dp_rank + 1) * b].to(self.device)
        before = comm_log().totals()
        _sync(self.device)
        dist.barrier()
        t0 = time.perf_counter()
        loss = self.engine.train_batch(iter([(mine[:, :-1], mine[:, 1:])]))
        _sync(self.device)
        elapsed = _max(time.perf_counter() - t0)
        after = comm_log().totals()
        self.loss = float(loss)
        if timed:
            self.times.append(elapsed)
            self.a2a.append(after["all_to_all_single"] - before["all_to_all_single"])
            self.gathered.append(after["all_gather_single"] - before["all_gather_single"])

    def result(self) -> dict[str, float]:
        state = [
            (n, t)
            for n, p in self.named
            for t in self.engine.optimizer.state.get(p, {}).values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        ]
        params, expert_params = _local_bytes(self.named), _local_bytes(self.named, experts=True)
        optim, expert_optim = _local_bytes(state), _local_bytes(state, experts=True)
        est = self.estimate
        return {
            "step_s": statistics.median(self.times),
            "state": _max(params + self.grads["all"] + optim),
            "experts": _max(expert_params + self.grads["experts"] + expert_optim),
            "estimate": float(est.params + est.grads + est.optimizer),
            "gather": _max(statistics.mean(self.gathered)),
            "gather_est": float(self.volume.all_gather),
            "a2a": _max(statistics.mean(self.a2a)),
            "formula": float(self.volume.all_to_all),
            "loss": self.loss,
        }


def run_layouts(names: list[str], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Every layout's engine built first, then their steps interleaved round by round (the
    same global batch for each), so load from other jobs on the machine spreads over all."""
    layouts = {n: Layout(n, args) for n in names}
    g = torch.Generator().manual_seed(1)
    world = dist.get_world_size()
    for step in range(args.warmup + args.steps):
        batch = torch.randint(0, args.vocab, (world * args.batch, args.seq + 1), generator=g)
        for layout in layouts.values():
            layout.step(batch, timed=step >= args.warmup)
    return {n: layout.result() for n, layout in layouts.items()}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--repeat", type=int, default=15, help="rounds of the expert-compute timing")
    p.add_argument("--grouped-tokens", type=int, default=4096, help="tokens of that timing")
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 32, seq 16")
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu: gloo; cuda: NCCL, one GPU per rank (LOCAL_RANK)",
    )
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        help="parameter dtype in compute (bf16: fp32 reductions); default fp32 on cpu, "
        "bf16 on cuda",
    )
    args = p.parse_args()
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    return args


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"--device cuda: torch {torch.__version__} sees no CUDA device; run on a GPU "
            "machine with a CUDA build of torch, or use --device cpu"
        )
    # gloo on CPU; NCCL for CUDA tensors plus gloo for CPU ones on CUDA.
    info = fsdpx.init_distributed(fsdpx.Config.from_dict({"device": args.device}))
    torch.set_num_threads(1)
    world = dist.get_world_size()
    if args.tiny:
        args.layers, args.hidden, args.ffn, args.seq, args.vocab = 2, 32, 64, 16, 128
    names = list(dict.fromkeys(["replicated", *args.layouts]))
    skip = skipped(names, world)
    if "replicated" in skip:
        raise SystemExit(f"the baseline layout cannot run: {skip['replicated']}")
    results = run_layouts([n for n in names if n not in skip], args)
    rank0 = dist.get_rank() == 0
    if rank0:
        base = results["replicated"]["step_s"]
        mib = 2**20
        dtype = DTYPES[args.dtype]
        auto = choose_grouped(
            info.device.type,
            dtype,
            args.hidden,
            args.ffn,
            grouped_mm_kernel=grouped_mm_kernel(info.device),
        )
        backend = "NCCL" if args.device == "cuda" else "gloo"
        where = f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""
        print(
            f"MoE GPT: {args.layers} layers, hidden {args.hidden}, {EXPERTS} experts top-"
            f"{TOP_K} (ffn {args.ffn}), {args.batch} x {args.seq} tokens per rank, ZeRO-3, "
            f"{world} {backend} rank(s){where}, {args.dtype} parameters, torch "
            f"{torch.__version__}; per-step bytes are per rank (max over ranks); "
            f"grouped='auto' runs {auto!r} here"
        )
        for name, why in skip.items():
            print(f"skipped {name}: {why}")
        print(
            f"{'layout':<21} {'step_s':>7} {'x repl':>6} {'state MiB':>9} {'experts':>8} "
            f"{'estimate':>8} {'gather MiB':>10} {'estimate':>8} {'a2a MiB':>8} {'formula':>8} "
            f"{'a2a/f':>6} "
            f"{'loss':>7}"
        )
        for name, r in results.items():
            ratio = f"{r['a2a'] / r['formula']:.3f}" if r["formula"] else "-"
            print(
                f"{name:<21} {r['step_s']:7.3f} {r['step_s'] / base:6.3f} "
                f"{r['state'] / mib:9.3f} {r['experts'] / mib:8.3f} {r['estimate'] / mib:8.3f} "
                f"{r['gather'] / mib:10.3f} {r['gather_est'] / mib:8.3f} "
                f"{r['a2a'] / mib:8.3f} {r['formula'] / mib:8.3f} "
                f"{ratio:>6} {r['loss']:7.4f}"
            )
        counts, timed = measure(
            EXPERTS,
            args.grouped_tokens,
            args.hidden,
            args.ffn,
            args.repeat,
            device=args.device,
            dtype=dtype,
        )
        clock = "wall time (synchronized)" if args.device == "cuda" else "1 thread, CPU time"
        print(
            f"expert compute, 8 local experts, rows {sum(counts)} (counts {counts}), {clock}, "
            f"median of {args.repeat} interleaved rounds:"
        )
        for name, t in timed.items():
            print(f"  {name:<26} {t.median * 1e3:8.2f} ms  speedup vs module loop {t.speedup:.3f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
