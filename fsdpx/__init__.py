"""fsdpx: DeepSpeed's feature set on PyTorch's own FSDP2, DTensor and pipelining.

Example::

    import fsdpx
    cfg = fsdpx.Config.from_dict({"zero": {"stage": 2}})
    engine = fsdpx.shard(model, cfg)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()

The names below are imported on first use (PEP 562): `import fsdpx.telemetry.wire.protocol`
(the monitor) must not load torch's distributed runtime just because this package file
runs first. The checkpoint errors are defined by `checkpoint_tools.format` (the format's
one name) and offered here so that `fsdpx.CheckpointError` works.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The public names, listed once: name -> module that defines it (`__all__` is its keys).
# Errors: every name of fsdpx.errors.__all__ (tests/test_errors.py checks it).
_EXPORTS = {
    "AioError": "fsdpx.errors",
    "AuthError": "fsdpx.errors",
    "Axis": "fsdpx.parallel_dims",
    "CheckpointCorruptError": "fsdpx.errors",
    "CheckpointError": "fsdpx.errors",
    "CheckpointFormatError": "fsdpx.errors",
    "CheckpointNotFoundError": "fsdpx.errors",
    "CheckpointVersionError": "fsdpx.errors",
    "Config": "fsdpx.config",
    "DeepSpeedCheckpointError": "fsdpx.errors",
    "DeepSpeedImportError": "fsdpx.errors",
    "DistInfo": "fsdpx.distributed",
    "Engine": "fsdpx.engine",
    "FsdpxError": "fsdpx.errors",
    "LaunchError": "fsdpx.errors",
    "MemoryEstimate": "fsdpx.estimate",
    "NvmeOffloadError": "fsdpx.errors",
    "NvmeOffloadIOError": "fsdpx.errors",
    "ParallelDims": "fsdpx.parallel_dims",
    "ProtocolError": "fsdpx.errors",
    "RankFailureError": "fsdpx.errors",
    "SafetensorsError": "fsdpx.errors",
    "StepResult": "fsdpx.engine",
    "clip_grad_norm_": "fsdpx.clip",
    "estimate_memory": "fsdpx.estimate",
    "init_distributed": "fsdpx.distributed",
    "per_param_init": "fsdpx.materialize",
    "shard": "fsdpx.sharding",
    "total_grad_norm": "fsdpx.clip",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"

# ruff: noqa: F401  (the imports below exist for type checkers, which cannot read _EXPORTS)
if TYPE_CHECKING:
    from fsdpx.clip import clip_grad_norm_, total_grad_norm
    from fsdpx.config import Config
    from fsdpx.distributed import DistInfo, init_distributed
    from fsdpx.engine import Engine, StepResult
    from fsdpx.errors import (
        AioError,
        AuthError,
        CheckpointCorruptError,
        CheckpointError,
        CheckpointFormatError,
        CheckpointNotFoundError,
        CheckpointVersionError,
        DeepSpeedCheckpointError,
        DeepSpeedImportError,
        FsdpxError,
        LaunchError,
        NvmeOffloadError,
        NvmeOffloadIOError,
        ProtocolError,
        RankFailureError,
        SafetensorsError,
    )
    from fsdpx.estimate import MemoryEstimate, estimate_memory
    from fsdpx.materialize import per_param_init
    from fsdpx.parallel_dims import Axis, ParallelDims
    from fsdpx.sharding import shard


# Subpackages reachable as `fsdpx.<name>` after a bare `import fsdpx` (documented usage:
# `fsdpx.shard(model, cfg, loss_fn=fsdpx.sequence.loss_fn)`).
_SUBPACKAGES = ("sequence",)


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"fsdpx.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fsdpx' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBPACKAGES))
