"""Rectangle arithmetic: does a set of pieces tile a tensor, which pieces cover a request.

[Note: coverage by grid cells] The distinct piece boundaries along each dim cut the tensor
into a grid; every piece is a union of whole cells, so "the pieces cover the tensor" is
"every cell is marked", checked on a bool grid of (#cuts_0 - 1) x ... cells. For the
layouts training produces (row or column splits, replicas) the grid has about as many
cells as there are pieces. Replicated pieces (identical rectangles) mark the same cells.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

import torch

MAX_GRID_CELLS = 1 << 24

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def uncovered(shape: tuple[int, ...], boxes: Sequence[Box]) -> tuple[int, ...] | None:
    """Index of an element no box covers, or None when the boxes cover `shape`.

    Raises:
        ValueError: the boxes have too many distinct boundaries to check.
    """
    if numel(shape) == 0:
        return None
    handled, gap = _sweep_one_dim(shape, boxes)
    if handled:
        return gap
    cuts = []
    for d, size in enumerate(shape):
        edges = {0, size}
        for off, shp in boxes:
            edges.add(off[d])
            edges.add(off[d] + shp[d])
        cuts.append(sorted(edges))
    cells = numel([len(c) - 1 for c in cuts])
    if cells > MAX_GRID_CELLS:
        raise ValueError(f"{cells} grid cells exceed the limit of {MAX_GRID_CELLS}")
    grid = torch.zeros([len(c) - 1 for c in cuts], dtype=torch.bool)
    for off, shp in set(boxes):
        if numel(shp) == 0:
            continue
        index = tuple(
            slice(bisect.bisect_left(c, o), bisect.bisect_left(c, o + s))
            for c, o, s in zip(cuts, off, shp, strict=True)
        )
        grid[index] = True
    if bool(grid.all()):
        return None
    first = torch.nonzero(~grid)[0].tolist() if grid.dim() else []
    return tuple(cuts[d][i] for d, i in enumerate(first))


def _sweep_one_dim(
    shape: tuple[int, ...], boxes: Sequence[Box]
) -> tuple[bool, tuple[int, ...] | None]:
    """uncovered() for boxes that span every dim but one (row or column shards, replicas:
    what training writes) by sorting intervals, without a grid: (True, uncovered()'s
    answer), or (False, None) for other layouts.
    (A 1,024-rank layout costs milliseconds here instead of a Python step per box on the
    grid.)"""
    split = -1
    for off, shp in boxes:
        for d, (o, s, g) in enumerate(zip(off, shp, shape, strict=True)):
            if o != 0 or s != g:
                if split not in (-1, d):
                    return False, None
                split = d
    if split == -1:
        return True, (None if boxes else tuple(0 for _ in shape))
    reach = 0
    for lo, hi in sorted((off[split], off[split] + shp[split]) for off, shp in boxes):
        if lo > reach:
            break
        reach = max(reach, hi)
    if reach >= shape[split]:
        return True, None
    return True, tuple(reach if d == split else 0 for d in range(len(shape)))


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None when they do not overlap (or it is empty)."""
    off, shp = [], []
    for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1], strict=True):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        off.append(lo)
        shp.append(hi - lo)
    return tuple(off), tuple(shp)


def c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def blocks(shape: tuple[int, ...], max_elems: int) -> Iterator[Box]:
    """Tile `shape` in C order with boxes of at most max(max_elems, 1) elements, each one
    contiguous in C order: whole trailing dims, a run along one dim, single outer indices."""
    if numel(shape) == 0:
        return
    if not shape:
        yield (), ()
        return
    max_elems = max(1, max_elems)
    # k = first dim whose trailing sub-block fits: iterate dims < k one index at a time,
    # dim k in runs, dims > k whole.
    k = 0
    while k < len(shape) - 1 and numel(shape[k + 1 :]) > max_elems:
        k += 1
    run = max(1, max_elems // numel(shape[k + 1 :]))
    outer = shape[:k]
    for flat in range(numel(outer)):
        idx = []
        for s in reversed(outer):
            idx.append(flat % s)
            flat //= s
        idx.reverse()
        for start in range(0, shape[k], run):
            n = min(run, shape[k] - start)
            yield (
                (*idx, start, *([0] * (len(shape) - k - 1))),
                (*([1] * k), n, *shape[k + 1 :]),
            )
