"""Activation memory per rank and step time of Ulysses sequence parallelism (mesh.sp) with
and without tiled MLP / tiled loss, on a small Llama-style model (tests/sp_models.py).

Run from the repository root (4 gloo ranks on CPU)::

    torchrun --standalone --nproc_per_node=4 benchmarks/long_context.py --seq 4096

Smallest run::

    torchrun --standalone --nproc_per_node=4 benchmarks/long_context.py --seq 256 --steps 1

Every layout (sp = 1, 2, 4 with the other ranks data-parallel) trains the same model on
sequences of `--seq` tokens. Per rank it reports:

* activations: bytes the autograd graph holds at the end of one forward + loss (the
  tensors saved for backward, counted once per storage, parameters excluded), i.e. the
  activation memory that grows with the sequence; the max over ranks;
* step: the median time of one train_batch (slowest rank), and per token of a rank's
  share of the sequence.

Tiling: `--mlp-tile` tokens per MLP tile (context_parallel.mlp_tile_tokens) and the same
number per loss tile (fsdpx.sequence.tiled_loss_fn instead of materialised logits).
CPU/gloo step times say little about GPUs (two cores shared by all ranks); the memory
split is what carries over. The goal (issue 19): activations per rank ~ 1/sp.
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


def _layout(sp: int, tile: int, args: argparse.Namespace) -> dict[str, float]:
    cfg = fsdpx.Config.from_dict(
        {
            "mesh": {"sp": sp},
            "optimizer": {"type": "adamw", "lr": 1e-4},
            "context_parallel": {"mlp_tile_tokens": tile},
        }
    )
    torch.manual_seed(0)
    engine = fsdpx.shard(_LossModel(args.dim, tile), cfg)
    dp = ParallelDims.dp_mesh(engine.mesh)
    g = torch.Generator().manual_seed(dp.get_local_rank())
    x = torch.randint(0, VOCAB, (1, args.seq), generator=g)
    y = torch.roll(x, -1, 1)
    shard = fsdpx.sequence.shard_batch((x, y), engine)
    inputs = (shard["input"], shard["target"], shard["position_ids"], shard["num_items_in_batch"])

    def run() -> Tensor:
        out: Tensor = engine(*inputs)
        return out

    activations = _saved_bytes(engine.module, run)
    engine.optimizer.zero_grad()
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        engine.backward(run())
        engine.step()
        t = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    peak = torch.tensor([float(activations)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    step = statistics.median(times)
    return {
        "activations_mib": float(peak) / 2**20,
        "step_s": step,
        "us_per_token": step / (args.seq / sp) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mlp-tile", type=int, default=256)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    rows = []
    for sp in (s for s in (1, 2, 4) if world % s == 0):
        for tile in (0, args.mlp_tile):
            rows.append((sp, tile, _layout(sp, tile, args)))
    if dist.get_rank() == 0:
        base = rows[0][2]["activations_mib"]
        print(f"seq {args.seq}, dim {args.dim}, {world} ranks (gloo, CPU)")
        print(
            f"{'sp':>3} {'tile':>5} {'activations MiB':>16} {'vs sp1':>7} {'step s':>8} {'us/token':>9}"
        )
        for sp, tile, r in rows:
            print(
                f"{sp:>3} {tile:>5} {r['activations_mib']:>16.1f} "
                f"{r['activations_mib'] / base:>7.3f} {r['step_s']:>8.3f} {r['us_per_token']:>9.1f}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
