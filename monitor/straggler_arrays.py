"""The straggler scorer's per-rank state and the arithmetic of one scored step: numpy
arrays with a row per rank slot and a column per phase (`ScoreArrays`), updated once per
step over the ranks that reported it ([Note: vectorised scoring]), forward / backward /
optimizer taken as their compute time where the ranks sent the comm wait inside them.
The rules: monitor/stragglers.py [Note: straggler scoring]; the buffering of records
into steps, the events and the view's queries: `StragglerScores` there."""

from __future__ import annotations

import contextlib
import itertools
import statistics
from typing import Any

import numpy as np

from fsdpx.telemetry.wire.protocol import COMM_SPLIT_FIELDS, PHASE_FIELDS
from monitor.straggler_types import CAUSES, ScoreSettings, is_real

SCORED_FIELDS = PHASE_FIELDS + COMM_SPLIT_FIELDS
"""The record fields the scorer reads, in the order of its row tuples."""
_NP = len(PHASE_FIELDS)
_NS = len(SCORED_FIELDS)
_SPLIT = tuple(PHASE_FIELDS.index(f.replace("comm_wait_", "")) for f in COMM_SPLIT_FIELDS)
"""Per COMM_SPLIT_FIELDS entry: the phase whose wait it is (forward, backward, optimizer)."""
_REAL_OR_NONE = frozenset({float, int, type(None)})


class ScoreArrays:
    """Per-slot state, one row per rank slot and one column per phase (NaN: none yet).
    The caller owns the slots (rank -> row) and grows the arrays before it uses a new
    one."""

    def __init__(self) -> None:
        self.relative = _state(0, np.nan, float)
        self.individual = _state(0, np.nan, float)
        self.best = _state(0, np.nan, float)
        self.ratio = _state(0, np.nan, float)
        """Last scored time / the phase's median (NaN: no time or a zero median)."""
        self.excess = _state(0, np.nan, float)
        """Last scored time - the phase's median, seconds."""
        self.slowness = _state(0, 0.0, float)
        self.slow = _state(0, False, bool)
        self.since = _state(0, -1, np.int64)
        """Step the rank became chronic in the phase; -1: not chronic."""
        self.step = np.zeros(0, dtype=np.int64)
        """The last scored step each rank took part in."""

    @property
    def capacity(self) -> int:
        """Slots the arrays have room for."""
        return len(self.step)

    def grow(self, capacity: int, used: int) -> None:
        """Reallocate for `capacity` slots, keeping the first `used` slots' state."""
        for name, fill in (
            ("relative", np.nan),
            ("individual", np.nan),
            ("best", np.nan),
            ("ratio", np.nan),
            ("excess", np.nan),
            ("slowness", 0.0),
            ("slow", False),
            ("since", -1),
        ):
            old = getattr(self, name)
            new = _state(capacity, fill, old.dtype)
            new[:used] = old[:used]
            setattr(self, name, new)
        step = np.zeros(capacity, dtype=np.int64)
        step[:used] = self.step[:used]
        self.step = step

    def score(
        self,
        step: int,
        row: dict[int, tuple[Any, ...]],
        step_times: list[float],
        cfg: ScoreSettings,
    ) -> list[tuple[int, int]]:
        """Score one step: `row` maps a slot to its record's SCORED_FIELDS values as
        received, `step_times` are the step's step times. Returns the (slot, phase index)
        pairs that became chronic in a cause phase, in the order they are reported."""
        # [Note: vectorised scoring] At 4,096 ranks a step is 6 x 4,096 rank-phase updates;
        # as a Python loop that was half of the monitor's ingest CPU. Here each phase is a
        # handful of numpy operations over the ranks that reported it, with the same
        # arithmetic (IEEE doubles both ways; NaN stands for "none"). Values that are not
        # int/float (bool, str, nil: the monitor survives any publisher) are unknown, as
        # are negative ones, exactly as the per-rank loop treated them.
        a = cfg.alpha
        keep = 1.0 - a
        step_median = statistics.median(step_times) if step_times else None
        slots = np.fromiter(row, dtype=np.intp, count=len(row))
        values = list(row.values())
        times = None
        if _REAL_OR_NONE.issuperset(map(type, itertools.chain.from_iterable(values))):
            with contextlib.suppress(OverflowError):  # an int beyond float's range
                times = np.array(values, dtype=float).reshape(len(values), _NS)  # None: NaN
        if times is None:
            times = np.array([[_as_time(v) for v in r] for r in values], dtype=float)
        times = _compute_times(times)
        became_chronic: list[tuple[int, int]] = []
        for p in range(_NP):
            column = times[:, p]
            ok = column >= 0  # NaN compares false
            if np.count_nonzero(ok) < 2:
                continue
            v = column[ok]
            idx = slots[ok]
            fastest, median = float(v.min()), float(np.median(v))
            base = step_median if step_median is not None else float(v.mean())
            cut = max(median * cfg.factor, median + cfg.min_excess * base)
            self.step[idx] = step
            positive = v > 0
            safe = np.where(positive, v, 1.0)
            rel = np.where(positive, fastest / safe, 1.0)
            best = np.fmin(self.best[idx, p], v)  # fmin: a NaN (no best yet) gives v
            self.best[idx, p] = best
            ind = np.where(positive, best / safe, 1.0)
            prev = self.relative[idx, p]
            self.relative[idx, p] = np.where(np.isnan(prev), rel, a * rel + keep * prev)
            prev = self.individual[idx, p]
            self.individual[idx, p] = np.where(np.isnan(prev), ind, a * ind + keep * prev)
            slow = v > cut
            self.slow[idx, p] = slow
            self.ratio[idx, p] = v / median if median > 0 else np.nan
            self.excess[idx, p] = v - median
            slowness = a * slow + keep * self.slowness[idx, p]
            self.slowness[idx, p] = slowness
            chronic = slowness >= cfg.chronic_level
            since = self.since[idx, p]
            became = chronic & (since < 0)
            since = np.where(became, step, np.where(chronic, since, -1))
            self.since[idx, p] = since
            if p in CAUSES and became.any():
                became_chronic.extend((slot, p) for slot in idx[became].tolist())
        return became_chronic


def _compute_times(times: np.ndarray) -> np.ndarray:
    """The phase columns of a step's (ranks, SCORED_FIELDS) array, forward / backward /
    optimizer as their compute time (monitor/stragglers.py [Note: straggler scoring]):
    time - wait, at least 0, where every rank with a time for the phase sent the comm wait
    inside it; else that phase's times as they are, for every rank (one rank's time, wait
    included, compared with the others' compute would name it for waiting). NaN (no time)
    stays NaN."""
    out = times[:, :_NP].copy()
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, an unknown time
        for i, p in enumerate(_SPLIT):
            wait = times[:, _NP + i]
            column = out[:, p]
            timed = column >= 0  # NaN compares false
            has = (wait >= 0) & timed
            if has.any() and np.array_equal(has, timed):
                out[:, p] = np.where(
                    has, np.maximum(column - np.where(has, wait, 0.0), 0.0), column
                )
    return out


def _state(capacity: int, fill: Any, dtype: Any) -> np.ndarray:
    return np.full((capacity, _NP), fill, dtype=dtype)


def _as_time(value: Any) -> float:
    """A phase value as a float, NaN when it is not a real number (bool and str included)
    or beyond float's range."""
    if not is_real(value):
        return np.nan
    try:
        return float(value)
    except OverflowError:
        return np.nan


def optional_float(value: Any) -> float | None:
    """A state array's float as a Python float, None for NaN."""
    f = float(value)
    return None if f != f else f
