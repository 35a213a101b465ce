"""Sharded checkpoints: the engine's save/load on top of the on-disk format.

The format itself (reader, writer, errors) has one name, `checkpoint_tools.format`, and
the checkpoint root's rules (tags, `latest`, committed, fsync) are
`checkpoint_tools.format.root`; spec: checkpoint_tools/FORMAT.md.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsdpx.checkpoint.loading import LoadResult, load
    from fsdpx.checkpoint.saving import Checkpointer, SaveOptions, save

# Imported on first use (PEP 562): importing a submodule (`fsdpx.checkpoint.commit`) must
# not pull in the whole save/load runtime (torch.distributed, the engine's failure handling).
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
    "Checkpointer",
    "LoadResult",
    "SaveOptions",
    "load",
    "save",
]
