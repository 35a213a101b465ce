"""Per-rank bodies of the telemetry tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import fsdpx
from examples.gpt import shard_batch
from tests.parity import LR, global_batches, make_model

E2E_STEPS = 6
E2E_GAS = 2


def train_with_and_without_telemetry(
    rank: int, world_size: int, relay: str, steps: int, gas: int
) -> dict[str, Any]:
    """Train the tiny GPT twice on the same data and seed, telemetry off then on.

    Returns this rank's per-step losses of both runs (the mean of the step's micro-batch
    losses on this rank, as the publisher defines `loss`), the publisher's drop counter,
    its measured FLOPs and collective bytes per step.
    """
    out: dict[str, Any] = {}
    for enabled in (False, True):
        cfg = fsdpx.Config.from_dict(
            {
                "gradient_accumulation_steps": gas,
                "gradient_clipping": 1.0,
                "optimizer": {"type": "adamw", "lr": LR},
                "scheduler": {"type": "WarmupLR", "warmup_num_steps": 4, "warmup_type": "linear"},
                "telemetry": {
                    "enabled": enabled,
                    "relay": relay,
                    "start_relay": False,
                    "poll_interval_s": 0.05,
                    "tokens_per_step": 128,
                    "run_id": "e2e",
                },
            }
        )
        engine = fsdpx.shard(make_model(), cfg)
        losses, lrs = [], []
        for micro in global_batches(steps, gas):
            lrs.append(engine.get_lr()[0])
            step_losses = []
            for x, y in micro:
                loss = engine(shard_batch(x, rank, world_size), shard_batch(y, rank, world_size))
                engine.backward(loss)
                engine.step()
                step_losses.append(loss.detach().float())
            losses.append(float(torch.stack(step_losses).mean()))
        key = "on" if enabled else "off"
        out[f"losses_{key}"] = losses
        out["lrs"] = lrs
        if engine.telemetry is not None:
            pub = engine.telemetry
            pub.event("checkpoint_saved", step=steps, detail={"path": "ckpt", "bytes": 1})
            pub.close()
            out["dropped"] = pub.dropped
            out["records_sent"] = pub.stats.records_sent
            out["flops"] = pub._meter.flops_per_step
            out["comm_bytes"] = pub._meter.comm_bytes_per_step
        dist.barrier()
    return out
