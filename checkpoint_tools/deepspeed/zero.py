"""Where each parameter's elements sit in DeepSpeed's flat ZeRO partitions.

[Note: ZeRO partition layouts] (details and file keys: checkpoint_tools/DEEPSPEED.md)
- ZeRO 1/2: each parameter group is one flat fp32 vector: the group's parameters in
  `param_shapes` order, each followed by `param_alignment_paddings[g][i]` zeros (older
  files: none), then padding to a multiple of the partition count. Rank r holds elements
  `[r * P, (r + 1) * P)`. Its `single_partition_of_fp32_groups[g]` is saved *without*
  its share of the trailing padding (`group_paddings[g]` elements), while the Adam
  moments in `base_optimizer_state["state"][g]` keep all P elements; P is therefore the
  moment length, or the fp32 length plus the padding.
- ZeRO-3: every parameter is partitioned on its own: with n elements over W ranks each
  rank holds `ceil(n / W)` of them (the last ranks' tails are zero padding), rank r the
  elements `[r * ceil(n / W), ...)`. A rank's `fp32_flat_groups[g]` is its pieces of
  group g's parameters back to back; the moments in `optimizer_state_dict["state"][g]`
  have the same layout.
A run is (parameter, group, start in the rank's flat vector, start in the parameter's
flattened elements, length); the importer writes each run as rectangles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from checkpoint_tools.format.errors import DeepSpeedImportError


@dataclass(frozen=True)
class Param:
    name: str
    """DeepSpeed's name (the user's module's named_parameters())."""
    shape: tuple[int, ...]
    group: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Run:
    param: Param
    group: int
    local: int
    """Start in this rank's flat vector of the group."""
    start: int
    """Start in the parameter's flattened elements."""
    length: int


def runs_zero12(
    groups: list[list[Param]],
    paddings: list[list[int]] | None,
    sizes: list[int],
    rank: int,
    world: int,
    path: Path,
) -> list[Run]:
    """The runs rank `rank` holds under ZeRO 1/2; `sizes[g]` is its partition size P."""
    out = []
    for g, params in enumerate(groups):
        p_size = sizes[g]
        lo, hi = rank * p_size, (rank + 1) * p_size
        pos = 0
        for i, p in enumerate(params):
            a, b = max(pos, lo), min(pos + p.numel, hi)
            if a < b:
                out.append(Run(p, g, a - lo, a - pos, b - a))
            pos += p.numel + (paddings[g][i] if paddings is not None else 0)
        if pos > world * p_size:
            raise DeepSpeedImportError(
                f"parameter group {g}'s parameters (param_shapes) need {pos} elements but "
                f"{world} partitions of {p_size} hold only {world * p_size}: the shapes do "
                "not add up (a model states file from another run?)",
                path=path,
                tensor=f"single_partition_of_fp32_groups[{g}]",
            )
    return out


def runs_zero3(
    groups: list[list[Param]], lengths: list[int], rank: int, world: int, path: Path
) -> list[Run]:
    """The runs rank `rank` holds under ZeRO-3; `lengths[g]`: its flat vector lengths."""
    out = []
    for g, params in enumerate(groups):
        pos = 0
        for p in params:
            part = math.ceil(p.numel / world)
            start = rank * part
            length = max(0, min(part, p.numel - start))
            if length:
                out.append(Run(p, g, pos, start, length))
            pos += part
        if pos != lengths[g]:
            raise DeepSpeedImportError(
                f"parameter group {g}'s parameters (param_shapes) take {pos} elements per "
                f"rank under ZeRO-3 at {world} ranks, but this rank's flat group has "
                f"{lengths[g]}: the shapes do not add up",
                path=path,
                tensor=f"fp32_flat_groups[{g}]",
            )
    return out
