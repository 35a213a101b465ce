"""Long sequences under mesh.sp (Ulysses or ring) with and without tiled MLP / tiled loss,
on a small Llama-style model (tests/sp_models.py): the longest trainable sequence at a
fixed activation budget per rank, and step time vs sequence length.

Run from the repository root (4 gloo ranks on CPU)::

    torchrun --standalone --nproc_per_node=4 benchmarks/long_context.py --budget-mib 16

Smallest run::

    torchrun --standalone --nproc_per_node=4 benchmarks/long_context.py --seq 256 \
        --budget-mib 2 --sweep 256 --steps 1

One GPU (`--device cuda`: sp = 1, tiled and untiled; a wider model, bf16 autocast, and
the step-time sweep also reports the peak of torch.cuda.max_memory_allocated)::

    torchrun --standalone --nproc_per_node=1 benchmarks/long_context.py --device cuda \
        --dim 1024 --autocast bf16 --mlp-tile 4096 --seq 4096 --budget-mib 4096 \
        --sweep 8192 16384 32768 65536 131072 --steps 3

Every layout (sp = 1, 2, 4 with the other ranks data-parallel; tiles of `--mlp-tile`
tokens for the MLP (context_parallel.mlp_tile_tokens) and for the loss
(fsdpx.sequence.tiled_loss_fn) or none) trains the same model. Per layout it reports:

* longest seq: the longest sequence whose activations per rank (the bytes the autograd
  graph holds after one forward + loss: tensors saved for backward, once per storage,
  parameters excluded; the max over ranks) fit `--budget-mib`. Measured at `--seq`,
  extrapolated linearly (activations grow linearly with the sequence here), then
  checked by one real forward at that length ("MiB there", which must be <= the budget),
  next to the same extrapolation from fsdpx.estimate_activations' saved bytes (blocks +
  loss) for this model ("estimator");
* step time (slowest rank, median of `--steps` train steps) and microseconds per token of
  a rank's share, at each `--sweep` length; on CUDA also the peak memory of those steps
  above what was allocated before them (torch.cuda.max_memory_allocated: activations,
  gradients and the optimizer's transient; the max over ranks), or OOM where the length
  did not fit (a length at or above one that did not fit is not tried).

The budget covers activations only: model states do not grow with the sequence (fsdpx
estimate --seq-len adds them). CPU/gloo step times say little about GPUs (the ranks share
the machine's cores); the memory split is what carries over. The goal (issue 19): with
sp = 4 and tiling, >= 4x the sequence of sp = 1 untiled at the same per-rank memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fsdpx  # noqa: E402
import fsdpx.sequence  # noqa: E402
from fsdpx.estimate_activations import TransformerShape, estimate_activations  # noqa: E402
from fsdpx.parallel_dims import ParallelDims  # noqa: E402
from tests.sp_models import TinyLlama  # noqa: E402

VOCAB = 4096
_CPU_GROUP: Any = None
"""A gloo group over every rank for the benchmark's own scalars (timings, byte counts):
CPU tensors on CUDA runs too, where the default group is NCCL's."""


class _LossModel(nn.Module):
    """TinyLlama whose forward returns the loss share, tiled or not."""

    def __init__(self, dim: int, loss_tile: int) -> None:
        super().__init__()
        self.lm = TinyLlama(vocab=VOCAB, dim=dim, heads=8, kv_heads=4)
        self.loss_tile = loss_tile

    def forward(self, input: Tensor, target: Tensor, position_ids: Tensor, n: Tensor) -> Tensor:
        lm = self.lm
        if self.loss_tile == 0:
            logits = lm(input, position_ids=position_ids)
            return fsdpx.sequence.loss_fn(logits, target, num_items_in_batch=n)
        hidden = lm.hidden(input, position_ids=position_ids)
        return fsdpx.sequence.tiled_loss_fn(
            hidden, lm.lm_head.weight, target, tile_tokens=self.loss_tile, num_items_in_batch=n
        )


def _storage_ptr(t: Tensor) -> int | None:
    try:
        return int(t.untyped_storage().data_ptr())
    except RuntimeError:  # FSDP's resharded (freed) parameter storage
        return None


def _saved_bytes(model: nn.Module, run: Any) -> int:
    """Bytes of the tensors autograd saves while `run()` builds the graph (one per storage,
    parameters excluded)."""
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        ptr = _storage_ptr(t)
        if ptr is not None and ptr not in {_storage_ptr(p) for p in model.parameters()}:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    loss.backward()
    return sum(seen.values())


def _engine(sp: int, tile: int, args: argparse.Namespace) -> Any:
    cfg = fsdpx.Config.from_dict(
        {
            "device": args.device,
            "precision": {"autocast": args.autocast},
            "mesh": {"sp": sp},
            "optimizer": {"type": "adamw", "lr": 1e-4},
            "context_parallel": {"mode": args.mode, "mlp_tile_tokens": tile},
        }
    )
    torch.manual_seed(0)
    return fsdpx.shard(_LossModel(args.dim, tile), cfg)


def _sync(device: torch.device) -> None:
    # CUDA runs asynchronously: a step's time is only known once its kernels finished.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_CPU_GROUP)
    return float(t)


def _measure(engine: Any, seq: int, steps: int) -> dict[str, float]:
    """Activation bytes (max over ranks), the median step time (slowest rank) at `seq` and,
    on CUDA, the steps' peak allocation above the memory held before them (max over ranks;
    NaN on CPU)."""
    dp = ParallelDims.dp_mesh(engine.mesh)
    g = torch.Generator().manual_seed(dp.get_local_rank())
    x = torch.randint(0, VOCAB, (1, seq), generator=g)
    y = torch.roll(x, -1, 1)
    shard = fsdpx.sequence.shard_batch((x, y), engine)
    keys = ("input", "target", "position_ids", "num_items_in_batch")
    inputs = tuple(shard[k].to(engine.device) for k in keys)

    def run() -> Tensor:
        out: Tensor = engine(*inputs)
        return out

    cuda = engine.device.type == "cuda"
    activations = _saved_bytes(engine.module, run)
    engine.optimizer.zero_grad()
    if cuda:
        _sync(engine.device)
        torch.cuda.reset_peak_memory_stats(engine.device)
        before = torch.cuda.memory_allocated(engine.device)
    times = []
    for _ in range(steps):
        dist.barrier(group=_CPU_GROUP)
        start = time.perf_counter()
        engine.backward(run())
        engine.step()
        _sync(engine.device)
        times.append(_max_over_ranks(time.perf_counter() - start))
    peak = float("nan")
    if cuda and steps:
        peak = _max_over_ranks(torch.cuda.max_memory_allocated(engine.device) - before)
    return {
        "activations": _max_over_ranks(float(activations)),
        "step_s": statistics.median(times) if times else 0.0,
        "peak": peak,
    }


def _sweep_point(engine: Any, seq: int, steps: int) -> dict[str, float] | None:
    """_measure at one sweep length; None where CUDA ran out of memory (the length does not
    fit this layout: a result, not an error)."""
    try:
        return _measure(engine, seq, steps)
    except torch.cuda.OutOfMemoryError:
        # Every rank of one layout runs the same length; with one GPU per rank they run
        # out alike (the benchmark's GPU form is one rank).
        engine.optimizer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return None


def _estimated_saved(sp: int, tile: int, args: argparse.Namespace) -> float:
    """fsdpx.estimate_activations' saved bytes per rank (blocks + loss: what _saved_bytes
    measures, without the transient) at --seq for the benchmark's model (fp32)."""
    lm = TinyLlama(vocab=VOCAB, dim=args.dim, heads=8, kv_heads=4)
    shape = TransformerShape(len(lm.blocks), args.dim, 8, 4, 2 * args.dim, VOCAB)
    est = estimate_activations(
        shape,
        seq_len=args.seq,
        sp=sp,
        mode="ring" if args.mode == "ring" else "ulysses",
        mlp_tile=tile,
        loss_tile=tile,
        dtype_bytes=2 if args.autocast == "bf16" else 4,
    )
    return float(est.blocks + est.loss)


def _longest(sp: int, tile: int, args: argparse.Namespace) -> dict[str, float]:
    """The longest sequence whose activations fit --budget-mib per rank: measured at --seq,
    extrapolated linearly (activations grow linearly with the sequence: SDPA's CPU kernel
    keeps O(tokens)), then checked by one real run at that length."""
    budget = int(args.budget_mib * 2**20)
    engine = _engine(sp, tile, args)
    at_seq = _measure(engine, args.seq, steps=0)["activations"]
    granule = 2 * sp if args.mode == "ring" else sp  # shard_batch's multiple
    longest = int(budget / (at_seq / args.seq)) // granule * granule
    check = float("nan")  # printed where the check run does not fit (CUDA)
    if longest:
        point = _sweep_point(engine, longest, steps=0)
        check = point["activations"] if point is not None else check
    estimated = _estimated_saved(sp, tile, args)
    return {
        "longest": longest,
        "check_mib": check / 2**20,
        "estimated": int(budget / (estimated / args.seq)) // granule * granule,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024, help="where activations are measured")
    parser.add_argument("--budget-mib", type=float, default=16.0, help="activations per rank")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--mlp-tile", type=int, default=256)
    parser.add_argument("--mode", choices=("ulysses", "ring"), default="ulysses")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank"
    )
    parser.add_argument("--autocast", choices=("none", "bf16"), default="none")
    parser.add_argument(
        "--sweep", type=int, nargs="*", default=[512, 1024, 2048], help="step time at these"
    )
    args = parser.parse_args()
    global _CPU_GROUP
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is available")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cuda:nccl,cpu:gloo")
    else:
        dist.init_process_group("gloo")
        torch.set_num_threads(1)  # the ranks share the machine's cores
    _CPU_GROUP = dist.new_group(backend="gloo")
    world = dist.get_world_size()
    layouts = [(sp, tile) for sp in (1, 2, 4) if world % sp == 0 for tile in (0, args.mlp_tile)]
    longest = {layout: _longest(*layout, args) for layout in layouts}
    times = {}
    for layout in layouts:
        engine = _engine(*layout, args)
        rows: list[dict[str, float] | None] = []
        for seq in args.sweep:
            # Past an OOM the engine's state is suspect and a longer sequence would not
            # fit either: counted as OOM without running it.
            oom = any(r is None and s <= seq for r, s in zip(rows, args.sweep, strict=False))
            rows.append(None if oom else _sweep_point(engine, seq, args.steps))
        times[layout] = rows
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        where = (
            f"CUDA ({torch.cuda.get_device_name()}), autocast {args.autocast}"
            if args.device == "cuda"
            else "gloo, CPU"
        )
        print(
            f"{args.mode}, dim {args.dim}, {world} ranks ({where}), budget "
            f"{args.budget_mib:.0f} MiB of activations per rank"
        )
        print(
            f"{'sp':>3} {'tile':>5} {'longest seq':>12} {'vs sp1':>7} {'MiB there':>10} "
            f"{'estimator':>10}"
        )
        base = longest[layouts[0]]["longest"]
        for (sp, tile), r in longest.items():
            print(
                f"{sp:>3} {tile:>5} {r['longest']:>12.0f} {r['longest'] / base:>7.2f} "
                f"{r['check_mib']:>10.1f} {r['estimated']:>10.0f}"
            )
        _print_sweep(times, args)
    dist.destroy_process_group()


def _print_sweep(
    times: dict[tuple[int, int], list[dict[str, float] | None]], args: argparse.Namespace
) -> None:
    cuda = args.device == "cuda"
    width = 26 if cuda else 16
    what = ", peak MiB" if cuda else ""
    print(f"step time (s) and us per token of a rank's share{what}, by sequence length")
    print(f"{'sp':>3} {'tile':>5} " + " ".join(f"{s:>{width}}" for s in args.sweep))
    for (sp, tile), rows in times.items():
        cells = []
        for r, s in zip(rows, args.sweep, strict=True):
            if r is None:
                cells.append(f"{'OOM':>{width}}")
                continue
            cell = f"{r['step_s']:>7.3f} {r['step_s'] / (s / sp) * 1e6:>8.1f}"
            if cuda:
                cell += f" {r['peak'] / 2**20:>9.0f}"
            cells.append(cell)
        print(f"{sp:>3} {tile:>5} " + " ".join(cells))


if __name__ == "__main__":
    main()
