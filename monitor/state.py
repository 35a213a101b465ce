"""What the monitor shows, as plain values: rank statuses, outlier flags, thresholds,
and the per-refresh `Snapshot` (rows, summary, curves) the widgets draw from.

monitor/model.py computes these from records; nothing here does work.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from monitor.stragglers import ScoreSettings, StragglerRow


class RankStatus(enum.Enum):
    """How recently a rank was heard from, or how it ended."""

    ALIVE = "alive"
    STALE = "stale"
    DEAD = "dead"
    EXITED = "exited"
    UNREACHABLE = "unreachable"
    """Its records came through a relay the monitor lost: the node is unreachable, the
    rank itself unknown (monitor/nodes.py [Note: unreachable nodes])."""


class Flag(enum.Flag):
    """Outlier flags of one rank; several can hold at once."""

    NONE = 0
    STRAGGLER = enum.auto()
    """Step time above `straggler_factor` x the median of the live ranks, or slow in a
    phase of its own by the straggler scores (chronic, or slow at its last scored step:
    the ranks the stragglers view lists, monitor/stragglers.py)."""
    MEMORY = enum.auto()
    """Device memory (reserved or used) above `memory_fraction` of its capacity."""
    NAN_LOSS = enum.auto()
    """Loss is NaN or infinite."""
    STALE = enum.auto()
    """Not heard from for `stale_after_s` (or dead)."""
    ERROR = enum.auto()
    """The rank reported an exception of its own."""
    FAILED_FIRST = enum.auto()
    """Another rank stopped because of this one: named by its RankFailureError (the rank
    that died or failed first)."""
    PEER_FAILED = enum.auto()
    """The rank stopped because another rank failed (it raised RankFailureError)."""
    HUNG = enum.auto()
    """Running, but no step for `hang_factor` x the live ranks' median step time: it may
    be stuck (in a collective, a loader, ...); the hang screen (`h`) asks for stacks."""
    UNREACHABLE = enum.auto()
    """The relay its records came through is gone (the whole node shows so)."""


FLAGS_BY_BITS = [Flag(bits) for bits in range(512)]
"""Every combination of the nine flags, indexed by its bits (a list lookup in the hot loop)."""


@dataclass(frozen=True)
class MonitorSettings:
    """Thresholds of the monitor; defaults are the command line's defaults."""

    stale_after_s: float = 10.0
    """A rank not heard from for this long is stale (shown, flagged)."""
    dead_after_s: float = 60.0
    """A rank not heard from for this long is dead."""
    straggler_factor: float = 1.5
    """Step time above this multiple of the live ranks' median marks a straggler."""
    memory_fraction: float = 0.9
    """Memory above this fraction of the device capacity is flagged."""
    history_steps: int = 4096
    """Steps kept for the loss and throughput curves."""
    rank_history: int = 120
    """Records kept per rank for the detail screen."""
    max_events: int = 2000
    """Events kept for the events log."""
    scores: ScoreSettings = field(default_factory=ScoreSettings)
    """Straggler scoring (monitor/stragglers.py [Note: straggler scoring])."""
    top_stragglers: int = 10
    """Ranks listed in the stragglers view."""
    hang_factor: float = 10.0
    """A running rank with no step for this many median step times is flagged hung."""

    def __post_init__(self) -> None:
        if not 0 < self.stale_after_s <= self.dead_after_s:
            raise ValueError(
                f"expected 0 < stale_after_s <= dead_after_s, found stale_after_s="
                f"{self.stale_after_s}, dead_after_s={self.dead_after_s}; "
                "pick a stale threshold no longer than the dead one"
            )
        if self.straggler_factor <= 1.0:
            raise ValueError(
                f"expected straggler_factor > 1, found {self.straggler_factor}; "
                "1.5 flags ranks 50% slower than the median"
            )
        if self.hang_factor <= 1.0:
            raise ValueError(
                f"expected hang_factor > 1, found {self.hang_factor}; 10 flags a rank with "
                "no step for 10 median step times"
            )
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"expected 0 < memory_fraction <= 1, found {self.memory_fraction}")


@dataclass(frozen=True)
class RankHistoryPoint:
    """One step of one rank, as the detail screen plots it."""

    step: int
    step_time_s: float | None
    loss: float | None
    mem_allocated: float | None


@dataclass(slots=True)
class RankRow:
    """What the rank table and detail screen show for one rank at one snapshot."""

    rank: int
    record: Mapping[str, Any]
    status: RankStatus
    flags: Flag
    age_s: float
    mem_fraction: float | None
    stopped_by: int | None = None
    """With Flag.PEER_FAILED: the rank its RankFailureError named (None: not known)."""


@dataclass(frozen=True)
class Summary:
    """The run at a glance (the summary bar)."""

    step: int | None
    min_step: int | None
    loss: float | None
    tokens_per_s: float | None
    alive: int
    stale: int
    dead: int
    exited: int
    elapsed_s: float | None
    eta_s: float | None
    median_step_time_s: float | None
    outliers: int
    dropped: int
    missing: int = 0
    """Ranks of the run (world size from the start events) never heard from."""
    unreachable: int = 0
    """Ranks whose relay the monitor lost (monitor/nodes.py)."""


@dataclass(frozen=True)
class Snapshot:
    """Everything the widgets draw, computed once per refresh."""

    now: float
    summary: Summary
    rows: dict[int, RankRow]
    loss_curve: list[tuple[int, float]]
    throughput_curve: list[tuple[int, float]]
    stragglers: list[StragglerRow] = field(default_factory=list)
    """The slowest ranks by phase, chronic first (monitor/stragglers.py)."""
    nodes: list[NodeRow] = field(default_factory=list)
    """Per-node aggregates, unreachable and slowest first; empty when no rank names its
    node (monitor/nodes.py)."""


@dataclass(frozen=True)
class NodeRow:
    """One node at a glance: its ranks, its slowest step time, its largest memory."""

    node: int | None
    """The node rank (records' `node`); None: ranks that name no node, behind a lost relay."""
    ranks: int
    unreachable: int
    """Of `ranks`, those whose relay is gone."""
    slowest_step_s: float | None
    max_mem: float | None
    """Bytes: the largest per-rank device reservation, else host RSS, of its ranks."""
