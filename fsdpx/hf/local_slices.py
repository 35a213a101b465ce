"""Which elements of a global tensor a rank's shard holds, as row-major byte runs.

[Note: shard rectangles] A DTensor's local tensor holds, per dimension, a list of global
indices: a `Shard(d)` placement keeps one contiguous slice of the indices left by the
mesh dimensions before it, a `_StridedShard(d)` (FSDP over tensor parallel on the same
dim) keeps an interleaved subset. The index lists are computed the way torch's
`_compute_local_shape_and_global_offset` does, keeping every index instead of the first
one (torch's own function returns only the offset, which is wrong for strided shards).
A dimension that is whole or cut by `Shard` stays a `range` (no list of every index: a
32000-row embedding would otherwise make 32000 int objects per load, whose freed blocks
stay in the interpreter's arenas); only `_StridedShard` makes a list. The local tensor is
the row-major product of those lists, so its elements come from runs of consecutive
global elements: every dimension after the last split one is whole, and each consecutive
stretch of the split dimension, for each combination of outer indices, is one run.
Adjacent runs are merged.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard, _StridedShard

try:
    from torch.distributed.tensor.placement_types import _StridedShardOffsetMode
except ImportError:  # torch < 2.13 (a GPU image's older torch): no FSDP-over-TP loads
    _StridedShardOffsetMode = None  # type: ignore[assignment,misc]

__all__ = ["element_runs", "local_index_lists", "split_runs"]


def local_index_lists(tensor: torch.Tensor) -> list[Sequence[int]]:
    """Per dimension, the global indices this rank's local tensor holds, in local order
    (a `range` unless a strided shard interleaves them). A plain tensor holds everything."""
    shape = tuple(tensor.shape)
    idx: list[Sequence[int]] = [range(n) for n in shape]
    if not isinstance(tensor, DTensor):
        return idx
    mesh = tensor.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:  # not part of the mesh: holds nothing
        return [[] for _ in shape]
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, _StridedShard):
            if _StridedShardOffsetMode is None:
                raise NotImplementedError(
                    f"loading into FSDP-over-TP shards needs torch >= 2.13, this is {torch.__version__}"
                )
            size, offsets = placement._local_shard_size_and_offset(
                len(idx[placement.dim]),
                mesh.size(mesh_dim),
                coord[mesh_dim],
                _StridedShardOffsetMode.ALL,
            )
            assert isinstance(offsets, list) or size == 0
            picked = offsets if isinstance(offsets, list) else []
            idx[placement.dim] = [idx[placement.dim][i] for i in picked[:size]]
        elif isinstance(placement, Shard):
            size, offset = placement._local_shard_size_and_offset(
                len(idx[placement.dim]), mesh.size(mesh_dim), coord[mesh_dim]
            )
            assert isinstance(offset, int)
            idx[placement.dim] = idx[placement.dim][offset : offset + size]
    return idx


def _consecutive(indices: Sequence[int]) -> list[tuple[int, int]]:
    """[3, 4, 5, 9, 10] -> [(3, 3), (9, 2)]: (first, length) of each consecutive stretch."""
    if isinstance(indices, range) and indices.step == 1:
        return [(indices.start, len(indices))] if indices else []
    if indices and list(indices) == list(range(indices[0], indices[0] + len(indices))):
        return [(indices[0], len(indices))]  # one stretch: one run, compared in C
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _whole(indices: Sequence[int], n: int) -> bool:
    """Whether `indices` is every index 0..n-1 in order."""
    if isinstance(indices, range):
        return indices == range(n)  # compares as sequences, in O(1)
    return list(indices) == list(range(n))


def element_runs(shape: tuple[int, ...], idx: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """(first element, element count) runs, in the local tensor's row-major order, of the
    global row-major tensor of `shape` restricted to the index lists `idx`."""
    if any(len(i) == 0 for i in idx):
        return []
    if not shape:
        return [(0, 1)]
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    # j: the last dimension that is not whole; every dimension after it is.
    j = 0
    for d in range(len(shape)):
        if not _whole(idx[d], shape[d]):
            j = d
    inner = _consecutive(idx[j])
    runs: list[tuple[int, int]] = []
    for outer in itertools.product(*idx[:j]):
        base = sum(i * s for i, s in zip(outer, strides, strict=False))
        for first, length in inner:
            start, count = base + first * strides[j], length * strides[j]
            if runs and runs[-1][0] + runs[-1][1] == start:
                runs[-1] = (runs[-1][0], runs[-1][1] + count)
            else:
                runs.append((start, count))
    return runs


def split_runs(runs: list[tuple[int, int]], limit: int) -> Iterator[list[tuple[int, int]]]:
    """`runs` in order, in groups of at most `limit` elements each (a run longer than the
    room left is cut in two), for reading through a buffer of `limit` elements."""
    group: list[tuple[int, int]] = []
    room = limit
    for start, count in runs:
        while count > 0:
            take = min(count, room)
            group.append((start, take))
            start, count, room = start + take, count - take, room - take
            if room == 0:
                yield group
                group, room = [], limit
    if group:
        yield group
