"""What `initialize` changes for a `PipelineModule`: the DeepSpeed config's stage count,
and the fsdpx config's split points, schedule and FSDP units, all taken from the module.

[Note: DeepSpeed's schedule on torch's] DeepSpeed's pipeline engine runs its TrainSchedule
(one forward, one backward, interleaved: 1F1B) over gradient_accumulation_steps
micro-batches, for any count. torch's 1F1B needs at least as many micro-batches as
stages; with fewer, fsdpx runs GPipe (all forwards, then all backwards), which computes
the same gradients with more activations in flight, and logs that choice.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fsdpx.blocks import find_blocks
from fsdpx.config import Config, PipelineConfig
from fsdpx.deepspeed.pipe import PipelineModule

log = logging.getLogger("fsdpx.deepspeed")


def pipeline_ds_config(model: PipelineModule, ds_config: Mapping[str, Any]) -> dict[str, Any]:
    """`ds_config` with pipeline.stages = the module's num_stages (DeepSpeed takes the
    stage count from the module; the data-parallel size, and with it the batch-size rule,
    is world size / stages).

    Raises:
        ValueError: the config names a different stage count.
    """
    out = copy.deepcopy(dict(ds_config))
    section = dict(out.get("pipeline") or {})
    stages = section.get("stages", "auto")
    if stages != "auto" and stages != model.num_stages:
        raise ValueError(
            f"the DeepSpeed config says pipeline.stages = {stages!r} but the PipelineModule "
            f"has num_stages = {model.num_stages}; remove pipeline.stages (or set it to "
            "'auto') so that the module decides"
        )
    section["stages"] = model.num_stages
    out["pipeline"] = section
    return out


def pipeline_config(model: PipelineModule, cfg: Config) -> Config:
    """`cfg` with the module's split points, the schedule for its micro-batch count, and
    its parameter-holding layers as the FSDP units.

    Raises:
        ValueError: a stage without layers, or a tied module whose class is also a layer's
            (FSDP would shard it as a unit of its own inside another layer).
    """
    if model.num_stages == 1:
        return _with_blocks(model, cfg)
    gas = cfg.gradient_accumulation_steps
    one_f_one_b = gas >= model.num_stages
    if not one_f_one_b:
        log.info(
            "pipeline: %d micro-batches (gradient_accumulation_steps) < %d stages: running "
            "the GPipe schedule (torch's 1F1B needs one micro-batch per stage; gradients are "
            "the same)",
            gas,
            model.num_stages,
        )
    pipeline = PipelineConfig(
        schedule="1F1B" if one_f_one_b else "GPipe", split_points=model.split_points()
    )
    return _with_blocks(model, cfg.replace(pipeline=pipeline))


def _with_blocks(model: PipelineModule, cfg: Config) -> Config:
    names = model.block_class_names()
    if not names:
        return cfg
    found = {n for n, m in model.named_modules() if m in find_blocks(model, names)}
    nested = sorted(n for n in found if "." in n)
    if nested:
        raise ValueError(
            f"PipelineModule: modules {nested} inside a tied layer have the class of a "
            f"pipeline layer ({', '.join(names)}); fsdpx shards those classes as units. Wrap "
            "the tied layer's module in a class of its own"
        )
    return cfg.replace(zero=dataclasses.replace(cfg.zero, block_classes=names))


def _output_is_loss(outputs: torch.Tensor, labels: Any) -> torch.Tensor:
    """DeepSpeed without loss_fn: the last layer's output is the loss."""
    return outputs


def pipeline_loss_fn(model: PipelineModule) -> Callable[..., torch.Tensor]:
    """The last stage's loss: the module's loss_fn(outputs, labels), or its output."""
    fn = model.loss_fn
    return _output_is_loss if fn is None else fn
