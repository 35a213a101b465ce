"""Rank bodies for tests/test_hsdp_comm_wait.py (spawned by tests/dist.run_ranks, so they
live in an importable module)."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

import fsdpx
from fsdpx.comm import counted
from fsdpx.telemetry.phases import COMM_WAIT, PHASES, phase_clock
from tests.parity import LR, make_model

HSDP_STEPS = 2


def hsdp_step_waits(rank: int, world_size: int) -> dict[str, Any]:
    """ZeRO-3 on a 2x2 HSDP mesh (2 replicas of 2 shards), the phase clock on as a
    publisher turns it on; every comm-wait span is recorded with the function that added
    it. Returns, per step: the phase seconds, the spans of FSDP's all-reduce timer, the
    all-reduces the comm log counted (bytes), and the bytes FSDP's all-reduce of this
    model must send (2 (W - 1) / W x the padded gradient shard, W = 2 replicas)."""
    cfg = fsdpx.Config.from_dict(
        {"optimizer": {"type": "adamw", "lr": LR}, "mesh": {"dp_replicate": 2, "dp_shard": 2}}
    )
    model = make_model()
    vocab, block = model.config.vocab_size, model.config.block_size
    # The reduce output FSDP all-reduces: every parameter padded on dim 0 to the shard
    # group size, then one shard of it, in fp32.
    shard = sum(((p.shape[0] + 1) // 2) * (p.numel() // p.shape[0]) for p in model.parameters())
    engine = fsdpx.shard(model, cfg)
    g = torch.Generator().manual_seed(rank)
    clock = phase_clock()
    spans: list[tuple[str, float]] = []
    real_add = clock.add

    def spy(phase: int, seconds: float) -> None:
        if phase == COMM_WAIT:
            spans.append((sys._getframe(1).f_globals["__name__"], seconds))
        real_add(phase, seconds)

    clock.add = spy  # type: ignore[method-assign]
    clock.enable(torch.device("cpu"))
    clock.take()
    steps: list[dict[str, Any]] = []
    try:
        for _ in range(HSDP_STEPS):
            x = torch.randint(0, vocab, (2, block), generator=g)
            y = torch.randint(0, vocab, (2, block), generator=g)
            log = counted.comm_log()
            mark = log.mark()
            spans.clear()
            engine.backward(engine(x, y))
            engine.step()
            seconds = clock.take().seconds
            steps.append(
                {
                    "phases": dict(zip(PHASES, seconds, strict=True)),
                    "all_reduce_spans": [s for who, s in spans if who.endswith("fsdp_all_reduce")],
                    "other_spans": [s for who, s in spans if not who.endswith("fsdp_all_reduce")],
                    "all_reduces": [
                        (r.bytes_sent, r.group_size)
                        for r in log.since(mark)
                        if r.kind == "all_reduce"
                    ],
                    "fsdp_modules": sum(
                        isinstance(m, torch.distributed.fsdp.FSDPModule) for m in model.modules()
                    ),
                }
            )
    finally:
        clock.disable()
        clock.add = real_add  # type: ignore[method-assign]
    dist.barrier()
    return {"steps": steps, "expected_bytes": 2 * (2 - 1) * shard * 4 // 2}
