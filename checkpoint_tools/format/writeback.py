"""Starting the disk write of a file's finished bytes early, without waiting for it.

[Note: early writeback]
A save ends with one fsync per data file. Without help the kernel holds the written pages
in the page cache until its background writeback threshold (dirty_background_ratio, 10%
of free memory: about 12 GB on a 128 GB host, more than a whole rank file), so the final
fsync starts writing the entire file and the save waits for all of it. The writer instead
asks the kernel, every WRITEBACK_BYTES of data, to start writing the previous stretch
(Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`: initiate, do not wait), so the disk
works while later chunks are still encoding and the final fsync waits only for the tail.
It changes no byte and no guarantee: durability still comes from that fsync. Where the
call does not exist (not Linux, no libc symbol) or fails (a file system without it),
nothing happens: it is only a hint, like posix_fadvise.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

WRITEBACK_BYTES = 32 << 20
"""Bytes written between two writeback requests (8 default chunks)."""
_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the process's symbols: libc's included
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Ask the kernel to start writing bytes [offset, offset + nbytes) of `fd` to disk;
    returns at once (the call releases the GIL). False when it could not be asked."""
    fn = _sync_file_range()
    if fn is None or nbytes <= 0:
        return False
    return fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0
