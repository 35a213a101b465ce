"""Shared pieces of the parity tests: a tiny GPT, fixed global batches, the single-process
reference trainer and the per-rank fsdpx trainer. Importable by spawned ranks."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

import fsdpx
from fsdpx.demo.gpt import GPT, GPTConfig, shard_batch

# bias=False: a key-projection bias has an exactly-zero true gradient (softmax ignores a
# constant shift), so Adam would turn rounding noise into full-size, unreproducible updates.
TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
GLOBAL_BATCH = 4  # per micro-step, split over the data-parallel ranks
STEPS = 5
LR = 1e-2  # large enough that 5 steps move the parameters well past tolerance


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY)


def global_batches(
    steps: int, gas: int, seed: int = 1
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        micro = []
        for _ in range(gas):
            x = torch.randint(0, TINY.vocab_size, (GLOBAL_BATCH, TINY.block_size), generator=g)
            y = torch.randint(0, TINY.vocab_size, (GLOBAL_BATCH, TINY.block_size), generator=g)
            micro.append((x, y))
        out.append(micro)
    return out


def reference_run(
    cfg_dict: dict[str, Any], dp: int, *, compute_dtype: torch.dtype = torch.float32
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: fp32 master weights, AdamW, the same global batches. With a 16-bit
    compute dtype it emulates FSDP's casts: each data-parallel chunk runs forward/backward
    in that dtype, its gradients are cast to fp32 and averaged over the chunks."""
    cfg = fsdpx.Config.from_dict(cfg_dict)
    gas = cfg.gradient_accumulation_steps
    # Ranks run with one thread; so must the reference, or bf16 matmuls block (and round)
    # differently and Adam magnifies the difference on near-zero gradients.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_steps(cfg, dp, gas, compute_dtype)
    finally:
        torch.set_num_threads(threads)


def _reference_steps(
    cfg: fsdpx.Config, dp: int, gas: int, compute_dtype: torch.dtype
) -> tuple[list[float], dict[str, torch.Tensor]]:
    master = make_model()
    opt = torch.optim.AdamW(
        master.parameters(), lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay
    )
    losses: list[float] = []
    for micro in global_batches(STEPS, gas):
        grads = {n: torch.zeros_like(p) for n, p in master.named_parameters()}
        for x, y in micro:
            chunk_losses = []
            for r in range(dp):
                work = copy.deepcopy(master).to(compute_dtype)
                loss = work(shard_batch(x, r, dp), shard_batch(y, r, dp))
                (loss / (gas * dp)).backward()
                for n, p in work.named_parameters():
                    grads[n] += p.grad.float()
                chunk_losses.append(loss.detach().float())
            losses.append(float(torch.stack(chunk_losses).mean()))
        for n, p in master.named_parameters():
            p.grad = grads[n]
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in master.named_parameters()}


def fsdpx_run(cfg_dict: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """This rank's part of the same training through fsdpx.shard; returns the global-batch
    losses and the full (gathered) parameters."""
    cfg = fsdpx.Config.from_dict(cfg_dict)
    engine = fsdpx.shard(make_model(), cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses: list[float] = []
    for micro in global_batches(STEPS, cfg.gradient_accumulation_steps):
        for x, y in micro:
            loss = engine(shard_batch(x, rank, world), shard_batch(y, rank, world))
            engine.backward(loss)
            engine.step()
            losses.append(float(engine.all_reduce_mean(loss.detach().float())))
    params = {n: p.full_tensor().detach().clone() for n, p in engine.module.named_parameters()}
    return losses, params


def sweep_body(rank: int, world_size: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {name: fsdpx_run(cfg) for name, cfg in cases.items()}
