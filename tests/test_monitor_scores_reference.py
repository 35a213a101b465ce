"""The vectorised straggler scorer (monitor/straggler_arrays.py [Note: vectorised scoring])
against a per-rank Python reference of the same rules ([Note: straggler scoring]), on a
random stream with hostile values (nil, bools, strings, negative and zero times, late
and repeated records; the comm wait inside forward / backward / optimizer, or not): every
score, flag and event equal."""

from __future__ import annotations

import math
import random
import statistics
from typing import Any

from fsdpx.telemetry.wire.protocol import COMM_SPLIT_FIELDS, PHASE_FIELDS
from monitor.stragglers import _CAUSES, PHASE_NAMES, ScoreSettings, StragglerScores

NP = len(PHASE_FIELDS)
SPLIT = {
    PHASE_FIELDS.index(f.replace("comm_wait_", "")): NP + i for i, f in enumerate(COMM_SPLIT_FIELDS)
}
"""Phase index -> the index of the comm wait inside it in a row (SCORED_FIELDS order)."""


def _real(x: Any) -> bool:
    return type(x) in (int, float) and x >= 0


def _times(row: dict[int, tuple[Any, ...]], p: int) -> dict[int, float]:
    """Phase p's scored times of a step's rows: compute times (time - the wait inside it,
    at least 0) where every rank with a time sent its wait as a time, else the times."""
    times = {r: v for r, v in row.items() if _real(v[p])}
    if p in SPLIT and times and all(_real(v[SPLIT[p]]) for v in times.values()):
        return {r: max(0.0, float(v[p]) - float(v[SPLIT[p]])) for r, v in times.items()}
    return {r: float(v[p]) for r, v in times.items()}


class Reference:
    """The scoring rules as a loop over ranks (what the monitor did before numpy)."""

    def __init__(self, cfg: ScoreSettings) -> None:
        self.cfg = cfg
        self.rel: dict[int, list[float | None]] = {}
        self.ind: dict[int, list[float | None]] = {}
        self.best: dict[int, list[float | None]] = {}
        self.ratio: dict[int, list[float | None]] = {}
        self.slowness: dict[int, list[float]] = {}
        self.slow: dict[int, list[bool]] = {}
        self.since: dict[int, list[int | None]] = {}
        self.events: list[tuple[int, str, int]] = []

    def score(self, step: int, row: dict[int, tuple[Any, ...]], step_times: list[float]) -> None:
        cfg, a = self.cfg, self.cfg.alpha
        for r in row:
            if r not in self.rel:
                self.rel[r], self.ind[r] = [None] * NP, [None] * NP
                self.best[r], self.ratio[r] = [None] * NP, [None] * NP
                self.slowness[r], self.slow[r] = [0.0] * NP, [False] * NP
                self.since[r] = [None] * NP
        step_median = statistics.median(step_times) if step_times else None
        for p in range(NP):
            times = _times(row, p)
            if len(times) < 2:
                continue
            values = sorted(times.values())
            fastest, median = values[0], statistics.median(values)
            base = step_median if step_median is not None else sum(values) / len(values)
            cut = max(median * cfg.factor, median + cfg.min_excess * base)
            for r, v in times.items():
                rel = fastest / v if v > 0 else 1.0
                best = self.best[r][p]
                best = v if best is None or v < best else best
                self.best[r][p] = best
                ind = best / v if v > 0 else 1.0
                prev = self.rel[r][p]
                self.rel[r][p] = rel if prev is None else a * rel + (1 - a) * prev
                prev = self.ind[r][p]
                self.ind[r][p] = ind if prev is None else a * ind + (1 - a) * prev
                self.slow[r][p] = v > cut
                self.ratio[r][p] = v / median if median > 0 else None
                self.slowness[r][p] = a * (v > cut) + (1 - a) * self.slowness[r][p]
                chronic = self.slowness[r][p] >= cfg.chronic_level
                if chronic and self.since[r][p] is None:
                    self.since[r][p] = step
                    if p in _CAUSES:
                        self.events.append((r, PHASE_NAMES[p], step))
                elif not chronic:
                    self.since[r][p] = None


def _value(rng: random.Random, slow: bool) -> Any:
    x = rng.random()
    if x < 0.04:
        return rng.choice([None, True, "1.0", -0.5, 0.0, 0])
    return (2.5 if slow else 1.0) * rng.uniform(0.05, 0.1)


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)


def test_vectorised_scores_equal_the_per_rank_reference() -> None:
    rng = random.Random(7)
    cfg = ScoreSettings()
    scores = StragglerScores(cfg)
    ref = Reference(cfg)
    scored_through = 0
    original = scores._score

    def spy(step: int, row: dict[int, tuple[Any, ...]], step_times: list[float]) -> None:
        nonlocal scored_through
        # The reference reads the records as sent (the scorer's rows hold compute times).
        ranks = {scores._rank_of[s]: sent[(scores._rank_of[s], step)] for s in row}
        ref.score(step, ranks, list(step_times))
        original(step, row, step_times)
        scored_through = step

    scores._score = spy  # type: ignore[method-assign]
    sent: dict[tuple[int, int], tuple[Any, ...]] = {}

    def add(rank: int, step: int, rec: dict[str, Any]) -> None:
        if step > scores._scored_through:  # (else the scorer ignores it)
            sent[(rank, step)] = tuple(rec.get(f) for f in PHASE_FIELDS + COMM_SPLIT_FIELDS)
        scores.add(rank, step, rec)

    n_ranks, steps = 40, 60
    slow_ranks = {3: range(0, 60), 17: range(20, 24), 31: range(30, 60)}
    for step in range(1, steps + 1):
        order = list(range(n_ranks))
        rng.shuffle(order)
        for rank in order:
            if rank == 9 and step > 40:
                continue  # stops reporting: steps close by lag
            slow = step in slow_ranks.get(rank, ())
            rec = {f: _value(rng, slow) for f in PHASE_FIELDS}
            if rank % 4 or step % 3:  # (every fourth rank at every third step: an
                # older publisher, no split fields, so forward / backward / optimizer of
                # that step are scored by time for every rank)
                for f in COMM_SPLIT_FIELDS:
                    phase = rec[f.replace("comm_wait_", "")]
                    real = type(phase) is float and phase > 0
                    rec[f] = rng.uniform(0.0, 1.2) * phase if real else _value(rng, False)
            rec["host"] = f"node{rank // 8}"
            rec["step_time_s"] = rng.choice([0.5, 0.6, None])
            add(rank, step, rec)
            if rng.random() < 0.02:  # a repeated record, and a late one
                add(rank, step, rec)
                add(rank, max(1, step - 5), rec)
    assert scored_through >= steps - 3
    for rank in range(n_ranks):
        got = scores.scores(rank)
        for p, name in enumerate(PHASE_NAMES):
            assert _close(got[name][0], ref.rel[rank][p]), (rank, name)
            assert _close(got[name][1], ref.ind[rank][p]), (rank, name)
        heat = {name: scores.heat(name)[rank] for name in PHASE_NAMES}
        assert all(_close(heat[n], ref.ratio[rank][p]) for p, n in enumerate(PHASE_NAMES))
        row = scores.row(rank)
        chronic = [p for p in _CAUSES if ref.since[rank][p] is not None]
        pool = chronic or [p for p in _CAUSES if ref.slow[rank][p]]
        assert (row is None) == (not pool), rank
        if row is not None:
            p = max(pool, key=lambda i: ref.ratio[rank][i] or 0.0)
            assert row.phase == PHASE_NAMES[p] and row.chronic == bool(chronic)
            assert _close(row.slowness, ref.slowness[rank][p])
    events = [(e["rank"], e["detail"]["phase"], e["step"]) for e in scores.take_events()]
    assert events == ref.events and events  # some rank did become chronic
    top = scores.top(5)
    # led by one of the two ranks slow to the end (their order: their recent slowness)
    assert top[0].rank in (3, 31) and top[0].chronic and top == scores.top(5)
