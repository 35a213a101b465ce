"""The fsdpx checkpoint format (spec: checkpoint_tools/FORMAT.md): writer, reader, errors.

This package imports only torch (tensors), numpy, msgpack, zstandard and the standard
library: never torch.distributed, never the fsdpx runtime, never pickle. It is the one
name of the format: the runtime (`fsdpx/checkpoint/`) and the offline tools both import
the classes below from `checkpoint_tools.format`, and the checkpoint root's rules (tags,
`latest`, committed, fsync) from `checkpoint_tools.format.root`, so `fsdpx-ckpt` starts
without loading the training stack.
"""

from checkpoint_tools.format.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    DeepSpeedCheckpointError,
    DeepSpeedImportError,
)
from checkpoint_tools.format.layout import (
    DTYPES,
    FORMAT_MAJOR,
    FORMAT_MINOR,
    MANIFEST_NAME,
)
from checkpoint_tools.format.names import (
    MODEL_PREFIX,
    OPTIM_PREFIX,
    RANK_PREFIX,
    model_name,
    optim_name,
    rank_optim_prefix,
    split_optim_name,
)
from checkpoint_tools.format.reader import CheckpointReader
from checkpoint_tools.format.schema import Chunk, Piece, RankFile, TensorInfo, TensorMeta
from checkpoint_tools.format.writer import RankWriter, write_manifest

__all__ = [
    "DTYPES",
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "MANIFEST_NAME",
    "MODEL_PREFIX",
    "OPTIM_PREFIX",
    "RANK_PREFIX",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "CheckpointVersionError",
    "Chunk",
    "DeepSpeedCheckpointError",
    "DeepSpeedImportError",
    "Piece",
    "RankFile",
    "RankWriter",
    "TensorInfo",
    "TensorMeta",
    "model_name",
    "optim_name",
    "rank_optim_prefix",
    "split_optim_name",
    "write_manifest",
]
