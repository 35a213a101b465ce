"""Plain progress lines from telemetry (`fsdpx demo` when stdout is not a terminal).

One line per `every` steps, at exactly those steps (4, 8, 12 for `--every 4`, then the
last step), each with that step's own mean loss and summed throughput. Telemetry arrives
in batches that may skip over a multiple (steps 7..9 in one batch): a line is written
for every multiple once the slowest running rank has reported it, never for whichever
step happened to be newest when a batch arrived (which printed 4, 9, 12).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from monitor.model import MonitorModel, Snapshot
from monitor.table_view import fmt_duration, fmt_float, fmt_si


@dataclass
class ProgressLines:
    """Turns telemetry batches into progress lines.

    Args:
        every: steps per line.
        steps: the run's last step (always gets a line).

    Example::

        lines = ProgressLines(every=4, steps=12)
        for text in lines.feed(records, events, now=time.time()):
            print(text)
    """

    every: int
    steps: int
    model: MonitorModel = field(default_factory=MonitorModel)
    _next: int = field(init=False)

    def __post_init__(self) -> None:
        if self.every < 1 or self.steps < 1:
            raise ValueError(f"every and steps must be >= 1; got {self.every}, {self.steps}")
        self._next = min(self.every, self.steps)

    def feed(self, records: Iterable[Any], events: Iterable[Any], now: float) -> list[str]:
        """Take a batch received at `now`; the lines now due, oldest step first."""
        self.model.add_records(records, now=now)
        self.model.add_events(events, now=now)
        snap = self.model.snapshot(now)
        return self._due(snap, snap.summary.min_step)

    def finish(self, now: float) -> list[str]:
        """The lines still due once the training ended (up to the furthest step seen:
        a rank that died does not hold back the others' lines)."""
        snap = self.model.snapshot(now)
        return self._due(snap, snap.summary.step)

    def _due(self, snap: Snapshot, reached: int | None) -> list[str]:
        if reached is None:
            return []
        loss_at = dict(snap.loss_curve)
        tps_at = dict(snap.throughput_curve)
        s = snap.summary
        lines = []
        while self._next <= min(reached, self.steps):
            k = self._next
            lines.append(
                f"step {k:5d}  loss {fmt_float(loss_at.get(k), 4)}  tok/s {fmt_si(tps_at.get(k))}"
                f"  ranks {s.alive} alive {s.stale} stale {s.dead} dead {s.exited} exited"
                f"  elapsed {fmt_duration(s.elapsed_s)}"
            )
            self._next = self.steps + 1 if k == self.steps else min(k + self.every, self.steps)
        return lines
