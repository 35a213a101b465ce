"""Records that arrive as columns (protocol 1.1 `record_columns`,
fsdpx/telemetry/wire/columns.py [Note: columnar batches]) into a run's MonitorModel,
without a dict per record.

[Note: ingesting columns]
What `MonitorModel.add_records` does per record, done per column or per rank instead:
only each rank's newest record of the block becomes its `record` dict (what the table and
the snapshot read), the history and the curves' aggregates take a tuple per record from
zipped columns, and the straggler scorer gets its columns (SCORED_FIELDS: the phases and
the comm wait inside them) zipped (its `add_rows`).
Validity is checked a column at a time (`set(map(type, column))`, in C); a block whose
`rank` or `step` column is not all ints, or one ingested in replay (`now` None, where
each record's own time is its arrival), goes through `add_records` as dicts, so the
outcome is the same either way (tests/test_monitor_columns.py compares them).

[Note: newest record on demand]
At 4,096 ranks sending 5 records/s, a rank's newest record is replaced 2-3 times between
two refreshes (2 Hz), and each dict of ~34 fields took ~1.7 us to build: ~35 ms of every
second went to dicts that nobody read. So a block leaves each rank a pointer (block,
index) to its newest record, and the dict is built when something reads it: `snapshot`
builds all of them at once per block (`materialise`, values picked per column in C), any
other reader one at a time (`_RankState.record`). Fewer dicts, the same dicts: a dict
ingest (`add_records`) replaces the pointer. A pointer keeps its block alive until the
next refresh reads it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from fsdpx.telemetry.wire.columns import RecordColumns
from monitor.stragglers import SCORED_FIELDS

if TYPE_CHECKING:
    from monitor.model import MonitorModel, _RankState

_INT = frozenset({int})


def add_columns(
    model: MonitorModel, block: RecordColumns, now: float | None, source: str | None
) -> None:
    """Store the block's records as `model.add_records(block.rows(), now, source)` would."""
    from monitor.model import _RankState, _real  # (model imports this module)

    ranks, steps = block.get("rank"), block.get("step")
    if (
        now is None
        or ranks is None
        or steps is None
        or not _INT.issuperset(map(type, ranks))
        or not _INT.issuperset(map(type, steps))
    ):
        model.add_records(block.rows(), now, source)
        return
    n = block.n
    if n == 0:
        return  # (a hostile empty block: nothing to store)
    nils = [None] * n
    col = {name: block.get(name) or nils for name in ("step_time_s", "loss", "mem_allocated")}
    states = model.ranks
    if model.first_time is None:  # the block's first record is the run's first
        t = block.columns[block.fields.index("time")][0] if "time" in block.fields else None
        model.first_time = t if _real(t) else now
    # The newest record of each rank becomes its record (dict keeps the last index), as a
    # pointer into the block: see [Note: newest record on demand].
    last = dict(zip(ranks, range(n), strict=True))
    model.unbuilt = True
    history = model.settings.rank_history
    for rank, i in last.items():
        state = states.get(rank)
        if state is None:
            state = states[rank] = _RankState(None, now, deque(maxlen=history), (block, i))
        else:
            state.pending = (block, i)
        state.last_seen = now
        state.source = source
        state.status_override = None
        state.ended_at = None
    for rank, point in zip(
        ranks,
        zip(steps, col["step_time_s"], col["loss"], col["mem_allocated"], strict=True),
        strict=True,
    ):
        states[rank].history.append(point)
    _score(model, block, ranks, steps, nils, now)
    _aggregate(model, steps, col["loss"], block.get("tokens_per_s") or nils)


def materialise(states: Iterable[_RankState]) -> None:
    """Build the newest-record dicts still pointing into blocks, one pass per block with
    the values picked per column in C (itemgetter), then zipped ([Note: newest record on
    demand])."""
    by_block: dict[int, tuple[RecordColumns, list[_RankState], list[int]]] = {}
    for state in states:
        pending = state.pending
        if pending is None:
            continue
        block, index = pending
        entry = by_block.get(id(block))
        if entry is None:
            entry = by_block[id(block)] = (block, [], [])
        entry[1].append(state)
        entry[2].append(index)
    for block, group, indexes in by_block.values():
        fields = block.fields
        if len(indexes) == 1:
            picked: Any = [tuple(c[indexes[0]] for c in block.columns)]
        else:
            pick = itemgetter(*indexes)
            picked = zip(*[pick(c) for c in block.columns], strict=True)
        for state, values in zip(group, picked, strict=True):
            state.record = dict(zip(fields, values, strict=True))


def _score(
    model: MonitorModel,
    block: RecordColumns,
    ranks: list[int],
    steps: list[int],
    nils: list[None],
    now: float,
) -> None:
    phases = zip(*(block.get(f) or nils for f in SCORED_FIELDS), strict=True)
    scores = model.stragglers
    scores.add_rows(
        zip(
            ranks,
            steps,
            block.get("host") or nils,
            phases,
            block.get("step_time_s") or nils,
            strict=True,
        )
    )
    if scores.has_events:
        # Stamped as add_records stamps them: the run of the block, its arrival time.
        run_ids = block.get("run_id") or nils
        model._made(scores.take_events(), {"run_id": run_ids[-1]}, now)


def _aggregate(model: MonitorModel, steps: list[int], losses: list[Any], tokens: list[Any]) -> None:
    """The curves' per-step sums: one numpy pass per column, one update per step."""
    loss = _floats(losses)
    tps = _floats(tokens)
    try:
        step_ids = np.array(steps, dtype=np.int64)
    except OverflowError:  # an int beyond int64: per record, as add_records does
        loss = tps = None
    if loss is None or tps is None:
        _aggregate_rows(model, steps, losses, tokens)
        return
    finite, present = np.isfinite(loss), ~np.isnan(tps)
    unique, where = np.unique(step_ids, return_inverse=True)
    k = len(unique)
    loss_sum = np.bincount(where, weights=np.where(finite, loss, 0.0), minlength=k).tolist()
    loss_n = np.bincount(where, weights=finite, minlength=k).tolist()
    tps_sum = np.bincount(where, weights=np.where(present, tps, 0.0), minlength=k).tolist()
    tps_n = np.bincount(where, weights=present, minlength=k).tolist()
    aggregates = model._steps
    for i, step in enumerate(unique.tolist()):
        agg = aggregates.get(step) or model._new_step(step)
        if agg is None:
            continue
        agg.loss_sum += loss_sum[i]
        agg.loss_n += int(loss_n[i])
        agg.tps_sum += tps_sum[i]
        agg.tps_n += int(tps_n[i])


_NUMBERS = frozenset({float, int, type(None)})


def _floats(values: list[Any]) -> np.ndarray | None:
    """A column as float64 (nil: NaN), or None when it holds anything but numbers and nil
    (bools and strings are not numbers here, as `_real` says)."""
    if not _NUMBERS.issuperset(map(type, values)):
        return None
    try:
        return np.array(values, dtype=float)
    except OverflowError:
        return None


def _aggregate_rows(
    model: MonitorModel, steps: list[int], losses: list[Any], tokens: list[Any]
) -> None:
    from monitor.model import _finite, _summable

    aggregates = model._steps
    for step, loss, tps in zip(steps, losses, tokens, strict=True):
        agg = aggregates.get(step) or model._new_step(step)
        if agg is None:
            continue
        if _finite(loss):
            agg.loss_sum += loss
            agg.loss_n += 1
        if _summable(tps):
            agg.tps_sum += tps
            agg.tps_n += 1
