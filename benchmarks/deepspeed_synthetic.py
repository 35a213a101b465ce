"""A DeepSpeed ZeRO-2 checkpoint of any size, in DeepSpeed 0.19's exact file layout
(checkpoint_tools/DEEPSPEED.md), written with plain torch.save (no DeepSpeed needed):
for the import's memory test and benchmarks/deepspeed_import.py. The small real
fixtures in tests/data/deepspeed_ckpt/ pin the layout to what DeepSpeed writes; this
scales it up.

`zero_stage` is stored as a plain int where DeepSpeed pickles its ZeroStageEnum, and the
loss scaler as None: the importer reads both, and DeepSpeed's own zero_to_fp32 reads them
too (it only compares `zero_stage` with ints).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

import torch


def make_zero2_checkpoint(root: Path, *, numel: int, world: int, seed: int = 0) -> Path:
    """Write `root/latest` and `root/global_step1/` for a model of square fp32 layers
    totalling about `numel` parameters, as `world` ZeRO-2 ranks; returns the tag dir."""
    side = 1024
    layers = max(1, numel // (side * side))
    shapes: OrderedDict[str, torch.Size] = OrderedDict(
        (f"layers.{i}.weight", torch.Size([side, side])) for i in range(layers)
    )
    shapes["head.bias"] = torch.Size([7])  # an odd tail, so partitions need padding
    total = sum(math.prod(s) for s in shapes.values())
    align = 2 * world
    padded = align * math.ceil(total / align)
    part = padded // world
    tag = root / "global_step1"
    tag.mkdir(parents=True, exist_ok=True)
    (root / "latest").write_text("global_step1")
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    torch.save(
        {
            "module": OrderedDict(),
            "buffer_names": [],
            "optimizer": None,
            "param_shapes": [shapes],
            "frozen_param_shapes": None,
            "shared_params": {},
            "frozen_param_fragments": None,
            "lr_scheduler": None,
            "skipped_steps": 0,
            "global_steps": 1,
            "global_samples": world,
            "dp_world_size": world,
            "mp_world_size": 1,
            "ds_config": config,
            "ds_version": "0.19.8",
        },
        tag / "mp_rank_00_model_states.pt",
    )
    g = torch.Generator().manual_seed(seed)
    for r in range(world):
        pad = max(0, (r + 1) * part - total) - max(0, r * part - total)
        pad = min(pad, part)
        state = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.randn(part, generator=g),
            "exp_avg_sq": torch.rand(part, generator=g),
        }
        osd = {
            "loss_scaler": None,
            "dynamic_loss_scale": False,
            "overflow": False,
            "clip_grad": 0.0,
            "base_optimizer_state": {
                "state": {0: state},
                "param_groups": [
                    {
                        "lr": 1e-3,
                        "betas": (0.9, 0.999),
                        "eps": 1e-8,
                        "weight_decay": 0.0,
                        "params": [0],
                    }
                ],
            },
            "single_partition_of_fp32_groups": [torch.randn(part - pad, generator=g)],
            "zero_stage": 2,
            "group_paddings": [pad],
            "partition_count": [world],
            "ds_version": "0.19.8",
        }
        torch.save(
            {"optimizer_state_dict": osd, "ds_config": config, "ds_version": "0.19.8"},
            tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
        )
    return tag
