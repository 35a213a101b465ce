"""Giving back the pages of a memory-mapped DeepSpeed file once a run has been written.

[Note: releasing mapped pages]
DeepSpeed files are read memory-mapped (`torch.load(mmap=True)`): pages come in from the
file as the importer touches them and, being file-backed and clean, cost no anonymous
memory, but they stay in the process's resident set until the mapping goes away, i.e.
until the whole file has been converted. `release` tells the kernel, with
`madvise(MADV_DONTNEED)`, that the pages wholly inside a tensor that has been written out
are no longer needed: the kernel drops them, and the resident set stays about one output
chunk instead of one DeepSpeed file. For a private file mapping this only discards clean
copies (a later read would fault them in from the file again, unchanged), so it is only
ever applied to tensors of a memory-mapped load (`mapped=True` in unpickle.load), never
to anonymous memory, where it would zero the data. Linux only; elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import torch

_MADV_DONTNEED = 4
_libc = (
    ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None
)


def release(t: torch.Tensor) -> None:
    """Drop the resident pages wholly inside `t`'s bytes (a view of a mapped file)."""
    if _libc is None or t.device.type != "cpu" or t.numel() == 0:
        return
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    page = mmap.PAGESIZE
    lo = -(-start // page) * page
    hi = end // page * page
    if hi > lo:
        _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)


class Releaser:
    """Gives a written range of a mapped view back to the kernel ([Note: releasing mapped
    pages]) once every name it is written under has it in its file (the writers defer,
    [Note: deferred pieces]); never before, or an encoder would fault the pages back in."""

    def __init__(self, view: torch.Tensor, names: int) -> None:
        self.view, self.names = view, names
        self.left: dict[tuple[int, int], int] = {}

    def __call__(self, a: int, b: int) -> None:
        left = self.left.get((a, b), self.names) - 1
        self.left[(a, b)] = left
        if left == 0:
            release(self.view[a:b])
