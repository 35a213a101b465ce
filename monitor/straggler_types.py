"""What straggler scoring is about and what it shows: the phase names and labels, the
phases that can be named as a cause, the thresholds (`ScoreSettings`), one rank's row in
the stragglers view (`StragglerRow`) and the text that compares a time with its median.
The scoring itself: monitor/stragglers.py [Note: straggler scoring]. Pure Python, no
numpy, no Textual."""

from __future__ import annotations

from dataclasses import dataclass
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
CAUSES = tuple(i for i, name in enumerate(PHASE_NAMES) if name != "comm_wait")
"""Indexes of the phases that can be named as a rank's cause of slowness: every phase but
comm wait, which a rank pays for *other* ranks being slow (monitor/stragglers.py [Note:
straggler scoring])."""


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
    excess: float | None = None
    """That phase's time minus its median at the last scored step, seconds."""

    def text(self) -> str:
        """'rank 517 on node031: data wait 2.3x median, chronic for 40 steps'."""
        where = f" on {self.host}" if self.host is not None else ""
        state = f"chronic for {self.chronic_steps} steps" if self.chronic else "one-off"
        how = compare_text(self.ratio, self.excess)
        return f"rank {self.rank}{where}: {PHASE_LABELS[self.phase]} {how}, {state}"


RATIO_SHOWN_UP_TO = 100.0
"""Above this a phase's ratio to its median is shown as its excess in seconds
(monitor/stragglers.py [Note: straggler scoring])."""


def compare_text(ratio: float | None, excess: float | None) -> str:
    """'2.3x median', or '+0.300 s over median' where the median is (near) 0."""
    if ratio is not None and ratio <= RATIO_SHOWN_UP_TO:
        return f"{ratio:.1f}x median"
    if excess is not None:
        return f"+{excess:.3f} s over median"
    return "- median"


def is_real(value: Any) -> bool:
    """An int or float (not a bool, str or None: the monitor survives any publisher)."""
    t = type(value)
    return t is float or t is int
