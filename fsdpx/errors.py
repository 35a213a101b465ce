"""Every error fsdpx raises for a user to catch, in one place. Each is also `fsdpx.<Name>`.

    ValueError                      bad input: a config value or key (with a did-you-mean),
    │                               an argument; config errors are plain ValueErrors
    ├── NvmeOffloadError            ``nvme_path`` unusable: missing, not a directory, not
    │                               writable, too little space, swap file in use
    ├── LaunchError                 `fsdpx launch` cannot start as asked (hostfile, filters)
    └── SafetensorsError            a safetensors file that is not what it claims (fsdpx.hf)
    OSError
    ├── NvmeOffloadIOError          a read or write of the NVMe swap file failed;
    │                               .errno, .filename, .offset
    └── AioError                    an asynchronous file read/write (fsdpx.ops.aio) failed;
                                    .errno, .filename
    RuntimeError
    └── FsdpxError                  base of fsdpx's runtime failures
        └── RankFailureError        another rank failed; this one stops (.failed_rank)
    Exception
    ├── CheckpointError             reading a checkpoint failed; .path, .tensor, .offset
    │   ├── CheckpointNotFoundError     no checkpoint (directory, MANIFEST or `latest`)
    │   ├── CheckpointVersionError      written by a newer, incompatible format version
    │   ├── CheckpointFormatError       bytes that break checkpoint_tools/FORMAT.md
    │   │   ├── DeepSpeedCheckpointError    a DeepSpeed checkpoint folder, not fsdpx's
    │   │   └── DeepSpeedImportError    `fsdpx-ckpt import-deepspeed` refused the input
    │   └── CheckpointCorruptError      bytes damaged after writing (checksum, size)
    └── ProtocolError               a telemetry frame or message breaks monitor/PROTOCOL.md
        └── AuthError               a failed telemetry handshake or a wrong HMAC tag

`NotImplementedError` means a feature fsdpx does not have yet; its message says what to
use instead. A test (tests/test_errors.py) walks every module of fsdpx and
checkpoint_tools and fails if an exception class defined there is missing here or from
`fsdpx`.

[Note: one error tree] This module is imported by the runtime's lowest layers, so it
imports nothing from fsdpx and nothing heavy. The errors fsdpx owns are defined here
(`fsdpx.offload.nvme` and `fsdpx.ops.aio` import theirs from this module). Two families
keep their home and are re-exported on first use (PEP 562): the checkpoint errors live in
`checkpoint_tools.format.errors`, because checkpoint_tools never imports fsdpx (and
importing it loads torch), and the telemetry wire errors in `fsdpx.telemetry.wire.protocol`,
because the torch-free monitor imports only the wire modules. The classes are the same
objects under every name, so `except fsdpx.CheckpointError` catches what
`checkpoint_tools` raises.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Defined elsewhere (see [Note: one error tree]): name -> module that defines it.
_ELSEWHERE = {
    "AuthError": "fsdpx.telemetry.wire.protocol",
    "CheckpointCorruptError": "checkpoint_tools.format.errors",
    "CheckpointError": "checkpoint_tools.format.errors",
    "CheckpointFormatError": "checkpoint_tools.format.errors",
    "CheckpointNotFoundError": "checkpoint_tools.format.errors",
    "CheckpointVersionError": "checkpoint_tools.format.errors",
    "DeepSpeedCheckpointError": "checkpoint_tools.format.errors",
    "DeepSpeedImportError": "checkpoint_tools.format.errors",
    "ProtocolError": "fsdpx.telemetry.wire.protocol",
}

# Defined below, and the re-exported ones.
__all__ = sorted(
    [
        "AioError",
        "FsdpxError",
        "LaunchError",
        "NvmeOffloadError",
        "NvmeOffloadIOError",
        "RankFailureError",
        "SafetensorsError",
    ]
    + list(_ELSEWHERE)
)

if TYPE_CHECKING:  # the same classes for type checkers (`X as X`: an explicit re-export)
    from checkpoint_tools.format.errors import CheckpointCorruptError as CheckpointCorruptError
    from checkpoint_tools.format.errors import CheckpointError as CheckpointError
    from checkpoint_tools.format.errors import CheckpointFormatError as CheckpointFormatError
    from checkpoint_tools.format.errors import (
        CheckpointNotFoundError as CheckpointNotFoundError,
    )
    from checkpoint_tools.format.errors import CheckpointVersionError as CheckpointVersionError
    from checkpoint_tools.format.errors import (
        DeepSpeedCheckpointError as DeepSpeedCheckpointError,
    )
    from checkpoint_tools.format.errors import DeepSpeedImportError as DeepSpeedImportError
    from fsdpx.telemetry.wire.protocol import AuthError as AuthError
    from fsdpx.telemetry.wire.protocol import ProtocolError as ProtocolError


def __getattr__(name: str) -> Any:
    module = _ELSEWHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'fsdpx.errors' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_ELSEWHERE))


class FsdpxError(RuntimeError):
    """Base class of fsdpx's runtime failures (not of bad-input ValueErrors)."""


class RankFailureError(FsdpxError):
    """Another rank of the job failed; this rank stops instead of waiting forever.

    Raised by engine calls on the ranks that did not fail, within the process-group
    timeout (Config.timeout_s). The failing rank itself raises its own error unchanged.
    See [Note: rank failure] in fsdpx/distributed.py.

    `failed_rank` is the rank that failed first when it recorded its error (it raised
    inside an engine call) or when a rank on its host found its process gone (it was
    killed: SIGKILL, the out-of-memory killer, os._exit); else None (it stalled without
    raising, or was killed alone on another host). The message names that rank and its
    error or its pid, or quotes the collective's error.

    Example::

        try:
            engine.backward(loss)
        except fsdpx.RankFailureError as e:
            log.error("stopping: rank %s failed", e.failed_rank)
            raise
    """

    def __init__(self, message: str, *, failed_rank: int | None = None) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank


class LaunchError(ValueError):
    """A launch that cannot start as asked (`fsdpx launch`): the message says what was wrong
    and what to do."""


class SafetensorsError(ValueError):
    """A safetensors file that cannot be read as it claims (names file and tensor)."""


class NvmeOffloadError(ValueError):
    """``nvme_path`` is unusable: missing, not a directory, not writable, too little free
    space, or its swap file is in use by another process or engine."""


class NvmeOffloadIOError(OSError):
    """A read or write of the NVMe offload swap file failed (disk full, I/O error...).

    ``filename``, ``offset`` (bytes) and ``errno`` say where and why.
    """

    def __init__(
        self,
        message: str,
        errno_: int | None = None,
        filename: str | None = None,
        offset: int | None = None,
    ) -> None:
        super().__init__(message)
        self.errno = errno_
        self.filename = filename
        self.offset = offset

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple[Any, ...]:
        # OSError's own reduce rebuilds from (errno, strerror, filename); keep our fields.
        return (type(self), (self.args[0], self.errno, self.filename, self.offset))


class AioError(OSError):
    """An asynchronous read or write (`fsdpx.ops.aio`) failed; ``errno`` and ``filename``
    are set when known."""

    def __str__(self) -> str:
        # OSError would print "[Errno N] strerror: filename"; the message already says more.
        return str(self.args[0])
