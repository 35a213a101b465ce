"""The MANIFEST's tensor table (format 1.2): which rank holds which rectangle of which
tensor, so a reader opens only the indexes of the ranks it reads from.

[Note: tensor table] Before 1.2 a reader learnt where the pieces are by reading every
rank's index: at 1,024 ranks every loading rank parsed 1,024 indexes (47-65 s per rank
with a synthetic 100-tensor index, benchmarks/checkpoint_codec.py), although a rank
loading at the same world size needs only its own. From 1.2 the MANIFEST, which every
reader reads anyway, also lists each tensor's name, dtype, global shape and *layout*: the
`[rank, offsets, shape]` rectangles of its pieces, without chunk lists. Tensors with the
same rectangles share one layout (every layer's weights of one shape, their Adam moments),
so the table grows with tensors + distinct layouts x ranks, not tensors x ranks. A reader
checks the table once (names, dtypes, every layout covers its tensor) and then reads an
index only when a requested rectangle needs one of that rank's pieces; every index it
does read must agree with the table exactly (same pieces, dtypes and shapes, the same
number of them), so damage that passes the checksums still cannot make the two disagree
unnoticed. Without the table (1.0 / 1.1 MANIFESTs) a reader reads every index, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch

from checkpoint_tools.format.coverage import Box, intersect, uncovered
from checkpoint_tools.format.errors import CheckpointFormatError
from checkpoint_tools.format.layout import DTYPES, MAX_NDIM, check_tensor_name
from checkpoint_tools.format.schema import Piece, _get, _ints

# The MANIFEST minor version that introduced the tensor table.
ROUTING_MINOR = 2

Entry = tuple[int, Box]  # (rank, (offsets, shape))
_LIMIT = 1 << 62


def build_routing(rank_pieces: Sequence[Sequence[Sequence[Any]]]) -> dict[str, Any]:
    """The MANIFEST keys `tensors` and `layouts` from every rank's piece summaries
    (`rank_pieces[r]`: rank r's `[name, dtype, global_shape, offsets, shape]` lists in
    write order). Tensors come in the reader's `names()` order: rank 0's, then names
    only later ranks hold.

    Raises:
        ValueError: two ranks store one tensor with different dtypes or global shapes
            (no reader would accept the checkpoint).
    """
    order: dict[str, int] = {}
    heads: list[list[Any]] = []  # [name, dtype, global_shape]
    entries: list[list[list[Any]]] = []
    for rank, pieces in enumerate(rank_pieces):
        for name, dtype, gshape, offsets, shape in pieces:
            i = order.get(name)
            if i is None:
                i = order[name] = len(heads)
                heads.append([name, dtype, list(gshape)])
                entries.append([])
            elif heads[i][1] != dtype or heads[i][2] != list(gshape):
                raise ValueError(
                    f"tensor {name!r}: rank {rank} stores dtype {dtype} shape {list(gshape)}, "
                    f"an earlier rank {heads[i][1]} shape {heads[i][2]}; every rank must "
                    "save a tensor with the same dtype and global shape"
                )
            entries[i].append([rank, list(offsets), list(shape)])
    layouts: list[list[list[Any]]] = []
    ids: dict[bytes, int] = {}
    tensors = []
    for head, ents in zip(heads, entries, strict=True):
        key = msgpack.packb(ents)  # identical rectangles, identical bytes: one layout
        lid = ids.get(key)
        if lid is None:
            lid = ids[key] = len(layouts)
            layouts.append(ents)
        tensors.append([*head, lid])
    return {"tensors": tensors, "layouts": layouts}


@dataclass(frozen=True)
class Route:
    """One tensor of the table: dtype, global shape, and its layout's number."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: int


class Routing:
    """The validated tensor table of one MANIFEST."""

    def __init__(
        self, tensors: dict[str, Route], layouts: list[tuple[Entry, ...]], path: Path
    ) -> None:
        self.tensors = tensors
        self.layouts = layouts
        self.path = path
        self._by_rank = [{rank: box for rank, box in layout} for layout in layouts]
        uses = [0] * len(layouts)
        for route in tensors.values():
            uses[route.layout] += 1
        self._uses = uses
        self._chosen: dict[tuple[int, Box, int | None], list[Entry]] = {}

    def entries(self, name: str) -> tuple[Entry, ...]:
        """Every (rank, rectangle) of tensor `name`, in rank order."""
        return self.layouts[self.tensors[name].layout]

    def select(self, name: str, want: Box, prefer_rank: int | None) -> list[Entry]:
        """The pieces a read of rectangle `want` of `name` takes (one per distinct
        rectangle overlapping it); cached per layout, since tensors of one layout are
        read with the same rectangle (a rank's shard)."""
        layout = self.tensors[name].layout
        if prefer_rank is not None and self._by_rank[layout].get(prefer_rank) == want:
            return [(prefer_rank, want)]  # its own piece is the rectangle: nothing else
        key = (layout, want, prefer_rank)
        hit = self._chosen.get(key)
        if hit is None:
            if len(self._chosen) >= 4096:  # bounded: a tool reading many rectangles
                self._chosen.clear()
            hit = self._chosen[key] = choose(self.layouts[key[0]], want, prefer_rank)
        return hit

    def check_index(
        self,
        rank: int,
        pieces: list[tuple[str, torch.dtype, tuple[int, ...], Piece]],
        path: Path,
    ) -> None:
        """Refuse rank `rank`'s parsed index unless it holds exactly the pieces the table
        lists for that rank ([Note: tensor table])."""
        for name, dtype, gshape, piece in pieces:
            route = self.tensors.get(name)
            if route is None:
                raise CheckpointFormatError(
                    "the index holds a tensor the MANIFEST's tensor table does not list",
                    path=path,
                    tensor=name,
                )
            if route.dtype != dtype or route.shape != gshape:
                raise CheckpointFormatError(
                    f"rank {rank} stores dtype {dtype} shape {gshape}, the MANIFEST's tensor "
                    f"table says dtype {route.dtype} shape {route.shape}",
                    path=path,
                    tensor=name,
                )
            listed = self._by_rank[route.layout].get(rank)
            if listed != (piece.offsets, piece.shape):
                raise CheckpointFormatError(
                    f"rank {rank} stores the piece at offsets {piece.offsets} with shape "
                    f"{piece.shape}, the MANIFEST's tensor table lists "
                    f"{'no piece of rank ' + str(rank) if listed is None else listed}",
                    path=path,
                    tensor=name,
                )
        listed_count = sum(
            uses for by_rank, uses in zip(self._by_rank, self._uses, strict=True) if rank in by_rank
        )
        if listed_count != len(pieces):
            raise CheckpointFormatError(
                f"rank {rank}'s index holds {len(pieces)} pieces, the MANIFEST's tensor table "
                f"lists {listed_count} for it",
                path=path,
            )


def choose(entries: Iterable[Entry], want: Box, prefer_rank: int | None) -> list[Entry]:
    """One (rank, rectangle) per distinct rectangle overlapping `want`: replicas hold
    identical values (FORMAT.md §5), so any one will do; `prefer_rank`'s own piece when it
    holds one (its own files), else the lowest rank's."""
    chosen: dict[Box, int] = {}
    for rank, box in entries:
        if box in chosen:
            if rank == prefer_rank:
                chosen[box] = rank
            continue
        if intersect(box, want) is not None:
            chosen[box] = rank
    return [(rank, box) for box, rank in chosen.items()]


def parse_routing(body: dict[Any, Any], minor: int, world_size: int, path: Path) -> Routing | None:
    """The tensor table of a decoded MANIFEST body (format 1.`minor`), validated: None when
    the MANIFEST has none (before 1.2 the keys mean nothing and are ignored).

    Raises:
        CheckpointFormatError: a malformed table, or a layout that does not tile its
            tensor (checked once per layout and global shape).
    """
    if minor < ROUTING_MINOR or ("tensors" not in body and "layouts" not in body):
        return None
    raw_layouts = _get(body, "layouts", list, path, "MANIFEST")
    raw_tensors = _get(body, "tensors", list, path, "MANIFEST")
    layouts = [_layout(raw, i, world_size, path) for i, raw in enumerate(raw_layouts)]
    tensors: dict[str, Route] = {}
    checked: set[tuple[int, tuple[int, ...]]] = set()
    for i, raw in enumerate(raw_tensors):
        where = f"MANIFEST tensor table entry {i}"
        if not (isinstance(raw, list) and len(raw) == 4):
            raise CheckpointFormatError(
                f"{where}: expected [name, dtype, global_shape, layout]", path=path
            )
        name, dname, lid = raw[0], raw[1], raw[3]
        why = check_tensor_name(name)
        if why is not None:
            raise CheckpointFormatError(f"{where}: invalid tensor name {name!r}: {why}", path=path)
        if name in tensors:
            raise CheckpointFormatError(
                f"{where}: the tensor is listed twice", path=path, tensor=name
            )
        if not isinstance(dname, str) or dname not in DTYPES:
            raise CheckpointFormatError(
                f"{where}: unknown dtype {dname!r}; known: {sorted(DTYPES)}", path=path, tensor=name
            )
        shape = _ints(raw[2], path, f"{where} global_shape")
        if type(lid) is not int or not 0 <= lid < len(layouts):
            raise CheckpointFormatError(
                f"{where}: layout {lid!r} is not one of the {len(layouts)} layouts",
                path=path,
                tensor=name,
            )
        if (lid, shape) not in checked:
            _check_tiles(layouts[lid], shape, path, name)
            checked.add((lid, shape))
        tensors[name] = Route(DTYPES[dname], shape, lid)
    return Routing(tensors, layouts, path)


def _layout(raw: Any, i: int, world_size: int, path: Path) -> tuple[Entry, ...]:
    """One layout, validated entry by entry with inline checks (a 1,024-rank table has
    ~10^5 entries when no two tensors share a layout: per-entry calls would dominate)."""
    where = f"MANIFEST layout {i}"
    if not isinstance(raw, list) or not raw:
        raise CheckpointFormatError(f"{where}: expected a non-empty list of pieces", path=path)
    out: list[Entry] = []
    last, ndim = -1, -1
    for e in raw:
        if not (type(e) is list and len(e) == 3 and type(e[0]) is int):
            raise CheckpointFormatError(
                f"{where}: expected [rank, offsets, shape] entries", path=path
            )
        rank, offsets, shape = e
        # Ranks strictly increase: a rank holds at most one piece of a tensor.
        if not last < rank < world_size:
            raise CheckpointFormatError(
                f"{where}: rank {rank} out of order or outside [0, {world_size})", path=path
            )
        last = rank
        if ndim == -1 and type(offsets) is list:
            ndim = len(offsets)
        if not (
            type(offsets) is list
            and type(shape) is list
            and len(offsets) == len(shape) == ndim <= MAX_NDIM
            and all(type(v) is int and 0 <= v < _LIMIT for v in offsets)
            and all(type(v) is int and 0 <= v < _LIMIT for v in shape)
        ):
            raise CheckpointFormatError(
                f"{where}: rank {rank}'s offsets {offsets!r} and shape {shape!r} must be "
                f"lists of ints in [0, 2**62), with the same number of dims as the layout's "
                "other pieces (at most 64)",
                path=path,
            )
        out.append((rank, (tuple(offsets), tuple(shape))))
    return tuple(out)


def _check_tiles(layout: tuple[Entry, ...], shape: tuple[int, ...], path: Path, name: str) -> None:
    boxes = [box for _, box in layout]
    for off, shp in boxes:
        if len(off) != len(shape) or any(
            o + s > g for o, s, g in zip(off, shp, shape, strict=True)
        ):
            raise CheckpointFormatError(
                f"the tensor table puts a piece at offsets {off} with shape {shp} in a tensor "
                f"of shape {shape}",
                path=path,
                tensor=name,
            )
    try:
        gap = uncovered(shape, boxes)
    except ValueError as exc:
        raise CheckpointFormatError(f"cannot check piece coverage: {exc}", tensor=name) from None
    if gap is not None:
        raise CheckpointFormatError(
            f"the pieces of this {shape} tensor leave element {gap} uncovered (a rank's "
            "files are missing or the checkpoint was written incompletely)",
            path=path,
            tensor=name,
        )
