"""The replay player: a relay's log played back on a virtual clock (pause, seek, speed).

Pure logic, no Textual: the app loads the log in a worker (`load_log`), hands the messages
to a `ReplayPlayer`, and calls `advance(wall_seconds)` from a timer; the player returns
what to feed the model. Seeking backwards returns `reset=True` and everything up to the
new position (the model is rebuilt: cheaper and simpler than undoing records).

The virtual clock is the records' own `time` field (Unix seconds at the rank), so ages,
stale ranks and elapsed time in a replay are those a live monitor would have shown, and
a replay renders the same on any machine at any hour (the screenshot test relies on it).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fsdpx.telemetry.wire.logfile import iter_log

_EVENT, _RECORD, _DUMP = 0, 1, 2
SPEEDS: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


def load_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All messages of a replay log (see fsdpx/telemetry/wire/logfile.py).

    Raises:
        ValueError: not a telemetry log. OSError: unreadable file.
    """
    return list(iter_log(path))


@dataclass
class ReplayStep:
    """What one `advance`/`seek` delivers: feed `records` (each at its own time) and
    `events` to the model, after clearing it when `reset` is set."""

    reset: bool
    records: list[dict[str, Any]]
    events: list[dict[str, Any]]
    position: float
    dumps: list[dict[str, Any]] = field(default_factory=list)
    """Ranks' hang dumps the log holds (feed them to the model too)."""


@dataclass
class ReplayPlayer:
    """Plays a list of protocol messages on a virtual clock.

    Args:
        messages: messages in log order ("records", "events", "history", "dump"; others
            ignored).
        speed: virtual seconds per wall second.
        paused: start paused.

    Example::

        player = ReplayPlayer(load_log("run.tlm"))
        step = player.advance(0.1)       # 0.1 s of wall time at player.speed
        model.add_records(step.records, now=None)
    """

    messages: Iterable[dict[str, Any]]
    speed: float = 1.0
    paused: bool = False
    times: list[float] = field(init=False, default_factory=list)
    items: list[tuple[int, dict[str, Any]]] = field(init=False, default_factory=list)
    """(kind, item) in time order; kind: 0 event, 1 record, 2 hang dump."""
    cursor: int = field(init=False, default=0)
    position: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        if self.speed <= 0:
            raise ValueError(f"replay speed must be > 0; got {self.speed}")
        times: list[float] = []
        items: list[tuple[int, dict[str, Any]]] = []
        last = 0.0
        for message in self.messages:
            kind = message.get("type")
            records = message.get("records") if kind in ("records", "history") else None
            events = message.get("events") if kind in ("events", "history") else None
            dumps = [message.get("dump")] if kind == "dump" else None
            for code, batch in ((_RECORD, records), (_EVENT, events), (_DUMP, dumps)):
                if not isinstance(batch, list):
                    continue
                for item in batch:
                    if not isinstance(item, dict):
                        continue
                    t = item.get("time")
                    if isinstance(t, int | float) and not isinstance(t, bool):
                        last = float(t)
                    times.append(last)
                    items.append((code, item))
        # Stable sort by time: ranks' batches interleave in the log, the clock must not.
        order = sorted(range(len(times)), key=times.__getitem__)
        self.times = [times[i] for i in order]
        self.items = [items[i] for i in order]
        self.position = self.start

    @property
    def start(self) -> float:
        """Virtual time of the first item (0.0 for an empty log)."""
        return self.times[0] if self.times else 0.0

    @property
    def end(self) -> float:
        """Virtual time of the last item."""
        return self.times[-1] if self.times else 0.0

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def finished(self) -> bool:
        return self.cursor >= len(self.items)

    def _take(self, stop: int) -> tuple[list[dict[str, Any]], ...]:
        out: tuple[list[dict[str, Any]], ...] = ([], [], [])
        for code, item in self.items[self.cursor : stop]:
            out[code].append(item)
        self.cursor = stop
        return out[_RECORD], out[_EVENT], out[_DUMP]

    def advance(self, wall_s: float) -> ReplayStep:
        """Move the clock by `wall_s` x speed (not when paused or at the end) and return
        the items it passed."""
        if not self.paused:
            self.position = min(self.end, self.position + wall_s * self.speed)
        stop = bisect.bisect_right(self.times, self.position)
        records, events, dumps = self._take(max(stop, self.cursor))
        return ReplayStep(False, records, events, self.position, dumps)

    def seek(self, position: float) -> ReplayStep:
        """Jump to virtual time `position` (clamped to the log); going back resets."""
        position = min(self.end, max(self.start, position))
        stop = bisect.bisect_right(self.times, position)
        reset = stop < self.cursor
        if reset:
            self.cursor = 0
        self.position = position
        records, events, dumps = self._take(stop)
        return ReplayStep(reset, records, events, position, dumps)

    def seek_relative(self, delta_s: float) -> ReplayStep:
        """Seek by `delta_s` virtual seconds from the current position."""
        return self.seek(self.position + delta_s)

    def faster(self) -> float:
        """Next speed up (see SPEEDS); returns the new speed."""
        higher = [s for s in SPEEDS if s > self.speed]
        self.speed = higher[0] if higher else self.speed
        return self.speed

    def slower(self) -> float:
        """Next speed down; returns the new speed."""
        lower = [s for s in SPEEDS if s < self.speed]
        self.speed = lower[-1] if lower else self.speed
        return self.speed

    def toggle_pause(self) -> bool:
        """Pause or resume; returns the new paused state."""
        self.paused = not self.paused
        return self.paused
