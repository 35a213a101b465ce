"""Rank bodies for tests/test_deepspeed_config.py and tests/test_estimate.py (spawned ranks
import them by name)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import fsdpx
from fsdpx.demo.gpt import GPT, GPTConfig, shard_batch
from tests.parity import TINY, make_model

STEPS = 4


def train(cfg: fsdpx.Config, steps: int = STEPS) -> dict[str, Any]:
    """Train the tiny GPT from seed 0 for `steps` optimizer steps on fixed global batches
    of train_micro_batch_size_per_gpu * world samples per micro-step; return the
    global-batch losses, the lr after each step, the loss scales and the full parameters."""
    engine = fsdpx.shard(make_model(), cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = engine.parallel_dims.dp
    batch = cfg.train_micro_batch_size_per_gpu * dp
    g = torch.Generator().manual_seed(1)
    losses: list[float] = []
    lrs: list[float] = []
    scales: list[float] = []
    for _ in range(steps * cfg.gradient_accumulation_steps):
        x = torch.randint(0, TINY.vocab_size, (batch, TINY.block_size), generator=g)
        y = torch.randint(0, TINY.vocab_size, (batch, TINY.block_size), generator=g)
        loss = engine(shard_batch(x, rank, world), shard_batch(y, rank, world))
        engine.backward(loss)
        result = engine.step()
        losses.append(float(engine.all_reduce_mean(loss.detach().float())))
        if result is not None:
            lrs.append(engine.get_lr()[0])
            scales.append(result.loss_scale)
    params = {n: p.full_tensor().detach().clone() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "lrs": lrs, "scales": scales, "params": params}


def ds_vs_native_body(
    rank: int, world_size: int, cases: dict[str, tuple[str, dict[str, Any]]]
) -> dict[str, Any]:
    """For each case: the config translated from the DeepSpeed file (world size from the
    WORLD_SIZE the harness sets), the native one, and a training run from each."""
    out = {}
    for name, (path, native) in cases.items():
        ds_cfg = fsdpx.Config.from_deepspeed(path)
        native_cfg = fsdpx.Config.from_dict(native)
        out[name] = {
            "same_config": ds_cfg == native_cfg,
            "ds": train(ds_cfg),
            "native": train(native_cfg),
        }
    return out


# --- estimator: bytes the real run holds ---------------------------------------------------


def _storage_bytes(tensors: list[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def measure_model_states(engine: fsdpx.Engine) -> dict[str, int]:
    """Bytes of this rank's parameter shards, gradient shards and optimizer state, counted
    from the tensors' storages (each storage once)."""
    seen: set[int] = set()
    params = [p for p in engine.module.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    states = [v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "params": _storage_bytes(params, seen),
        "grads": _storage_bytes(grads, seen),
        "optimizer": _storage_bytes(states, seen),
    }


EST_MODEL = GPTConfig(vocab_size=131, block_size=33, n_layer=2, n_head=2, n_embd=64, bias=True)


def measure_body(rank: int, world_size: int, stages: tuple[int, ...]) -> dict[int, Any]:
    """Per stage: model-state bytes measured after the second backward (the optimizer
    state exists from the first step; gradients are not yet freed by the step)."""
    out = {}
    for stage in stages:
        torch.manual_seed(0)
        model = GPT(EST_MODEL)
        n = sum(p.numel() for p in model.parameters())
        cfg = fsdpx.Config.from_dict({"zero": {"stage": stage}})
        engine = fsdpx.shard(model, cfg)
        x = torch.randint(0, EST_MODEL.vocab_size, (2, 32))
        for step in range(2):
            engine.backward(engine(x, x))
            if step == 0:
                engine.step()
        out[stage] = {"num_params": n, **measure_model_states(engine)}
        del engine, model
    return out


def est_model_with_input() -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    """For `fsdpx estimate --model tests.ds_bodies:est_model_with_input` (built on meta)."""
    x = torch.zeros(2, 32, dtype=torch.long)
    return GPT(EST_MODEL), (x, x)
