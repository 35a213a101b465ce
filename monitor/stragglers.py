"""Straggler scores from the records' phase times: which rank is slow, in which phase, and
whether it is chronic or a one-off (issue 21). Computed here, in the monitor, never on the
training ranks. Pure Python, no Textual.

[Note: straggler scoring]
Records are buffered per step; a step is scored once every rank of the run reported it
(the world size of the start events; before they arrived, every rank seen so far and a
record of a later step), or once a record `CLOSE_LAG` steps later arrived (a rank that never reports must not hold
the scores back). Per scored step and phase, over the ranks that reported a time:

- relative score = fastest rank's time / this rank's (NVIDIA resiliency's "relative"),
- individual score = this rank's best time so far / its time now ("individual"),
  both in 0-1 (1: as fast as the reference), each smoothed with an EWMA (`alpha`);
- slow: the time is above `factor` x the phase's median AND exceeds the median by more
  than `min_excess` x the step's median step time (a 10x slower 1 ms phase is noise);
- slowness = EWMA of the 0/1 "slow" indicator: the weighted share of recent steps in
  which the rank was slow in that phase. A rank is a *chronic* straggler in a phase once
  its slowness reaches `chronic_level` (with alpha 0.15 and level 0.5: five slow steps
  in a row; three slow steps reach 0.39 and stay a *one-off*). The monitor makes a
  "straggler" event when a rank becomes chronic in a phase.

The cause of a rank's slowness is the phase with the largest excess over its median
among the phases that are the rank's own work (data wait, forward, backward, optimizer,
h2d): comm wait is what a rank pays for *other* ranks being slow, so it is scored but
never named as a cause.

Why the median and not the fastest rank as the reference for "slow": in synchronous
training every rank waits for the slowest at the next collective, so the ranks that wait
show that time in whichever phase holds the collective. While most ranks are not
stragglers the waiting ranks are the majority and set the median, so the rank that made
them wait stands out and they do not. With two ranks (or half the ranks straggling) the
median cannot tell the two apart; `comm_wait_s` is the measurement that can: the rank
that waited has the larger comm wait. It covers fsdpx's comm layer and, on a CPU device,
FSDP2's own all-gather / reduce-scatter waits; on CUDA FSDP2's are not timed yet
(monitor/PROTOCOL.md "Phase times"). It is one number per step, not split by the phase
that held the collective, so it is not subtracted from forward / backward here.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fsdpx.telemetry.wire.protocol import PHASE_FIELDS

PHASE_NAMES: tuple[str, ...] = tuple(f[: -len("_s")] for f in PHASE_FIELDS)
"""data_wait, forward, backward, optimizer, comm_wait, h2d (record order)."""
PHASE_LABELS = {
    "data_wait": "data wait",
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer step",
    "comm_wait": "comm wait",
    "h2d": "H2D copy",
}
_CAUSES = tuple(i for i, name in enumerate(PHASE_NAMES) if name != "comm_wait")
_NP = len(PHASE_FIELDS)
CLOSE_LAG = 3
"""A step is scored at the latest when a record this many steps later arrived."""
_MAX_OPEN_STEPS = 64


@dataclass(frozen=True)
class ScoreSettings:
    """Straggler thresholds (MonitorSettings carries one; defaults are the CLI's)."""

    factor: float = 1.5
    """Slow in a phase: above factor x the phase's median over the ranks."""
    min_excess: float = 0.05
    """... and more than this fraction of the median step time above that median."""
    alpha: float = 0.15
    """EWMA weight of the newest step (scores and slowness)."""
    chronic_level: float = 0.5
    """Slowness (EWMA of the slow indicator) at which a rank is a chronic straggler."""

    def __post_init__(self) -> None:
        if self.factor <= 1.0:
            raise ValueError(
                f"expected a straggler factor > 1, found {self.factor}; 1.5 flags phases "
                "50% slower than the median"
            )
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"expected 0 < straggler alpha <= 1, found {self.alpha}")
        if not 0.0 < self.chronic_level <= 1.0:
            raise ValueError(f"expected 0 < chronic level <= 1, found {self.chronic_level}")
        if self.min_excess < 0.0:
            raise ValueError(f"expected min_excess >= 0, found {self.min_excess}")


@dataclass
class _RankScores:
    host: Any = None
    relative: list[float | None] = field(default_factory=lambda: [None] * _NP)
    individual: list[float | None] = field(default_factory=lambda: [None] * _NP)
    best: list[float | None] = field(default_factory=lambda: [None] * _NP)
    slowness: list[float] = field(default_factory=lambda: [0.0] * _NP)
    ratio: list[float | None] = field(default_factory=lambda: [None] * _NP)
    """Last scored time / the phase's median (None: no time or a zero median)."""
    slow: list[bool] = field(default_factory=lambda: [False] * _NP)
    chronic_since: list[int | None] = field(default_factory=lambda: [None] * _NP)
    step: int = 0
    """The last scored step this rank took part in."""


@dataclass(frozen=True)
class StragglerRow:
    """One rank in the stragglers view."""

    rank: int
    host: Any
    phase: str
    """The cause: the phase with the largest excess over its median."""
    ratio: float | None
    """That phase's time / its median at the last scored step."""
    chronic: bool
    chronic_steps: int
    """Steps since it became chronic in `phase` (0 when not chronic)."""
    slowness: float
    relative: float | None
    individual: float | None

    def text(self) -> str:
        """'rank 517 on node031: data wait 2.3x median, chronic for 40 steps'."""
        ratio = "-" if self.ratio is None else f"{self.ratio:.1f}x"
        where = f" on {self.host}" if self.host is not None else ""
        state = f"chronic for {self.chronic_steps} steps" if self.chronic else "one-off"
        return f"rank {self.rank}{where}: {PHASE_LABELS[self.phase]} {ratio} median, {state}"


class StragglerScores:
    """Per-rank, per-phase scores of one run, fed with its records ([Note: straggler
    scoring]). `add` is cheap per record; the cross-rank work runs once per step.

    Example::

        scores = StragglerScores(ScoreSettings())
        scores.add(records)                 # from MonitorModel.add_records
        rows = scores.top(5)                # slowest first
        events = scores.take_events()       # ranks that became chronic
    """

    def __init__(self, settings: ScoreSettings) -> None:
        self.settings = settings
        self.ranks: dict[int, _RankScores] = {}
        self._open: dict[int, dict[int, tuple[Any, ...]]] = {}
        self._step_times: dict[int, list[float]] = {}
        self._scored_through = 0
        self._newest = 0
        self._events: list[dict[str, Any]] = []
        self.last_scored_step: int | None = None
        self.world_size: int | None = None
        """The run's world size (from its start events) once known: a step is complete
        when that many ranks reported it."""

    def add(self, rank: int, step: int, record: dict[str, Any]) -> None:
        """Buffer one record's phase times (validated ints: MonitorModel checked them)."""
        state = self.ranks.get(rank)
        if state is None:
            state = self.ranks[rank] = _RankScores()
        state.host = record.get("host")
        if step <= self._scored_through:
            return  # its step was scored already (a late or repeated record)
        phases = tuple(record.get(f) for f in PHASE_FIELDS)
        row = self._open.get(step)
        if row is None:
            row = self._open[step] = {}
            self._step_times[step] = []
        row[rank] = phases
        st = record.get("step_time_s")
        if type(st) is float or type(st) is int:
            self._step_times[step].append(float(st))
        if step > self._newest:  # a new step: older ones may be complete or lagged now
            self._newest = step
            self._close_ready()
        elif len(row) >= (self.world_size or len(self.ranks)):
            self._close_ready()

    def _close_ready(self) -> None:
        """Score the oldest open steps that are complete or lagged, in step order."""
        n = self.world_size
        while self._open:
            step = min(self._open)
            if n is None:  # which ranks exist is known only once a later step began
                complete = len(self._open[step]) >= len(self.ranks) and self._newest > step
            else:
                complete = len(self._open[step]) >= n
            lagged = self._newest - step >= CLOSE_LAG or len(self._open) > _MAX_OPEN_STEPS
            if not (complete or lagged):
                break
            self._score(step, self._open.pop(step), self._step_times.pop(step))
            self._scored_through = step

    def _score(self, step: int, row: dict[int, tuple[Any, ...]], step_times: list[float]) -> None:
        cfg = self.settings
        a = cfg.alpha
        keep = 1.0 - a
        step_median = statistics.median(step_times) if step_times else None
        self.last_scored_step = step
        for p in range(_NP):
            times = {r: float(v[p]) for r, v in row.items() if _real(v[p]) and v[p] >= 0}
            if len(times) < 2:
                continue
            values = sorted(times.values())
            fastest, median = values[0], statistics.median(values)
            base = step_median if step_median is not None else sum(values) / len(values)
            floor = median + cfg.min_excess * base
            cut = max(median * cfg.factor, floor)
            for r, v in times.items():
                s = self.ranks[r]
                s.step = step
                rel = fastest / v if v > 0 else 1.0
                best = s.best[p]
                best = v if best is None or v < best else best
                s.best[p] = best
                ind = best / v if v > 0 else 1.0
                prev = s.relative[p]
                s.relative[p] = rel if prev is None else a * rel + keep * prev
                prev = s.individual[p]
                s.individual[p] = ind if prev is None else a * ind + keep * prev
                slow = v > cut
                s.slow[p] = slow
                s.ratio[p] = v / median if median > 0 else None
                s.slowness[p] = a * slow + keep * s.slowness[p]
                chronic = s.slowness[p] >= cfg.chronic_level
                if chronic and s.chronic_since[p] is None:
                    s.chronic_since[p] = step
                    if p in _CAUSES:
                        self._events.append(self._chronic_event(r, s, p, step))
                elif not chronic and s.chronic_since[p] is not None:
                    s.chronic_since[p] = None

    def _chronic_event(self, rank: int, s: _RankScores, p: int, step: int) -> dict[str, Any]:
        ratio = s.ratio[p]
        return {
            "rank": rank,
            "host": s.host,
            "kind": "straggler",
            "step": step,
            "detail": {
                "phase": PHASE_NAMES[p],
                "ratio": ratio,
                "message": f"chronic straggler: {PHASE_LABELS[PHASE_NAMES[p]]} "
                + ("" if ratio is None else f"{ratio:.1f}x median"),
            },
        }

    @property
    def has_events(self) -> bool:
        return bool(self._events)

    def take_events(self) -> list[dict[str, Any]]:
        """The "straggler" events made since the last call (a rank became chronic)."""
        out, self._events = self._events, []
        return out

    def row(self, rank: int) -> StragglerRow | None:
        """The rank's straggler state, or None when it is not slow in any phase now
        (neither chronic nor slow at its last scored step)."""
        s = self.ranks.get(rank)
        if s is None:
            return None
        chronic = [p for p in _CAUSES if s.chronic_since[p] is not None]
        slow = [p for p in _CAUSES if s.slow[p]]
        pool = chronic or slow
        if not pool:
            return None
        p = max(pool, key=lambda i: s.ratio[i] or 0.0)
        since = s.chronic_since[p]
        return StragglerRow(
            rank=rank,
            host=s.host,
            phase=PHASE_NAMES[p],
            ratio=s.ratio[p],
            chronic=since is not None,
            chronic_steps=0 if since is None else s.step - since + 1,
            slowness=s.slowness[p],
            relative=s.relative[p],
            individual=s.individual[p],
        )

    def top(self, k: int) -> list[StragglerRow]:
        """Up to k stragglers, chronic before one-off, then by slowness and ratio."""
        rows = [row for r in self.ranks if (row := self.row(r)) is not None]
        rows.sort(key=lambda x: (not x.chronic, -x.slowness, -(x.ratio or 0.0), x.rank))
        return rows[:k]

    def heat(self, phase: str) -> dict[int, float | None]:
        """Per rank: the last scored time of `phase` / its median (the heat strip)."""
        p = PHASE_NAMES.index(phase)
        return {r: s.ratio[p] for r, s in sorted(self.ranks.items())}

    def scores(self, rank: int) -> dict[str, tuple[float | None, float | None]]:
        """Per phase: (relative, individual) EWMA scores of one rank (detail screens)."""
        s = self.ranks.get(rank)
        if s is None:
            return {}
        return {name: (s.relative[i], s.individual[i]) for i, name in enumerate(PHASE_NAMES)}


def _real(value: Any) -> bool:
    t = type(value)
    return t is float or t is int


def phases_of(records: Iterable[dict[str, Any]]) -> list[str]:
    """The phases any of `records` reports (a CPU run has no h2d; an old log none)."""
    seen = [False] * _NP
    for rec in records:
        for i, f in enumerate(PHASE_FIELDS):
            if not seen[i] and _real(rec.get(f)):
                seen[i] = True
    return [name for name, s in zip(PHASE_NAMES, seen, strict=True) if s]
