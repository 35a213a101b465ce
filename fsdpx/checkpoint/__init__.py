"""Sharded checkpoints: the on-disk format (`fsdpx.checkpoint.format`) and the engine's
save/load on top of it. Spec: checkpoint_tools/FORMAT.md.
"""

import importlib
from typing import TYPE_CHECKING, Any

from fsdpx.checkpoint.format import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointReader,
    CheckpointVersionError,
    RankWriter,
    write_manifest,
)

if TYPE_CHECKING:
    from fsdpx.checkpoint.loading import LoadResult, load
    from fsdpx.checkpoint.saving import Checkpointer, SaveOptions, save

# Imported on first use (PEP 562): `fsdpx.checkpoint.format` alone must not pull in the
# save/load runtime (torch.distributed, the engine's failure handling).
_LAZY = {
    "LoadResult": "fsdpx.checkpoint.loading",
    "load": "fsdpx.checkpoint.loading",
    "Checkpointer": "fsdpx.checkpoint.saving",
    "SaveOptions": "fsdpx.checkpoint.saving",
    "save": "fsdpx.checkpoint.saving",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fsdpx.checkpoint' has no attribute {name!r}")


__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "CheckpointVersionError",
    "Checkpointer",
    "LoadResult",
    "RankWriter",
    "SaveOptions",
    "load",
    "save",
    "write_manifest",
]
