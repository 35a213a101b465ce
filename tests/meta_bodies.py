"""Rank bodies for tests/test_meta_init.py (spawned ranks import them from here): models
built on the meta device, sharded by fsdpx.shard and materialised shard by shard."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fsdpx
from fsdpx.demo.gpt import GPT, GPTConfig

# Odd sizes on purpose: uneven shards (FSDP2 pads them) and, at 4 ranks, a rank with an
# empty shard of wpe (block_size 3 rows over 4 ranks).
ODD = GPTConfig(vocab_size=67, block_size=3, n_layer=2, n_head=2, n_embd=36, bias=True)
TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
SEED = 1234


def gpt_init(name: str, t: torch.Tensor, g: torch.Generator) -> None:
    """A seeded per-parameter init: every value comes from `g`, except the biases."""
    if name.endswith("bias"):
        t.zero_()
    elif t.ndim == 1:
        t.normal_(1.0, 0.1, generator=g)
    else:
        t.normal_(0.0, 0.02, generator=g)


def meta_gpt(config: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(config)


def _cfg(zero: dict[str, Any], **extra: Any) -> fsdpx.Config:
    return fsdpx.Config.from_dict({"device": "cpu", "zero": zero, **extra})


def init_sweep(
    rank: int,
    world_size: int,
    per_param_cases: dict[str, dict[str, Any]],
    default_cases: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """(a) per_param_init on a meta build: the gathered full parameters per case.
    (b) the default reset_parameters() path: this rank's local shards and shard index,
    and the losses of a few AdamW steps on one fixed batch (stage 3 only).
    (c) the error and buffer cases of `error_sweep`."""
    full: dict[str, dict[str, torch.Tensor]] = {}
    for name, cfg in per_param_cases.items():
        init = fsdpx.per_param_init(gpt_init, seed=SEED)
        engine = fsdpx.shard(meta_gpt(ODD), _cfg(**cfg), init_fn=init)
        full[name] = {n: p.full_tensor().detach() for n, p in engine.module.named_parameters()}

    default: dict[str, Any] = {}
    for name, cfg in default_cases.items():
        engine = fsdpx.shard(meta_gpt(TINY), _cfg(**cfg, optimizer={"type": "adamw", "lr": 3e-3}))
        params = dict(engine.module.named_parameters())
        weight = params["lm_head.weight"]
        coordinate = weight.device_mesh.get_coordinate()
        shard_index = [
            c for c, p in zip(coordinate, weight.placements, strict=True) if p.is_shard()
        ]
        stds = {n: float(p.full_tensor().detach().std()) for n, p in params.items() if p.ndim == 2}
        local = {n: p.to_local().detach().clone() for n, p in params.items()}
        losses: list[float] = []
        if name == "stage3":
            g = torch.Generator().manual_seed(0)
            x = torch.randint(0, TINY.vocab_size, (2, TINY.block_size), generator=g)
            for _ in range(5):
                loss = engine(x[:, :-1], x[:, 1:])
                engine.backward(loss)
                engine.step()
                losses.append(float(engine.all_reduce_mean(loss.detach())))
        default[name] = {
            "local": local,
            "shard_index": shard_index,
            "stds": stds,
            "losses": losses,
        }
    return {"full": full, "default": default, "errors": error_sweep(rank, world_size)}


class NoReset(nn.Module):
    """Parameters only, no reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class WithBuffer(nn.Module):
    """A buffer computed in __init__ (rotary-style frequencies); `reset_buffers` says
    whether reset_parameters() recomputes it. `buffer_device` places it off meta."""

    def __init__(self, *, reset_buffers: bool, buffer_device: str | None = None) -> None:
        super().__init__()
        self.reset_buffers = reset_buffers
        self.fc = nn.Linear(8, 8)
        self.register_buffer("inv_freq", self.frequencies(buffer_device), persistent=False)

    @staticmethod
    def frequencies(device: str | torch.device | None = None) -> torch.Tensor:
        return 1.0 / (10000 ** (torch.arange(0, 8, 2, device=device) / 8))

    def reset_parameters(self) -> None:
        self.fc.reset_parameters()
        if self.reset_buffers:
            with torch.no_grad():
                self.inv_freq.copy_(self.frequencies(self.inv_freq.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.inv_freq.repeat(2)


class Mixed(nn.Module):
    """A parameter made on the CPU inside a meta build: it keeps its values."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.arange(8.0, device="cpu"))

    def reset_parameters(self) -> None:
        self.fc.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


class Thin(nn.Module):
    """A (1, 8) parameter: only rank 0's shard of it is not empty."""

    def __init__(self) -> None:
        super().__init__()
        self.row = nn.Parameter(torch.empty(1, 8))
        self.fc = nn.Linear(8, 8)

    def reset_parameters(self) -> None:
        self.fc.reset_parameters()  # forgets self.row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.row


def _freq_fn(name: str, t: torch.Tensor, g: torch.Generator) -> None:
    if name == "inv_freq":
        t.copy_(WithBuffer.frequencies())
    else:
        t.normal_(0.0, 0.1, generator=g)


def error_sweep(rank: int, world_size: int) -> dict[str, str | list[float]]:
    """Per case: the ValueError message fsdpx.shard raised on this rank, or the module's
    inv_freq buffer (`scale` parameter for Mixed) as a list when it succeeded."""
    cases: dict[str, Any] = {
        "no_reset": (NoReset, None),
        "buffer_not_reset": (lambda: WithBuffer(reset_buffers=False), None),
        "buffer_reset": (lambda: WithBuffer(reset_buffers=True), None),
        "buffer_on_cpu": (lambda: WithBuffer(reset_buffers=False, buffer_device="cpu"), None),
        "per_param_no_buffers": (
            lambda: WithBuffer(reset_buffers=False),
            fsdpx.per_param_init(_freq_fn),
        ),
        "per_param_buffers": (
            lambda: WithBuffer(reset_buffers=False),
            fsdpx.per_param_init(_freq_fn, buffers=True),
        ),
        "empty_shard_unwritten": (Thin, None),
        "param_on_cpu": (Mixed, None),
    }
    out: dict[str, str | list[float]] = {}
    for name, (make, init_fn) in cases.items():
        with torch.device("meta"):
            model = make()
        try:
            engine = fsdpx.shard(model, _cfg({"stage": 3}), init_fn=init_fn)
        except ValueError as exc:
            out[name] = str(exc)
            continue
        module = engine.module
        kept = module.scale.full_tensor() if name == "param_on_cpu" else module.inv_freq
        out[name] = kept.tolist()
    return out


def _memory() -> dict[str, int]:
    """This process's current and peak resident set size, in bytes."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) * 1024  # reported in kB
    return found


def rss_body(rank: int, world_size: int, config: GPTConfig) -> dict[str, Any]:
    """Build `config` on meta, shard it (ZeRO-3), materialise it with reset_parameters(),
    and train 2 SGD steps on one batch; report sizes and the peak RSS increases."""
    cfg = _cfg({"stage": 3}, optimizer={"type": "sgd", "lr": 0.1})
    # Warm-up: imports, gloo buffers, FSDP2 and autograd code paths, the allocator.
    warm = fsdpx.shard(meta_gpt(TINY), cfg)
    x = torch.randint(0, TINY.vocab_size, (1, TINY.block_size))
    warm.backward(warm(x, x))
    warm.step()
    del warm
    dist.barrier()
    # VmHWM cannot be reset: (peak after) - (current before) bounds the increase above.
    before = _memory()
    start = time.perf_counter()
    engine = fsdpx.shard(meta_gpt(config), cfg)
    built = _memory()
    build_s = time.perf_counter() - start
    params = list(engine.module.parameters())
    full_bytes = sum(p.numel() * p.element_size() for p in params)
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in params)
    finite = all(bool(torch.isfinite(p.to_local()).all()) for p in params)

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, config.vocab_size, (1, config.block_size + 1), generator=g)
    losses = []
    start = time.perf_counter()
    for _ in range(2):
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(engine.all_reduce_mean(loss.detach())))
    trained = _memory()
    return {
        "full_bytes": full_bytes,
        "shard_bytes": shard_bytes,
        "baseline_rss": before["VmRSS"],
        "baseline_hwm": before["VmHWM"],
        "build_peak_increase": built["VmHWM"] - before["VmRSS"],
        "train_peak_increase": trained["VmHWM"] - before["VmRSS"],
        "build_s": build_s,
        "train_s": time.perf_counter() - start,
        "finite": finite,
        "losses": losses,
        "expected_first_loss": math.log(config.vocab_size),
    }
