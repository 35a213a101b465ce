"""fsdpx: DeepSpeed's feature set on PyTorch's own FSDP2, DTensor and pipelining.

Example::

    import fsdpx
    cfg = fsdpx.Config.from_dict({"zero": {"stage": 2}})
    engine = fsdpx.shard(model, cfg)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()

The names below are imported on first use (PEP 562): `import fsdpx.telemetry.protocol`
(the monitor) must not load torch's distributed runtime just because this package file
runs first. The checkpoint errors are defined by `checkpoint_tools.format` (the format's
one name) and offered here so that `fsdpx.CheckpointError` works.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> module that defines it
_EXPORTS = {
    "Axis": "fsdpx.parallel_dims",
    "CheckpointCorruptError": "checkpoint_tools.format",
    "CheckpointError": "checkpoint_tools.format",
    "CheckpointNotFoundError": "checkpoint_tools.format",
    "Config": "fsdpx.config",
    "DeepSpeedCheckpointError": "checkpoint_tools.format",
    "DistInfo": "fsdpx.distributed",
    "Engine": "fsdpx.engine",
    "FsdpxError": "fsdpx.errors",
    "MemoryEstimate": "fsdpx.estimate",
    "ParallelDims": "fsdpx.parallel_dims",
    "RankFailureError": "fsdpx.errors",
    "StepResult": "fsdpx.engine",
    "clip_grad_norm_": "fsdpx.clip",
    "estimate_memory": "fsdpx.estimate",
    "init_distributed": "fsdpx.distributed",
    "per_param_init": "fsdpx.materialize",
    "shard": "fsdpx.shard",
    "total_grad_norm": "fsdpx.clip",
}

__all__ = [
    "Axis",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "Config",
    "DeepSpeedCheckpointError",
    "DistInfo",
    "Engine",
    "FsdpxError",
    "MemoryEstimate",
    "ParallelDims",
    "RankFailureError",
    "StepResult",
    "clip_grad_norm_",
    "estimate_memory",
    "init_distributed",
    "per_param_init",
    "shard",
    "total_grad_norm",
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from checkpoint_tools.format import (
        CheckpointCorruptError,
        CheckpointError,
        CheckpointNotFoundError,
        DeepSpeedCheckpointError,
    )
    from fsdpx.clip import clip_grad_norm_, total_grad_norm
    from fsdpx.config import Config
    from fsdpx.distributed import DistInfo, init_distributed
    from fsdpx.engine import Engine, StepResult
    from fsdpx.errors import FsdpxError, RankFailureError
    from fsdpx.estimate import MemoryEstimate, estimate_memory
    from fsdpx.materialize import per_param_init
    from fsdpx.parallel_dims import Axis, ParallelDims
    from fsdpx.shard import shard


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fsdpx' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
