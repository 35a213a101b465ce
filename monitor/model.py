"""The monitor's state store: latest record per rank, curves, stale/dead detection, outliers.

Pure Python, no Textual and no I/O, so it is tested directly and shared by the live
monitor, the replay player and the CPU benchmark.

[Note: cost per record] Records arrive at ranks x 5 per second (20,000/s at 4,096 ranks).
`add_records` therefore does only dictionary stores and a few float additions per record;
everything that looks across ranks (medians, outliers, counts, sorting) happens in
`snapshot`, which the app calls at its refresh rate (a few times a second), not per record.

[Note: clocks] "Last seen" is the monitor's clock when a record arrived, not the rank's
`time` field: hosts' clocks drift, and a rank is stale because the monitor stopped hearing
from it. The replay player passes its virtual clock (the records' own times) instead, so
a replay shows what a live monitor would have shown.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from fsdpx.telemetry.wire.columns import RecordColumns
from monitor.columns_ingest import add_columns, materialise
from monitor.hangs import DumpBook
from monitor.nodes import node_rows, relay_event
from monitor.state import (
    FLAGS_BY_BITS,
    Flag,
    MonitorSettings,
    RankHistoryPoint,
    RankRow,
    RankStatus,
    Snapshot,
    Summary,
)
from monitor.stragglers import StragglerScores

__all__ = [
    "Flag",
    "MonitorModel",
    "MonitorSettings",
    "RankHistoryPoint",
    "RankRow",
    "RankStatus",
    "Snapshot",
    "Summary",
]


@dataclass
class _StepAggregate:
    loss_sum: float = 0.0
    loss_n: int = 0
    tps_sum: float = 0.0
    tps_n: int = 0


# (step, step_time_s, loss, mem_allocated) as received: validated when read, not per record.
_RawPoint = tuple[int, Any, Any, Any]


class _RankState:
    """One rank's state. Its newest record is a dict, or, after a columnar block, the
    block and index it will be read from (monitor/columns_ingest.py [Note: newest record
    on demand]): `record` builds the dict when first read."""

    __slots__ = (
        "_record",
        "pending",
        "last_seen",
        "history",
        "status_override",
        "error",
        "peer_failed",
        "stopped_by",
        "ended_at",
        "source",
    )

    def __init__(
        self,
        record: dict[str, Any] | None,
        last_seen: float,
        history: deque[_RawPoint],
        pending: tuple[RecordColumns, int] | None = None,
    ) -> None:
        self._record = record
        self.pending = pending
        """(block, index) of a newest record not made into a dict yet; None: `_record`."""
        self.last_seen = last_seen
        self.history = history
        self.status_override: RankStatus | None = None
        self.error = False
        self.peer_failed = False
        self.stopped_by: int | None = None
        self.ended_at: float | None = None
        """When its exit (or disconnect) arrived, on the clock of `last_seen`."""
        self.source: str | None = None
        """The relay connection its last record came through (None: replay)."""

    @property
    def record(self) -> dict[str, Any]:
        """The newest record (built from its block on first read)."""
        pending = self.pending
        if pending is not None:
            block, index = pending
            self._record = block.row(index)
            self.pending = None
        assert self._record is not None  # (one of the two is always set)
        return self._record

    @record.setter
    def record(self, record: dict[str, Any]) -> None:
        self._record = record
        self.pending = None


def _real(value: Any) -> TypeGuard[int | float]:
    """An int or float that is not a bool (exact type checks: the hot paths use them)."""
    t = type(value)
    return t is float or t is int


_MAX = sys.float_info.max


def _finite(value: Any) -> TypeGuard[int | float]:
    """A finite real number that a float sum can take (NaN and infinities are not; nor is
    an int beyond float's range, which would raise OverflowError when added)."""
    t = type(value)
    return (t is float or t is int) and -_MAX <= value <= _MAX  # NaN compares false


def _summable(value: Any) -> TypeGuard[int | float]:
    """A real number a float sum can take (infinities and NaN included, as before; an int
    beyond float's range is not)."""
    t = type(value)
    return t is float or (t is int and -_MAX <= value <= _MAX)


def _number(value: Any) -> float | None:
    """A record field as a float, or None when absent or not a number (bad input is shown
    as unknown, never raised: the monitor must survive any publisher)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


@dataclass
class MonitorModel:
    """Per-rank state of one run, fed with records and events.

    Args:
        settings: thresholds (stale/dead ages, outlier rules, history sizes).

    Example::

        model = MonitorModel()
        model.add_records([{"rank": 0, "step": 1, "loss": 2.5, "step_time_s": 0.1}], now=1.0)
        snap = model.snapshot(now=2.0)
        assert snap.summary.step == 1 and snap.rows[0].status is RankStatus.ALIVE
    """

    settings: MonitorSettings = field(default_factory=MonitorSettings)
    ranks: dict[int, _RankState] = field(default_factory=dict)
    events: deque[dict[str, Any]] = field(init=False)
    bad_records: int = 0
    total_steps: int | None = None
    world_size: int | None = None
    first_time: float | None = None
    _steps: OrderedDict[int, _StepAggregate] = field(default_factory=OrderedDict)
    stragglers: StragglerScores = field(init=False)
    dumps: DumpBook = field(default_factory=DumpBook)
    """Hang dumps the ranks sent (monitor/hangs.py)."""
    unreachable: set[str] = field(default_factory=set)
    """Relay connections that are down (monitor/nodes.py [Note: unreachable nodes])."""
    unbuilt: bool = False
    """Some rank's newest record still points into a columnar block (monitor/
    columns_ingest.py [Note: newest record on demand]): `snapshot` builds them first."""
    made_events: list[dict[str, Any]] = field(default_factory=list)
    """Events this model made (a rank became a chronic straggler) since the app last took
    them (`take_made_events`); they are in `events` too."""

    def __post_init__(self) -> None:
        self.events = deque(maxlen=self.settings.max_events)
        self.stragglers = StragglerScores(self.settings.scores)

    def clear(self) -> None:
        """Forget everything (the replay player rebuilds the state when seeking back)."""
        self.ranks.clear()
        self.events.clear()
        self._steps.clear()
        self.stragglers = StragglerScores(self.settings.scores)
        self.made_events.clear()
        self.dumps = DumpBook()
        self.bad_records = 0
        self.total_steps = None
        self.world_size = None
        self.first_time = None
        self.unreachable.clear()

    def add_records(
        self, records: Iterable[Any], now: float | None, source: str | None = None
    ) -> None:
        """Store records received at monitor time `now` (see [Note: clocks]) through the
        relay connection `source`; with `now=None` (replay) each record counts as
        received at its own `time`."""
        ranks = self.ranks
        steps = self._steps
        rank_history = self.settings.rank_history
        scores = self.stragglers
        for rec in records:
            try:
                rank = rec["rank"]
                step = rec["step"]
            except (TypeError, KeyError, IndexError):
                self.bad_records += 1
                continue
            if type(rank) is not int or type(step) is not int or type(rec) is not dict:
                self.bad_records += 1
                continue
            seen = now
            if seen is None:
                t = rec.get("time")
                seen = t if _real(t) else 0.0
            state = ranks.get(rank)
            if state is None:
                state = _RankState(rec, seen, deque(maxlen=rank_history))
                ranks[rank] = state
                if self.first_time is None:
                    t = rec.get("time")
                    self.first_time = t if _real(t) else seen
            state.record = rec
            state.last_seen = seen
            state.source = source
            state.status_override = None
            state.ended_at = None
            loss = rec.get("loss")
            state.history.append((step, rec.get("step_time_s"), loss, rec.get("mem_allocated")))
            scores.add(rank, step, rec)
            if scores.has_events:
                self._made(scores.take_events(), rec, seen)
            agg = steps.get(step) or self._new_step(step)
            if agg is None:
                continue  # older than everything kept: too late for the curves
            if _finite(loss):
                agg.loss_sum += loss
                agg.loss_n += 1
            tps = rec.get("tokens_per_s")
            if _summable(tps):
                agg.tps_sum += tps
                agg.tps_n += 1

    def _new_step(self, step: int) -> _StepAggregate | None:
        """The curves' aggregate for a step not seen yet (None: older than all kept)."""
        steps = self._steps
        if len(steps) >= self.settings.history_steps and step < next(iter(steps)):
            return None
        out_of_order = bool(steps) and step < next(reversed(steps))
        agg = steps[step] = _StepAggregate()
        if out_of_order:
            # A step older than the newest (after a gap): keep the dict sorted.
            for key in sorted(steps):
                steps.move_to_end(key)
        if len(steps) > self.settings.history_steps:
            steps.popitem(last=False)
        return agg

    def add_columns(
        self, block: RecordColumns, now: float | None, source: str | None = None
    ) -> None:
        """Store a block of records received as columns (protocol 1.1): the same outcome
        as `add_records(block.rows(), ...)`, cheaper (monitor/columns_ingest.py [Note:
        ingesting columns])."""
        add_columns(self, block, now, source)

    def _made(self, events: list[dict[str, Any]], rec: dict[str, Any], seen: float) -> None:
        """Stamp events this model made with the record's run and the arrival time."""
        for event in events:
            event["time"] = seen
            event["run_id"] = rec.get("run_id")
            self.events.append(event)
            self.made_events.append(event)

    def set_reachable(self, source: str, reachable: bool, now: float) -> None:
        """The relay connection `source` went down (or came back): its ranks show as
        unreachable (or recover), with one event for the node when it had ranks of this
        run (monitor/nodes.py [Note: unreachable nodes])."""
        if reachable == (source not in self.unreachable):
            return  # no change (the receiver reports every failed reconnect)
        if reachable:
            self.unreachable.discard(source)
        else:
            self.unreachable.add(source)
        behind = [s.record for s in self.ranks.values() if s.source == source]
        if behind:
            self._made([relay_event(source, behind, lost=not reachable)], behind[-1], now)

    def add_dumps(self, dumps: Iterable[Any]) -> None:
        """Store ranks' hang dumps (malformed ones are counted as bad records)."""
        for dump in dumps:
            if not self.dumps.add(dump):
                self.bad_records += 1

    def take_made_events(self) -> list[dict[str, Any]]:
        """The events made since the last call (the app writes them to its events log)."""
        out, self.made_events = self.made_events, []
        return out

    def add_events(self, events: Iterable[Any], now: float | None = None) -> None:
        """Store events received at monitor time `now`; `exit`, `exception` and
        `disconnected` change the rank's status. With `now=None` (replay) an event counts
        as received at its own `time` (see [Note: clocks])."""
        for event in events:
            if not isinstance(event, dict):
                continue
            self.events.append(event)
            rank = event.get("rank")
            kind = event.get("kind")
            detail = event.get("detail")
            detail = detail if isinstance(detail, dict) else {}
            if kind == "start":
                total = detail.get("total_steps")
                if type(total) is int and total > 0:
                    self.total_steps = total
                world = detail.get("world_size")
                if type(world) is int and world > 0:
                    self.world_size = world
                    self.stragglers.world_size = world
                t = _number(event.get("time"))
                if t is not None and (self.first_time is None or t < self.first_time):
                    self.first_time = t  # the run started before its first record
            state = self.ranks.get(rank) if type(rank) is int else None
            if state is None:
                continue
            if kind == "exception":
                if detail.get("type") == "RankFailureError":
                    # It stops because another rank failed, named in failed_rank when
                    # known: an orderly exit, not an error of its own (PROTOCOL.md).
                    named = detail.get("failed_rank")
                    state.peer_failed = True
                    state.stopped_by = named if type(named) is int else None
                else:
                    state.error = True
            elif kind == "exit":
                own = detail.get("reason") == "exception" and not state.peer_failed
                failed = state.error or own
                state.status_override = RankStatus.DEAD if failed else RankStatus.EXITED
                state.ended_at = self._arrival(event, now, state)
            elif kind == "disconnected":
                # The relay saw the rank's connection close without an exit event: the
                # process is gone (a later record, after a reconnect, clears this).
                state.status_override = RankStatus.DEAD
                state.ended_at = self._arrival(event, now, state)

    @staticmethod
    def _arrival(event: dict[str, Any], now: float | None, state: _RankState) -> float:
        if now is None:
            t = _number(event.get("time"))
            now = state.last_seen if t is None else t
        return max(now, state.last_seen)

    @staticmethod
    def _stopped_at(
        statuses: list[tuple[int, _RankState, RankStatus, float, dict[str, Any]]], dead_after: float
    ) -> float:
        """When the run's clock stopped: the moment the monitor saw its last rank stop.

        [Note: elapsed never shrinks] While any rank runs, elapsed is `now - first_time`.
        The clock stops when the last rank stops *as the monitor saw it*: its exit or
        disconnect arrived (`ended_at`), or it was declared dead (`dead_after` after its
        last record). Each of these is at or after every refresh that still showed the
        rank running, so elapsed never goes backwards (it used to drop to the last
        record's time, e.g. 0:26 -> 0:23 while the ranks shut down).
        """
        end = -math.inf
        for _, state, _, _, _ in statuses:
            if state.status_override is not None:
                stopped = state.last_seen if state.ended_at is None else state.ended_at
            else:  # dead by age
                stopped = state.last_seen + dead_after
            end = max(end, stopped)
        return end

    def history(self, rank: int) -> list[RankHistoryPoint]:
        """The rank's recent steps, oldest first (empty for an unknown rank)."""
        state = self.ranks.get(rank)
        if state is None:
            return []
        return [
            RankHistoryPoint(step, _number(st), _number(loss), _number(mem))
            for step, st, loss, mem in state.history
        ]

    def rank_events(self, rank: int) -> list[dict[str, Any]]:
        """The kept events of one rank, oldest first."""
        return [e for e in self.events if e.get("rank") == rank]

    def snapshot(self, now: float) -> Snapshot:
        """Statuses, outliers, summary and curves at monitor time `now`."""
        if self.unbuilt:
            materialise(self.ranks.values())
            self.unbuilt = False
        cfg = self.settings
        alive, stale, dead = RankStatus.ALIVE, RankStatus.STALE, RankStatus.DEAD
        stale_after, dead_after = cfg.stale_after_s, cfg.dead_after_s
        statuses: list[tuple[int, _RankState, RankStatus, float, dict[str, Any]]] = []
        live_step_times: list[float] = []
        named_first: set[int] = set()  # ranks named by another rank's RankFailureError
        lost = self.unreachable
        unreachable = RankStatus.UNREACHABLE
        # [Note: snapshot loop] Run per rank at every refresh (4,096 x 2 Hz): exact type
        # tests inline rather than `_real` / `_finite` calls, and no dict keyed by the
        # status enum (its __hash__ is Python code): ~30% of the loop's time.
        for rank, state in self.ranks.items():
            if state.stopped_by is not None:
                named_first.add(state.stopped_by)
            age = now - state.last_seen
            if age < 0.0:
                age = 0.0
            status = state.status_override
            if status is None:
                if lost and state.source in lost:
                    status = unreachable
                else:
                    status = dead if age > dead_after else stale if age > stale_after else alive
            rec = state._record  # (built above: no record is pending)
            assert rec is not None
            statuses.append((rank, state, status, age, rec))
            st = rec.get("step_time_s")
            if status is alive and (type(st) is float or type(st) is int) and st > 0:
                live_step_times.append(st)
        median_st = statistics.median(live_step_times) if live_step_times else None
        straggler_cut = math.inf
        if median_st is not None and len(live_step_times) >= 2:
            straggler_cut = median_st * cfg.straggler_factor
        mem_cut = cfg.memory_fraction
        # Phase stragglers are flagged too: in synchronous training a straggler's step
        # time is everyone's, so the step-time rule alone would never mark it.
        phase_slow = self.stragglers.flagged()
        # A running rank silent for hang_factor median steps may be stuck (needs a median).
        hang_after = math.inf if median_st is None else median_st * cfg.hang_factor

        # Plain int bits in the loop (enum.Flag arithmetic costs microseconds per use).
        b_straggler, b_memory, b_nan = Flag.STRAGGLER.value, Flag.MEMORY.value, Flag.NAN_LOSS.value
        b_stale, b_error = Flag.STALE.value, Flag.ERROR.value
        b_first, b_peer = Flag.FAILED_FIRST.value, Flag.PEER_FAILED.value
        b_hung, b_unreachable = Flag.HUNG.value, Flag.UNREACHABLE.value
        exited = RankStatus.EXITED
        rows: dict[int, RankRow] = {}
        n_alive = n_stale = n_dead = n_exited = n_unreachable = 0
        loss_sum, loss_n = 0.0, 0
        tps_total = 0.0
        tps_seen = False
        steps: list[int] = []  # of live (or finished) ranks: the slowest one is shown
        all_steps: list[int] = []  # of every rank: the run got at least this far
        dropped = 0
        outliers = 0
        big = _MAX
        for rank, state, status, age, rec in statuses:
            if status is alive:
                n_alive += 1
                bits = 0
            elif status is stale:
                n_stale += 1
                bits = b_stale
            elif status is dead:
                n_dead += 1
                bits = b_stale
            elif status is exited:
                n_exited += 1
                bits = 0
            else:
                n_unreachable += 1
                bits = 0
            if state.error:
                bits |= b_error
            if state.peer_failed:
                bits |= b_peer
            if rank in named_first:
                bits |= b_first
            if status is unreachable:
                bits |= b_unreachable
            elif state.status_override is None and age > hang_after:
                bits |= b_hung
            st = rec.get("step_time_s")
            slow_step = (type(st) is float or type(st) is int) and st > straggler_cut
            if slow_step or (phase_slow and rank in phase_slow):
                bits |= b_straggler
            loss = rec.get("loss")
            finite_loss = False
            if type(loss) is float or type(loss) is int:
                finite_loss = -big <= loss <= big  # NaN compares false
                if not finite_loss:
                    bits |= b_nan
            mem_frac = None
            cap = rec.get("device_mem_total")
            if (type(cap) is float or type(cap) is int) and cap > 0:
                used = rec.get("mem_reserved")
                nvml = rec.get("device_mem_used")
                if not (type(used) is float or type(used) is int):
                    used = 0
                if (type(nvml) is float or type(nvml) is int) and nvml > used:
                    used = nvml
                mem_frac = used / cap
                if mem_frac > mem_cut:
                    bits |= b_memory
            if bits:
                outliers += 1
            rows[rank] = RankRow(
                rank, rec, status, FLAGS_BY_BITS[bits], age, mem_frac, state.stopped_by
            )
            drop = rec.get("dropped")
            if type(drop) is int:
                dropped += drop
            step = rec["step"]
            all_steps.append(step)
            if status is alive or status is exited:
                steps.append(step)
                if finite_loss:
                    loss_sum += loss  # type: ignore[operator]  # (finite: a real number)
                    loss_n += 1
                tps = rec.get("tokens_per_s")
                if status is alive and (
                    type(tps) is float or (type(tps) is int and -big <= tps <= big)
                ):
                    tps_total += tps
                    tps_seen = True
        counts = {
            alive: n_alive,
            stale: n_stale,
            dead: n_dead,
            exited: n_exited,
            unreachable: n_unreachable,
        }
        losses_mean = loss_sum / loss_n if loss_n else None

        step = max(all_steps) if all_steps else None
        elapsed = None
        if self.first_time is not None and self.ranks:
            end = now
            if not counts[alive] and not counts[stale] and not counts[unreachable]:
                end = self._stopped_at(statuses, dead_after)
            elapsed = max(0.0, end - self.first_time)
        eta = None
        if self.total_steps is not None and step is not None and median_st is not None:
            eta = max(0, self.total_steps - step) * median_st
        summary = Summary(
            step=step,
            min_step=min(steps) if steps else None,
            loss=losses_mean,
            tokens_per_s=tps_total if tps_seen else None,
            alive=counts[RankStatus.ALIVE],
            stale=counts[RankStatus.STALE],
            dead=counts[RankStatus.DEAD],
            exited=counts[RankStatus.EXITED],
            elapsed_s=elapsed,
            eta_s=eta,
            median_step_time_s=median_st,
            outliers=outliers,
            dropped=dropped,
            missing=max(0, (self.world_size or 0) - len(self.ranks)),
            unreachable=counts[unreachable],
        )
        loss_curve = [(s, a.loss_sum / a.loss_n) for s, a in self._steps.items() if a.loss_n]
        tput_curve = [(s, a.tps_sum) for s, a in self._steps.items() if a.tps_n]
        if len(tput_curve) >= 2:
            # The newest step is usually reported by only some ranks so far: scale its
            # per-rank mean to the previous step's rank count so it does not show as a dip.
            aggs = [a for a in self._steps.values() if a.tps_n]
            last, prev = aggs[-1], aggs[-2]
            n = max(last.tps_n, prev.tps_n)
            tput_curve[-1] = (tput_curve[-1][0], last.tps_sum / last.tps_n * n)
        top = self.stragglers.top(cfg.top_stragglers)
        return Snapshot(now, summary, rows, loss_curve, tput_curve, top, node_rows(rows.values()))
