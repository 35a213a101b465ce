"""A run of a tensor's flattened elements as rectangles of the tensor.

[Note: flat ranges as pieces]
DeepSpeed's ZeRO partitions cut each parameter group's flat (1-D, row-major) vector at
arbitrary element boundaries, so one rank holds a *run* `[start, stop)` of a parameter's
flattened elements. The fsdpx format stores rectangles (FORMAT.md §3.1), and a run is a
union of at most `2 * ndim - 1` of them: a partial row at each end of every dim, and one
block of whole rows in the middle. Each rectangle is itself a contiguous run of the
flat vector, so the importer writes it straight from a view of DeepSpeed's flat
partition, without copying the parameter together first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Rect = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, shape) of a rectangle."""


def max_pieces(ndim: int) -> int:
    """The most rectangles flat_rectangles returns for a tensor with `ndim` dims."""
    return max(1, 2 * ndim - 1)


def flat_rectangles(start: int, stop: int, shape: Sequence[int]) -> list[Rect]:
    """The rectangles covering flat elements `[start, stop)` of a tensor of `shape`, in
    flat order. Empty when `start == stop`.

    Example::

        flat_rectangles(2, 7, (3, 3))
        # [((0, 2), (1, 1)), ((1, 0), (1, 3)), ((2, 0), (1, 1))]
    """
    shape = tuple(int(s) for s in shape)
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"flat range [{start}, {stop}) is not inside shape {shape}")
    if start == stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    rest = shape[1:]
    first, last = start // inner, (stop - 1) // inner
    if first == last:  # inside one row: recurse into it
        return [
            ((first, *o), (1, *s))
            for o, s in flat_rectangles(start - first * inner, stop - first * inner, rest)
        ]
    out: list[Rect] = []
    full_from = first
    if start % inner:
        out += [((first, *o), (1, *s)) for o, s in flat_rectangles(start % inner, inner, rest)]
        full_from = first + 1
    full_to = last + 1 if stop % inner == 0 else last
    if full_to > full_from:
        out.append(((full_from, *(0,) * len(rest)), (full_to - full_from, *rest)))
    if stop % inner:
        out += [((last, *o), (1, *s)) for o, s in flat_rectangles(0, stop % inner, rest)]
    return out
