"""`deepspeed.checkpointing`: DeepSpeed's activation-checkpointing API on torch's
non-reentrant `torch.utils.checkpoint` (the forward is recomputed in backward with the
RNG state it had, so dropout masks match).

DeepSpeed's extras that change where activations live — `partition_activations` (split
across model-parallel ranks) and `checkpoint_in_cpu` — have no equivalent here and are
refused by `configure`; its layout and profiling knobs (`contiguous_memory_optimization`,
`number_checkpoints`, `synchronize_checkpoint_boundary`, `profile`) do not change results
and are accepted. For whole blocks, fsdpx's own `activation_checkpointing` config is the
simpler route.
"""

import logging as _logging
from collections.abc import Callable as _Callable
from pathlib import Path as _Path
from typing import Any as _Any

import torch.utils.checkpoint as _torch_checkpoint

_log = _logging.getLogger("fsdpx.deepspeed")


def checkpoint(function: _Callable[..., _Any], *args: _Any, **kwargs: _Any) -> _Any:
    """Run `function(*args, **kwargs)` without keeping its activations; recompute them in
    backward (DeepSpeed's `checkpointing.checkpoint`)."""
    return _torch_checkpoint.checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True, **kwargs
    )


def configure(
    mpu_: _Any,
    deepspeed_config: str | _Path | dict[str, _Any] | None = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Check DeepSpeed's activation-checkpointing options (arguments, or the config's
    "activation_checkpointing" section) against what `checkpoint` does.

    Raises:
        ValueError: mpu_ given, partition_activations or checkpoint_in_cpu enabled.
    """
    if mpu_ is not None:
        raise ValueError(
            "checkpointing.configure(mpu_=...) is not supported: fsdpx's tensor parallelism "
            "keeps DTensor activations; pass None"
        )
    section: dict[str, _Any] = {}
    if deepspeed_config is not None:
        from fsdpx.deepspeed._json import load_deepspeed_config

        section = dict(
            load_deepspeed_config(deepspeed_config)[0].get("activation_checkpointing", {})
        )
    if partition_activations is not None:
        section["partition_activations"] = partition_activations
    if checkpoint_in_cpu is not None:
        section["cpu_checkpointing"] = checkpoint_in_cpu
    if section.get("partition_activations"):
        raise ValueError(
            "partition_activations=True (splitting checkpointed activations across "
            "model-parallel ranks) is not supported; set it false"
        )
    if section.get("cpu_checkpointing"):
        raise ValueError(
            "checkpoint_in_cpu / cpu_checkpointing=True (keeping checkpointed activations in "
            "host memory) is not supported; set it false"
        )
    knobs = (contiguous_checkpointing, num_checkpoints, synchronize, profile)
    if any(k is not None for k in knobs) or section:
        _log.info(
            "deepspeed.checkpointing: memory-layout and profiling options are accepted and "
            "do not change results; checkpointing is torch's non-reentrant checkpoint"
        )


__all__ = ["checkpoint", "configure"]
