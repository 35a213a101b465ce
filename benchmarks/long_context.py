"""Long sequences under mesh.sp (Ulysses or ring) with and without tiled MLP / tiled loss,
on a small Llama-style model (tests/sp_models.py): the longest trainable sequence at a
fixed activation budget per rank, and step time vs sequence length.

Run from the repository root (4 gloo ranks on CPU)::

    torchrun --standalone --nproc_per_node=4 benchmarks/long_context.py --budget-mib 16

Smallest run::

    torchrun --standalone --nproc_per_node=4 benchmarks/long_context.py --seq 256 \
        --budget-mib 2 --sweep 256 --steps 1

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
  a rank's share, at each `--sweep` length.

The budget covers activations only: model states do not grow with the sequence (fsdpx
estimate --seq-len adds them). CPU/gloo step times say little about GPUs (the ranks share
the machine's cores); the memory split is what carries over. The goal (issue 19): with
sp = 4 and tiling, >= 4x the sequence of sp = 1 untiled at the same per-rank memory.
"""

from __future__ import annotations

import argparse
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
            "mesh": {"sp": sp},
            "optimizer": {"type": "adamw", "lr": 1e-4},
            "context_parallel": {"mode": args.mode, "mlp_tile_tokens": tile},
        }
    )
    torch.manual_seed(0)
    return fsdpx.shard(_LossModel(args.dim, tile), cfg)


def _measure(engine: Any, seq: int, steps: int) -> dict[str, float]:
    """Activation bytes (max over ranks) and the median step time (slowest rank) at `seq`."""
    dp = ParallelDims.dp_mesh(engine.mesh)
    g = torch.Generator().manual_seed(dp.get_local_rank())
    x = torch.randint(0, VOCAB, (1, seq), generator=g)
    y = torch.roll(x, -1, 1)
    shard = fsdpx.sequence.shard_batch((x, y), engine)
    inputs = (shard["input"], shard["target"], shard["position_ids"], shard["num_items_in_batch"])

    def run() -> Tensor:
        out: Tensor = engine(*inputs)
        return out

    activations = _saved_bytes(engine.module, run)
    engine.optimizer.zero_grad()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        engine.backward(run())
        engine.step()
        t = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    peak = torch.tensor([float(activations)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"activations": float(peak), "step_s": statistics.median(times) if times else 0.0}


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
        dtype_bytes=4,
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
    check = _measure(engine, longest, steps=0)["activations"] if longest else 0.0
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
        "--sweep", type=int, nargs="*", default=[512, 1024, 2048], help="step time at these"
    )
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    layouts = [(sp, tile) for sp in (1, 2, 4) if world % sp == 0 for tile in (0, args.mlp_tile)]
    longest = {layout: _longest(*layout, args) for layout in layouts}
    times = {}
    for layout in layouts:
        engine = _engine(*layout, args)
        times[layout] = [_measure(engine, seq, args.steps) for seq in args.sweep]
    if dist.get_rank() == 0:
        print(
            f"{args.mode}, dim {args.dim}, {world} ranks (gloo, CPU), budget "
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
        print("step time (s) and us per token of a rank's share, by sequence length")
        print(f"{'sp':>3} {'tile':>5} " + " ".join(f"{s:>16}" for s in args.sweep))
        for (sp, tile), rows in times.items():
            cells = [
                f"{r['step_s']:>7.3f} {r['step_s'] / (s / sp) * 1e6:>8.1f}"
                for r, s in zip(rows, args.sweep, strict=True)
            ]
            print(f"{sp:>3} {tile:>5} " + " ".join(cells))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
