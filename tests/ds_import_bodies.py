"""Rank bodies for tests/test_deepspeed_import.py: resume under fsdpx from an imported
DeepSpeed checkpoint and continue the run DeepSpeed recorded (tests/data/deepspeed_ckpt/)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fsdpx.deepspeed as deepspeed
from tests.ds_import_model import GLOBAL_MICRO_BATCH, make_model, micro_batch, param_groups


def resume(
    rank: int, world_size: int, case_dir: Path, imported: Path, stage: int | None
) -> dict[str, Any]:
    """Build the DeepSpeed script's engine from the run's own config (at `world_size`
    ranks, ZeRO `stage` when given), load the imported checkpoint, continue the run."""
    record = json.loads((case_dir / "record.json").read_text())
    config = copy.deepcopy(record["config"])
    config["train_micro_batch_size_per_gpu"] = GLOBAL_MICRO_BATCH // world_size
    if stage is not None:
        config["zero_optimization"]["stage"] = stage
    model = make_model()
    params = param_groups(model) if record["grouped"] else model.parameters()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    engine.load_checkpoint(str(imported))
    steps_before = engine.global_steps
    gas = config["gradient_accumulation_steps"]
    first = record["steps"] * gas
    losses = []
    for micro in range(first, first + record["continue"] * gas):
        x, y = micro_batch(micro, rank, world_size)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        if dist.is_initialized():
            dist.all_reduce(mean)
        losses.append(float(mean) / world_size)
    weights = {
        n.removeprefix("module."): p.full_tensor().detach().float().clone()
        if hasattr(p, "full_tensor")
        else p.detach().float().clone()
        for n, p in engine.named_parameters()
    }
    out = {"losses": losses, "weights": weights, "steps_before": steps_before}
    out["global_steps"] = engine.global_steps
    engine.destroy()
    return out


def resume_body(
    rank: int, world_size: int, runs: list[tuple[str, str, str, int | None]]
) -> dict[str, Any]:
    """Several resumes in one set of processes: (label, the run's fixture directory
    with record.json, imported root, stage)."""
    torch.set_num_threads(1)
    return {
        label: resume(rank, world_size, Path(case), Path(imported), stage)
        for label, case, imported, stage in runs
    }
