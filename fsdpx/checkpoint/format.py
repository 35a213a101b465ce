"""The checkpoint file format, as used by the runtime (spec: checkpoint_tools/FORMAT.md).

The implementation lives in `checkpoint_tools.format` so the offline tools can read and
write checkpoints without importing the fsdpx runtime (importing any `fsdpx.*` module runs
`fsdpx/__init__`, which loads the engine and torch.distributed machinery). This module is
the runtime's stable name for it; both names refer to the same classes.

Example::

    from fsdpx.checkpoint.format import CheckpointReader, RankWriter, write_manifest
"""

from checkpoint_tools.format import (
    DTYPES,
    FORMAT_MAJOR,
    FORMAT_MINOR,
    MANIFEST_NAME,
    MODEL_PREFIX,
    OPTIM_PREFIX,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointReader,
    CheckpointVersionError,
    Chunk,
    Piece,
    RankFile,
    RankWriter,
    TensorMeta,
    model_name,
    optim_name,
    split_optim_name,
    write_manifest,
)

__all__ = [
    "DTYPES",
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "MANIFEST_NAME",
    "MODEL_PREFIX",
    "OPTIM_PREFIX",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "CheckpointVersionError",
    "Chunk",
    "Piece",
    "RankFile",
    "RankWriter",
    "TensorMeta",
    "model_name",
    "optim_name",
    "split_optim_name",
    "write_manifest",
]
