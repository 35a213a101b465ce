"""Messages the monitor's workers post to the app (small dataclasses, one module).

[Note: coalescing] Ranks publish thousands of records per second; the receiver batches
everything that arrived within `flush_interval_s` into one `TelemetryBatch`, so the app's
message queue sees a few messages per second per relay, not one per record. Status-like
messages (`ConnectionChanged`, `ReplayProgress`) replace a still-queued older one of the
same source: only the latest matters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from textual.message import Message

from monitor.receiver import Batch


@dataclass
class TelemetryBatch(Batch, Message):
    """A receiver `Batch` posted to the app: records and events received together (a
    `history`, or `flush_interval_s` of live traffic) from one source, at monitor time
    `received_at`. The fields are `Batch`'s, declared once there: the receiver stays free
    of Textual (the demo and tests use it without an app)."""


@dataclass
class ConnectionChanged(Message):
    """A relay connection came up, went down or was refused."""

    source: str
    connected: bool
    detail: str = ""

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, ConnectionChanged) and message.source == self.source


@dataclass
class ReplayLoaded(Message):
    """The replay log was read (or failed to read: `error` says why)."""

    path: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


@dataclass
class ReplayProgress(Message):
    """The replay's virtual clock moved (position, speed, pause state)."""

    position_s: float
    duration_s: float
    speed: float
    paused: bool

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, ReplayProgress)
