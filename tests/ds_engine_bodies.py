"""Rank bodies for tests/test_deepspeed_engine.py: DeepSpeed-style scripts run through
`import fsdpx.deepspeed as deepspeed`, and their single-process references."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fsdpx.deepspeed as deepspeed
from fsdpx.demo.gpt import shard_batch
from tests.parity import STEPS, global_batches, make_model

LR = 1e-2
GAS = 2


def ds_config(stage: int, *, with_optimizer: bool = True) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,  # parity.GLOBAL_BATCH over 2 ranks
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 2,
    }
    if with_optimizer:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}}
    return config


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """The usual no-weight-decay pattern: norms (1-D tensors) get none."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _schedule(step: int) -> float:
    return 1.0 / (1 + step)


def build(case: str, stage: int) -> tuple[Any, Any]:
    """initialize() as a DeepSpeed script would call it, for each way of passing the
    optimizer: from the config with parameter groups, an instance plus a scheduler
    instance, a callable."""
    model = make_model()
    if case == "config_groups":
        engine, opt, _, sched = deepspeed.initialize(
            model=model, model_parameters=param_groups(model), config=ds_config(stage)
        )
    elif case == "instance":
        opt = torch.optim.AdamW(param_groups(model), lr=LR)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
        engine, opt2, _, sched2 = deepspeed.initialize(
            model=model,
            optimizer=opt,
            lr_scheduler=sched,
            config=ds_config(stage, with_optimizer=False),
        )
        assert opt2 is opt and sched2 is sched  # the script's own objects, rebound
    elif case == "callable":
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=param_groups(model),
            optimizer=lambda groups: torch.optim.AdamW(groups, lr=LR),
            lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, _schedule),
            config=ds_config(stage, with_optimizer=False),
        )
    else:
        raise AssertionError(case)
    return engine, model


def train_body(rank: int, world_size: int, cases: list[tuple[str, int]]) -> dict[str, Any]:
    out = {}
    for case, stage in cases:
        engine, _ = build(case, stage)
        losses = []
        backward_returns = []
        for micro in global_batches(STEPS, GAS):
            for x, y in micro:
                loss = engine(shard_batch(x, rank, world_size), shard_batch(y, rank, world_size))
                backward_returns.append(float(engine.backward(loss)) * GAS - float(loss))
                engine.step()
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                losses.append(float(mean) / world_size)
        params = {
            n.removeprefix("module."): p.full_tensor().detach().clone()
            for n, p in engine.named_parameters()
        }
        out[f"{case}/{stage}"] = {
            "losses": losses,
            "params": params,
            "backward_returns": backward_returns,
            "applied": engine.was_step_applied(),
        }
        engine.destroy()
    return out


def reference(case: str, dp: int = 2) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the same global batches: dp chunks per micro-step, AdamW with the
    same groups, clipping at 1.0, and the LambdaLR of the instance/callable cases."""
    torch.set_num_threads(1)
    master = make_model()
    opt = torch.optim.AdamW(param_groups(master), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule) if case != "config_groups" else None
    losses = []
    for micro in global_batches(STEPS, GAS):
        grads = {n: torch.zeros_like(p) for n, p in master.named_parameters()}
        for x, y in micro:
            chunk = []
            for r in range(dp):
                work = copy.deepcopy(master)
                loss = work(shard_batch(x, r, dp), shard_batch(y, r, dp))
                (loss / (GAS * dp)).backward()
                for n, p in work.named_parameters():
                    grads[n] += p.grad
                chunk.append(loss.detach())
            losses.append(float(torch.stack(chunk).mean()))
        for n, p in master.named_parameters():
            p.grad = grads[n]
        torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in master.named_parameters()}


def resume_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Fresh start through load_checkpoint's (None, None), a save mid-run, a new engine
    that resumes: the resumed steps equal the uninterrupted run's."""
    ckpt = Path(root) / "ckpt"
    batches = global_batches(STEPS, GAS)

    def run(engine: Any, steps: list[Any]) -> list[float]:
        losses = []
        for micro in steps:
            for x, y in micro:
                loss = engine(shard_batch(x, rank, world_size), shard_batch(y, rank, world_size))
                engine.backward(loss)
                engine.step()
                losses.append(float(loss))
        return losses

    engine, _ = build("config_groups", 2)
    fresh = engine.load_checkpoint(str(ckpt))
    full = run(engine, batches)
    engine.destroy()

    engine, _ = build("config_groups", 2)
    first = run(engine, batches[:2])
    assert engine.save_checkpoint(str(ckpt), client_state={"epoch": 3}) is True
    samples_at_save = engine.global_samples
    engine.destroy()

    engine, _ = build("config_groups", 2)
    path, client_state = engine.load_checkpoint(str(ckpt))
    rest = run(engine, batches[2:])
    return {
        "fresh": fresh,
        "full": full,
        "resumed": first + rest,
        "client_state": client_state,
        "path": path,
        "samples": (samples_at_save, engine.global_samples),
        "steps": engine.global_steps,
    }
