"""Opening checkpoint files safely and reading verified chunk frames.

Files are opened only by their canonical names inside the checkpoint directory, with
O_NOFOLLOW (a symlink planted in a checkpoint cannot redirect a read), and must be regular
files. A data file is checked (size, magic, version, flags, file id) before any chunk is
read from it, and every chunk's CRC-32 before it is returned.
"""

from __future__ import annotations

import os
import stat
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from checkpoint_tools.format.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
)
from checkpoint_tools.format.layout import DATA_HEADER, DATA_MAGIC, check_version
from checkpoint_tools.format.schema import Chunk, RankFile


def open_inside(directory: Path, name: str) -> BinaryIO:
    """Open `directory/name` read-only, refusing symlinks and non-regular files.

    Raises:
        CheckpointNotFoundError: no such file. CheckpointFormatError: a symlink, a
            directory, a device, or any other open failure.
    """
    path = directory / name
    try:
        # O_NONBLOCK: opening a FIFO planted under a checkpoint name must not hang (it is
        # then refused as not a regular file); regular files ignore the flag.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"missing checkpoint file {name!r}", path=path) from None
    except OSError as exc:
        raise CheckpointFormatError(
            f"cannot open {name!r} as a regular file ({exc.strerror}; symlinks are refused)",
            path=path,
        ) from None
    # Checked on the descriptor before wrapping it: open() itself refuses a directory
    # with IsADirectoryError, which is not a CheckpointError.
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointFormatError(f"{name!r} is not a regular file", path=path)
    return open(fd, "rb", buffering=0)  # noqa: SIM115 - owned by the caller


def read_whole(directory: Path, name: str, limit: int) -> bytes:
    """The whole content of a small file (index, MANIFEST), refused above `limit` bytes
    before anything is read."""
    with open_inside(directory, name) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise CheckpointFormatError(
                f"file is {size} bytes, above the {limit}-byte limit for this kind of file",
                path=directory / name,
            )
        data = f.read(size + 1)
    return data


class DataFiles:
    """The data files of one checkpoint, opened and checked on first use."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        # (major, minor) of each rank's index; its data header must carry the same.
        self.versions: dict[int, tuple[int, int]] = {}
        self._files: dict[int, BinaryIO] = {}
        self._lock = threading.Lock()  # reader threads open each file once

    def _open(self, rf: RankFile) -> BinaryIO:
        f = self._files.get(rf.rank)
        if f is not None:
            return f
        with self._lock:
            f = self._files.get(rf.rank)
            return f if f is not None else self._open_checked(rf)

    def _open_checked(self, rf: RankFile) -> BinaryIO:
        path = self.directory / rf.data_file
        f = open_inside(self.directory, rf.data_file)
        try:
            size = os.fstat(f.fileno()).st_size
            if size != rf.data_size:
                raise CheckpointCorruptError(
                    f"data file is {size} bytes, the MANIFEST expects {rf.data_size} "
                    "(truncated or replaced)",
                    path=path,
                    offset=min(size, rf.data_size),
                )
            head = os.pread(f.fileno(), DATA_HEADER.size, 0)
            magic, major, minor, flags, file_id = DATA_HEADER.unpack(head)
            if magic != DATA_MAGIC:
                raise CheckpointFormatError(
                    f"expected magic {DATA_MAGIC!r}, found {magic!r}", path=path, offset=0
                )
            check_version(path, major, minor)
            expected = self.versions.get(rf.rank)
            if (major, minor) != expected:
                # The data header has no checksum of its own; tying its version to the
                # (checksummed) index's makes every header byte verifiable.
                raise CheckpointCorruptError(
                    f"data header says format {major}.{minor}, its index says "
                    f"{expected[0]}.{expected[1]}"
                    if expected
                    else "no index version known",
                    path=path,
                    offset=8,
                )
            if flags != 0:
                raise CheckpointFormatError(
                    f"data header flags must be 0 in format 1.x, found {flags}",
                    path=path,
                    offset=12,
                )
            if file_id != rf.file_id:
                raise CheckpointCorruptError(
                    "data file id does not match its index: the file belongs to another rank "
                    "or checkpoint (swapped or stale file)",
                    path=path,
                    offset=16,
                )
        except BaseException:
            f.close()
            raise
        self._files[rf.rank] = f
        return f

    def stored(
        self,
        rf: RankFile,
        chunk: Chunk,
        name: str,
        buf: np.ndarray,
        crc32: Callable[[memoryview], int] = zlib.crc32,
    ) -> memoryview:
        """The stored bytes of `chunk` of tensor `name`, read into `buf` (at least
        chunk.stored_size bytes) and checked with `crc32` (the injected kernels' CRC); the
        view is valid while `buf` is unchanged."""
        path = self.directory / rf.data_file
        try:
            n = os.preadv(self._open(rf).fileno(), [buf.data], chunk.offset)
        except OSError as exc:
            raise CheckpointCorruptError(
                f"cannot read chunk ({exc.strerror})", path=path, tensor=name, offset=chunk.offset
            ) from None
        view = buf.data[:n]
        if n != chunk.stored_size or crc32(view) != chunk.crc32:
            raise CheckpointCorruptError(
                f"chunk of {chunk.stored_size} bytes fails its CRC-32 check (expected "
                f"{chunk.crc32:#010x}): the data file is damaged; verify older checkpoints",
                path=path,
                tensor=name,
                offset=chunk.offset,
            )
        return view

    def close(self) -> None:
        files, self._files = self._files, {}
        for f in files.values():
            f.close()
