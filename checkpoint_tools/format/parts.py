"""A checkpoint directory that holds only some ranks' files: one node's part of a
node-local checkpoint (FORMAT.md §2.2).

A node-local save (fsdpx `checkpoint.node_local`) leaves on every node a directory with
the same MANIFEST, listing every rank's files, but only that node's ranks' files. The
MANIFEST's `state.node_local` says which ranks were on which node. Readers refuse such a
directory by default, naming the ranks (and nodes) whose files are not there; a runtime
that loads each node's part in place opens it with `present_only=True` and learns at
read time whether the rectangles it asks for are all present.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from checkpoint_tools.format.coverage import Box, intersect, uncovered
from checkpoint_tools.format.errors import CheckpointNotFoundError
from checkpoint_tools.format.schema import RankFile, TensorMeta


def missing_files(directory: Path, rank_files: Sequence[RankFile]) -> list[str]:
    """The rank files the MANIFEST lists that are not in `directory`, in rank order."""
    names = [n for rf in rank_files for n in (rf.index_file, rf.data_file)]
    return [n for n in names if not os.path.lexists(directory / n)]


def absent_ranks(rank_files: Sequence[RankFile], missing: Sequence[str]) -> list[int]:
    """Ranks with a file in `missing`."""
    gone = set(missing)
    return [rf.rank for rf in rank_files if rf.index_file in gone or rf.data_file in gone]


def _span(ranks: Sequence[int]) -> str:
    """'0-3, 8, 10, 11': runs of three or more consecutive ranks as ranges, so a message about a
    1,024-rank checkpoint stays one readable line."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(
        f"{a}-{b}" if b - a >= 2 else ", ".join(str(r) for r in range(a, b + 1)) for a, b in runs
    )


def _nodes(state: dict[str, Any], ranks: Sequence[int]) -> str:
    """' (node 1 on host-b: ranks 2, 3)' for the nodes holding `ranks`, from the MANIFEST's
    state.node_local; '' when the checkpoint is not node-local."""
    info = state.get("node_local")
    nodes = info.get("nodes") if isinstance(info, dict) else None
    if not isinstance(nodes, list):
        return ""
    wanted = set(ranks)
    named = []
    for i, node in enumerate(nodes):
        held = node.get("ranks", []) if isinstance(node, dict) else []
        if wanted & set(held):
            named.append(f"node {i} on {node.get('host', '?')}: ranks {_span(held)}")
    return f" ({'; '.join(named)})" if named else ""


def _whole_nodes(state: dict[str, Any], absent: Sequence[int]) -> bool:
    """Whether `absent` is whole nodes of a node-local checkpoint and some node is here
    (else files are missing from a node's own part: the checkpoint is incomplete)."""
    info = state.get("node_local")
    nodes = info.get("nodes") if isinstance(info, dict) else None
    if not isinstance(nodes, list):
        return False
    gone = set(absent)
    held = [set(n.get("ranks", [])) if isinstance(n, dict) else set() for n in nodes]
    return all(h <= gone or not (h & gone) for h in held) and any(not (h & gone) for h in held)


def missing_message(
    directory: Path,
    world_size: int,
    missing: Sequence[str],
    absent: Sequence[int],
    state: dict[str, Any],
) -> str:
    """Why a directory missing some ranks' files cannot be read as a whole."""
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    text = (
        f"missing checkpoint file {missing[0]!r}{more}: the MANIFEST lists the files of "
        f"{world_size} rank(s), but the files of rank(s) {_span(absent)}"
        f"{_nodes(state, absent)} are not in {str(directory)!r}"
    )
    if _whole_nodes(state, absent):
        return (
            f"{text}: this is one node's part of a node-local checkpoint "
            "(checkpoint.node_local). Copy the rank-* files of every node's "
            f"{directory.name!r} directory into one directory (the MANIFEST is the same on "
            "every node) to load, verify or consolidate it anywhere, or load it in place "
            "with checkpoint.node_local on the nodes that saved it"
        )
    return f"{text}: the checkpoint is incomplete; restore the missing files or load another"


def check_present(
    meta: TensorMeta,
    want: Box,
    absent: Sequence[int],
    directory: Path,
    state: dict[str, Any],
) -> None:
    """Raise unless the pieces in this directory cover the rectangle `want` of `meta`."""
    offs, shape = want
    inside = []
    for p in meta.pieces:
        inter = intersect((p.offsets, p.shape), want)
        if inter is not None:
            inside.append((tuple(i - o for i, o in zip(inter[0], offs, strict=True)), inter[1]))
    gap = uncovered(shape, inside)
    if gap is None:
        return
    element = tuple(g + o for g, o in zip(gap, offs, strict=True))
    raise CheckpointNotFoundError(
        f"element {element} of the {meta.shape} tensor is in none of the files here: they "
        f"are in the files of rank(s) {_span(absent)}{_nodes(state, absent)}, which this "
        "directory does not hold. A node-local checkpoint loads in place only where each "
        "node's ranks hold what they saved (same nodes, world size and layout); gather "
        "every node's directory into one to load it with another layout",
        path=directory,
        tensor=meta.name,
    )
