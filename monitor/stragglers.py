"""Straggler scores from the records' phase times: which rank is slow, in which phase, and
whether it is chronic or a one-off (issue 21). Computed here, in the monitor, never on the
training ranks. Pure Python, no Textual. This module buffers the records into steps and
answers the views (`StragglerScores`); the phase names, thresholds, row type and its text
are in monitor/straggler_types.py, the per-rank arrays and a step's arithmetic in
monitor/straggler_arrays.py.

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
median cannot tell the two apart; the comm wait is the measurement that can: the rank
that waited has the larger comm wait. It covers fsdpx's comm layer and FSDP2's own waits
(on CPU wall time, HSDP's all-reduce included; on CUDA event pairs at FSDP's wait points:
monitor/PROTOCOL.md "Phase times").

Forward, backward and the optimizer step are scored by their *compute* time: the phase
minus the comm wait that happened while it was open (`COMM_SPLIT_FIELDS`, recorded by the
phase clock: fsdpx/telemetry/phases.py [Note: comm wait by phase]). Under FSDP / ZeRO-3
the ranks wait for a slow peer inside their own forward's all-gathers, so their forward
*times* rise to the slow rank's and it sits at the median; their forward *compute* does
not, and the rank that made them wait stands out. A record without the split (an older
publisher or log, a value that is not a time) scores that phase by its time, as before,
and so does every other rank's record of that step and phase: compute times are compared
only with compute times. A rank whose time (which holds its wait) was compared with the
others' compute would be named a straggler for having waited.
The split must come from the rank: subtracting the step's whole `comm_wait_s` from
forward (a heuristic tried and reverted) fails when the waits were in backward: the
waiting ranks' forward then looks short by their wait, and the rank they waited for
(slow in backward) is named a forward straggler.

Where a phase's median is (near) 0 its ratio says little: a rank sleeping 0.3 s in its
data loader while the others wait 5 us is "60,000x median". Above `RATIO_SHOWN_UP_TO` a
row and its event give the excess over the median in seconds instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from monitor.straggler_arrays import SCORED_FIELDS, ScoreArrays
from monitor.straggler_arrays import optional_float as _opt
from monitor.straggler_types import CAUSES as _CAUSES
from monitor.straggler_types import (
    PHASE_LABELS,
    PHASE_NAMES,
    RATIO_SHOWN_UP_TO,
    ScoreSettings,
    StragglerRow,
    compare_text,
)

__all__ = [
    "CLOSE_LAG",
    "PHASE_LABELS",
    "PHASE_NAMES",
    "RATIO_SHOWN_UP_TO",
    "SCORED_FIELDS",
    "ScoreSettings",
    "StragglerRow",
    "StragglerScores",
    "compare_text",
]
"""Also the names of monitor/straggler_types.py and monitor/straggler_arrays.py that
callers import from here."""

CLOSE_LAG = 3
"""A step is scored at the latest when a record this many steps later arrived."""
_MAX_OPEN_STEPS = 64


class StragglerScores:
    """Per-rank, per-phase scores of one run, fed with its records ([Note: straggler
    scoring]). `add` is cheap per record; the cross-rank work runs once per step, on numpy
    arrays indexed by a rank's slot (monitor/straggler_arrays.py [Note: vectorised scoring]).

    Example::

        scores = StragglerScores(ScoreSettings())
        scores.add(rank, step, record)      # from MonitorModel.add_records
        rows = scores.top(5)                # slowest first
        events = scores.take_events()       # ranks that became chronic
    """

    def __init__(self, settings: ScoreSettings) -> None:
        self.settings = settings
        self._slot: dict[int, int] = {}
        """rank -> row of the state arrays (ranks in order of first arrival)."""
        self._rank_of: list[int] = []
        self._hosts: list[Any] = []
        self._arrays = ScoreArrays()
        """Per-slot state, one row per rank and one column per phase."""
        self._open: dict[int, dict[int, tuple[Any, ...]]] = {}
        """step -> {slot: the record's phase values as received}."""
        self._step_times: dict[int, list[float]] = {}
        self._scored_through = 0
        self._newest = 0
        self._events: list[dict[str, Any]] = []
        self._version = 0
        """Bumped by every scored step: `top` is recomputed only after one."""
        self._top: tuple[int, int, list[StragglerRow]] | None = None
        self._flagged: tuple[int, frozenset[int]] | None = None
        self.last_scored_step: int | None = None
        self.world_size: int | None = None
        """The run's world size (from its start events) once known: a step is complete
        when that many ranks reported it."""

    def _new_slot(self, rank: int) -> int:
        slot = len(self._rank_of)
        arrays = self._arrays
        if slot >= arrays.capacity:
            arrays.grow(max(64, 2 * arrays.capacity), used=slot)
        self._slot[rank] = slot
        self._rank_of.append(rank)
        self._hosts.append(None)
        return slot

    def add(self, rank: int, step: int, record: dict[str, Any]) -> None:
        """Buffer one record's phase times (validated ints: MonitorModel checked them)."""
        slot = self._slot.get(rank)
        if slot is None:
            slot = self._new_slot(rank)
        self._hosts[slot] = record.get("host")
        if step <= self._scored_through:
            return  # its step was scored already (a late or repeated record)
        row = self._open.get(step)
        if row is None:
            row = self._open[step] = {}
            self._step_times[step] = []
        row[slot] = tuple(map(record.get, SCORED_FIELDS))
        st = record.get("step_time_s")
        if type(st) is float or type(st) is int:
            self._step_times[step].append(float(st))
        if step > self._newest:  # a new step: older ones may be complete or lagged now
            self._newest = step
            self._close_ready()
        elif len(row) >= (self.world_size or len(self._slot)):
            self._close_ready()

    def add_rows(self, rows: Iterable[tuple[int, int, Any, tuple[Any, ...], Any]]) -> None:
        """`add` for many records given as (rank, step, host, values in SCORED_FIELDS
        order, step_time_s) tuples (monitor/columns_ingest.py: zipped columns,
        no record dicts); ranks and steps are validated ints."""
        # Per record at 20,000 records/s: locals for what stays put between closes, and
        # the open row of the step before (records come in runs of one step).
        slots, hosts, opened, times = self._slot, self._hosts, self._open, self._step_times
        through, newest = self._scored_through, self._newest
        need = self.world_size or len(slots)
        cur_step = None
        row: dict[int, tuple[Any, ...]] = {}
        step_times: list[float] = []
        for rank, step, host, phases, st in rows:
            slot = slots.get(rank)
            if slot is None:
                slot = self._new_slot(rank)
                hosts = self._hosts
                need = self.world_size or len(slots)
            hosts[slot] = host
            if step <= through:
                continue
            if step != cur_step:
                cur_step = step
                got = opened.get(step)
                if got is None:
                    got = opened[step] = {}
                    times[step] = []
                row, step_times = got, times[step]
            row[slot] = phases
            if type(st) is float or type(st) is int:
                step_times.append(float(st))
            if step > newest:
                self._newest = newest = step
            elif len(row) < need:
                continue
            self._close_ready()  # (may close the step of `row`: read it again next time)
            through, cur_step = self._scored_through, None

    def _close_ready(self) -> None:
        """Score the oldest open steps that are complete or lagged, in step order."""
        n = self.world_size
        while self._open:
            step = min(self._open)
            if n is None:  # which ranks exist is known only once a later step began
                complete = len(self._open[step]) >= len(self._slot) and self._newest > step
            else:
                complete = len(self._open[step]) >= n
            lagged = self._newest - step >= CLOSE_LAG or len(self._open) > _MAX_OPEN_STEPS
            if not (complete or lagged):
                break
            self._score(step, self._open.pop(step), self._step_times.pop(step))
            self._scored_through = step

    def _score(self, step: int, row: dict[int, tuple[Any, ...]], step_times: list[float]) -> None:
        """Score one step (its slots' values as received) and make an event for each rank
        that became chronic in a phase of its own."""
        self.last_scored_step = step
        self._version += 1
        for slot, p in self._arrays.score(step, row, step_times, self.settings):
            self._events.append(self._chronic_event(slot, p, step))

    def _chronic_event(self, slot: int, p: int, step: int) -> dict[str, Any]:
        ratio = _opt(self._arrays.ratio[slot, p])
        excess = _opt(self._arrays.excess[slot, p])
        return {
            "rank": self._rank_of[slot],
            "host": self._hosts[slot],
            "kind": "straggler",
            "step": step,
            "detail": {
                "phase": PHASE_NAMES[p],
                "ratio": ratio,
                "message": f"chronic straggler: {PHASE_LABELS[PHASE_NAMES[p]]} "
                + compare_text(ratio, excess),
            },
        }

    @property
    def has_events(self) -> bool:
        return bool(self._events)

    def take_events(self) -> list[dict[str, Any]]:
        """The "straggler" events made since the last call (a rank became chronic)."""
        out, self._events = self._events, []
        return out

    def _row_of(self, slot: int) -> StragglerRow | None:
        arrays = self._arrays
        since = arrays.since[slot]
        chronic = [p for p in _CAUSES if since[p] >= 0]
        slow = [p for p in _CAUSES if arrays.slow[slot, p]]
        pool = chronic or slow
        if not pool:
            return None
        ratios = arrays.ratio[slot]
        p = max(pool, key=lambda i: 0.0 if np.isnan(ratios[i]) else float(ratios[i]))
        began = int(since[p])
        return StragglerRow(
            rank=self._rank_of[slot],
            host=self._hosts[slot],
            phase=PHASE_NAMES[p],
            ratio=_opt(ratios[p]),
            excess=_opt(arrays.excess[slot, p]),
            chronic=began >= 0,
            chronic_steps=0 if began < 0 else int(arrays.step[slot]) - began + 1,
            slowness=float(arrays.slowness[slot, p]),
            relative=_opt(arrays.relative[slot, p]),
            individual=_opt(arrays.individual[slot, p]),
        )

    def row(self, rank: int) -> StragglerRow | None:
        """The rank's straggler state, or None when it is not slow in any phase now
        (neither chronic nor slow at its last scored step)."""
        slot = self._slot.get(rank)
        return None if slot is None else self._row_of(slot)

    def top(self, k: int) -> list[StragglerRow]:
        """Up to k stragglers, chronic before one-off, then by slowness and ratio.
        Recomputed only after a step was scored (the app asks at every refresh)."""
        if self._top is not None and self._top[:2] == (self._version, k):
            return self._top[2]
        rows = [r for slot in self._flagged_slots() if (r := self._row_of(slot))]
        rows.sort(key=lambda x: (not x.chronic, -x.slowness, -(x.ratio or 0.0), x.rank))
        self._top = (self._version, k, rows[:k])
        return rows[:k]

    def _flagged_slots(self) -> list[int]:
        """Slots chronic or slow now in a cause phase: the ranks that have a row (found
        over the arrays, not a row per rank)."""
        n = len(self._rank_of)
        causes = list(_CAUSES)
        arrays = self._arrays
        flagged = (arrays.since[:n, causes] >= 0).any(axis=1) | arrays.slow[:n, causes].any(axis=1)
        return np.nonzero(flagged)[0].tolist()  # type: ignore[no-any-return]

    def flagged(self) -> frozenset[int]:
        """The ranks the stragglers view would list (a row: chronic or slow now in a
        phase of their own), for the rank table's straggler flag. Recomputed only after a
        step was scored."""
        if self._flagged is None or self._flagged[0] != self._version:
            ranks = frozenset(self._rank_of[slot] for slot in self._flagged_slots())
            self._flagged = (self._version, ranks)
        return self._flagged[1]

    def heat(self, phase: str) -> dict[int, float | None]:
        """Per rank: the last scored time of `phase` / its median (the heat strip)."""
        p = PHASE_NAMES.index(phase)
        n = len(self._rank_of)
        ratios = self._arrays.ratio[:n, p].tolist()
        return {r: _opt(ratios[s]) for r, s in sorted(self._slot.items())}

    def scores(self, rank: int) -> dict[str, tuple[float | None, float | None]]:
        """Per phase: (relative, individual) EWMA scores of one rank (detail screens)."""
        slot = self._slot.get(rank)
        if slot is None:
            return {}
        return {
            name: (_opt(self._arrays.relative[slot, i]), _opt(self._arrays.individual[slot, i]))
            for i, name in enumerate(PHASE_NAMES)
        }
