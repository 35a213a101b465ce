"""The checkpoint error hierarchy. Every failure to read a checkpoint raises one of these.

    CheckpointError                 base class; .path, .tensor, .offset (None when unknown)
    ├── CheckpointNotFoundError     no checkpoint (directory, MANIFEST or `latest` missing)
    ├── CheckpointVersionError      written by a newer, incompatible format major version
    ├── CheckpointFormatError       bytes that do not follow FORMAT.md (bad magic, schema,
    │   │                           names, sizes or layouts that break a MUST rule)
    │   ├── DeepSpeedCheckpointError    a DeepSpeed checkpoint folder where an fsdpx
    │   │                               checkpoint was expected (never "not found")
    │   └── DeepSpeedImportError    a DeepSpeed checkpoint that `fsdpx-ckpt import-deepspeed`
    │                               cannot convert (refused pickle global, truncated or
    │                               missing file, sizes that do not add up)
    └── CheckpointCorruptError      bytes that follow the format but were damaged
                                    (checksum, size or file-identity mismatch)

Readers never let another exception type escape for bad file content: msgpack, zstd and
OS errors are wrapped, so `except CheckpointError` is enough to fall back to an older
checkpoint.
"""

from __future__ import annotations

from pathlib import Path


class CheckpointError(Exception):
    """Base class. Carries the file, tensor and byte offset the problem was found at.

    Args:
        message: what was expected, what was found, what to do.
        path: the file involved (None when the problem is the whole checkpoint).
        tensor: the tensor name involved, if any.
        offset: byte offset in `path` where the problem was found, if known.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | Path | None = None,
        tensor: str | None = None,
        offset: int | None = None,
    ) -> None:
        self.path = None if path is None else str(path)
        self.tensor = tensor
        self.offset = offset
        where = []
        if self.path is not None:
            where.append(f"file {self.path}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        if offset is not None:
            where.append(f"offset {offset}")
        text = f"{message} ({', '.join(where)})" if where else message
        super().__init__(text)


class CheckpointNotFoundError(CheckpointError):
    """The checkpoint (directory, MANIFEST, `latest`, or a named tensor) does not exist."""


class CheckpointVersionError(CheckpointError):
    """A file was written by a newer major format version than this reader supports."""


class CheckpointFormatError(CheckpointError):
    """File content violates the format spec (checkpoint_tools/FORMAT.md)."""


class DeepSpeedCheckpointError(CheckpointFormatError):
    """A DeepSpeed checkpoint folder (`latest` + `<tag>/*_states.pt`) was given where an
    fsdpx checkpoint was expected; see [Note: DeepSpeed folders] in
    checkpoint_tools/format/deepspeed_folder.py."""


class DeepSpeedImportError(CheckpointFormatError):
    """A DeepSpeed checkpoint that cannot be imported: a pickle naming a global outside
    the allow-list, a missing or truncated file, or shapes and partition sizes that do not
    add up (checkpoint_tools/DEEPSPEED.md). Names the file and, where known, the key."""


class CheckpointCorruptError(CheckpointError):
    """File content was damaged after writing: checksum, size or identity mismatch."""
