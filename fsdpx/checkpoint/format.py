"""The checkpoint file format, as used by the runtime (spec: checkpoint_tools/FORMAT.md).

The implementation lives in `checkpoint_tools.format`, the package the offline tools
import, so that reading a checkpoint never needs the training runtime. This module is the
runtime's stable name for it: both names refer to the same classes.

Example::

    from fsdpx.checkpoint.format import CheckpointReader, RankWriter, write_manifest
"""

from checkpoint_tools.format import *  # noqa: F403  (the re-export is the point)
from checkpoint_tools.format import __all__ as __all__
