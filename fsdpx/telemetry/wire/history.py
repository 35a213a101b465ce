"""The relay's bounded memory of the run, sent to monitors that join late.

Per (run, host, rank): the last `recent` records at full resolution plus a thinned record of
everything older (at most `sparse` records; when full, every other one is dropped and
the stride doubles), so a late monitor sees the whole run's curves, coarse, and the
recent past in detail, in bounded memory. Records and events are kept msgpack-encoded
(a third of the size of a dict) and spliced into "history" frames without re-encoding.
An item too large for any history frame is kept as a small stand-in marked `truncated`
(see [Note: oversized history items]).

Runs are kept apart (a relay can outlive a job: fsdpx/telemetry/wire/runs.py [Note: run
identity]): a rank's records of two runs never share one history, and only the newest
`max_runs` runs are remembered, so a relay serving job after job stays bounded.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import msgpack

from fsdpx.telemetry.wire.protocol import EVENT_FIELDS, MAX_FRAME_BYTES, RECORD_FIELDS

_PACKER_OVERHEAD = 64  # map header, keys, array headers of one history body
_FRAME_LIMIT = MAX_FRAME_BYTES - 64  # room for a monitor connection's 32-byte HMAC tag
MAX_ITEM_BYTES = _FRAME_LIMIT - _PACKER_OVERHEAD
"""Largest encoded record or event that fits in a history frame; larger ones are kept
as stand-ins (`truncated`)."""
_STAND_IN_FIELD_BYTES = 1024  # a stand-in keeps a field only when it encodes this small
_STAND_IN_BYTES = 16 << 10  # and only while the stand-in stays under this

# [Note: oversized history items]
# A legal frame (body up to 1 MiB) can hold one record or event that does not fit in
# a history frame next to the history message's own keys and a monitor's HMAC tag
# (e.g. an "exception" event with a ~1 MiB detail). It is forwarded live and logged
# whole; history keeps a stand-in instead of leaving it out silently: the known fields
# whose values are small (others nil), other small fields while the stand-in stays
# under 16 KiB, `truncated` = the item's encoded size, and for an event whose detail
# was left out a str detail saying so. Counted in History.truncated.


class _RankHistory:
    __slots__ = ("recent", "sparse", "stride", "evicted", "sparse_max")

    def __init__(self, recent: int, sparse: int) -> None:
        self.recent: deque[bytes] = deque(maxlen=recent)
        self.sparse: list[bytes] = []
        self.sparse_max = sparse
        self.stride = 1
        self.evicted = 0

    def add(self, packed: bytes) -> None:
        if len(self.recent) == self.recent.maxlen:
            old = self.recent[0]
            if self.evicted % self.stride == 0 and self.sparse_max > 0:
                self.sparse.append(old)
                if len(self.sparse) > self.sparse_max:
                    self.sparse = self.sparse[::2]
                    self.stride *= 2
            self.evicted += 1
        self.recent.append(packed)

    def __iter__(self) -> Iterator[bytes]:
        yield from self.sparse
        yield from self.recent


class History:
    """Bounded per-rank record history and a bounded event list.

    Args:
        recent: records per rank kept at full resolution.
        sparse: older records per rank kept, thinned.
        max_events: events kept (oldest dropped).
        max_ranks: distinct (run, host, rank) keys kept; records of further keys are
            forwarded live but not remembered.
        max_runs: runs kept (by first arrival); a new run beyond it evicts the oldest
            run's records (its events stay until the event list drops them).

    Example::

        h = History(recent=256, sparse=256, max_events=10_000, max_ranks=65_536)
        h.add_records(message["records"])
        for body in h.frames():
            send(body)
    """

    def __init__(
        self, *, recent: int, sparse: int, max_events: int, max_ranks: int, max_runs: int = 4
    ) -> None:
        self._ranks: dict[tuple[Any, Any, Any], _RankHistory] = {}
        self._runs: dict[Any, None] = {}  # run ids in order of first arrival
        self._events: deque[bytes] = deque(maxlen=max_events)
        self._recent, self._sparse, self._max_ranks = recent, sparse, max_ranks
        self.truncated = 0
        """Items kept as stand-ins, see [Note: oversized history items]."""
        self._max_runs = max_runs

    def add_records(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            run = record.get("run_id")
            key = (run, record.get("host"), record.get("rank"))
            hist = self._ranks.get(key)
            if hist is None:
                if run not in self._runs:
                    self._new_run(run)
                if len(self._ranks) >= self._max_ranks:
                    continue
                hist = self._ranks[key] = _RankHistory(self._recent, self._sparse)
            hist.add(self._pack(record, RECORD_FIELDS))

    def _new_run(self, run: Any) -> None:
        self._runs[run] = None
        while len(self._runs) > self._max_runs:
            oldest = next(iter(self._runs))
            del self._runs[oldest]
            self._ranks = {k: h for k, h in self._ranks.items() if k[0] != oldest}

    def add_events(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            self._events.append(self._pack(event, EVENT_FIELDS))

    def _pack(self, item: dict[str, Any], known: tuple[str, ...]) -> bytes:
        packed = msgpack.packb(item, use_bin_type=True)
        if len(packed) <= MAX_ITEM_BYTES:
            return packed
        self.truncated += 1
        return msgpack.packb(_stand_in(item, known, len(packed)), use_bin_type=True)

    @property
    def num_ranks(self) -> int:
        return len(self._ranks)

    @property
    def runs(self) -> list[Any]:
        """Run ids whose records are kept, oldest first (None: records without one)."""
        return list(self._runs)

    def frames(self, limit: int = _FRAME_LIMIT) -> Iterator[bytes]:
        """msgpack bodies of "history" messages, each under `limit` bytes; the last has
        more=False. Records are grouped by rank, each rank's in arrival order; events
        come after all records. Always yields at least one (possibly empty) body. With
        the default limit every kept item fits (oversized ones are stand-ins)."""
        records = [r for hist in self._ranks.values() for r in hist]
        events = list(self._events)
        chunk_r: list[bytes] = []
        chunk_e: list[bytes] = []
        size = _PACKER_OVERHEAD
        items = [(True, r) for r in records] + [(False, e) for e in events]
        for is_record, packed in items:
            if len(packed) + _PACKER_OVERHEAD > limit:
                continue  # only with a limit below the default (stand-ins fit that)
            if size + len(packed) > limit:
                yield _history_body(chunk_r, chunk_e, more=True)
                chunk_r, chunk_e, size = [], [], _PACKER_OVERHEAD
            (chunk_r if is_record else chunk_e).append(packed)
            size += len(packed)
        yield _history_body(chunk_r, chunk_e, more=False)


def _history_body(records: list[bytes], events: list[bytes], *, more: bool) -> bytes:
    """A "history" message body spliced from already-packed items (no re-encoding)."""
    packer = msgpack.Packer(use_bin_type=True)
    parts = [
        packer.pack_map_header(4),
        packer.pack("type"),
        packer.pack("history"),
        packer.pack("records"),
        packer.pack_array_header(len(records)),
        *records,
        packer.pack("events"),
        packer.pack_array_header(len(events)),
        *events,
        packer.pack("more"),
        packer.pack(more),
    ]
    body = b"".join(parts)
    assert len(body) <= MAX_FRAME_BYTES, len(body)
    return body


def _stand_in(item: dict[str, Any], known: tuple[str, ...], size: int) -> dict[str, Any]:
    """A small copy of an item too large for a history frame, see
    [Note: oversized history items]."""
    out: dict[str, Any] = {}
    budget = _STAND_IN_BYTES
    known_set = set(known)
    for name in (*known, *(k for k in item if k not in known_set)):
        value = item.get(name)
        cost = len(msgpack.packb(name)) + len(msgpack.packb(value, use_bin_type=True))
        if cost <= min(_STAND_IN_FIELD_BYTES, budget):
            out[name] = value
            budget -= cost
        elif name in known_set:
            out[name] = None
    if "detail" in known_set and out["detail"] is None and item.get("detail") is not None:
        out["detail"] = (
            f"[left out of the relay's history: this event encodes to {size} bytes, more "
            "than a history frame holds; the live frame and the relay's log have it whole]"
        )
    out["truncated"] = size
    return out
