"""Live traffic coalesced into `batch` frames for monitors that ask for it (the hello's
`batch_s`, monitor/PROTOCOL.md "Batches"); stdlib + msgpack, used by the relay.

[Note: relay coalescing]
A relay forwards each rank's frame as it came: with 1,024 ranks that is thousands of
small frames a second to every monitor, and each one costs the monitor a read, a decode,
a validation walk and an event-loop turn, although it redraws only a few times a second.
A monitor that says how often it refreshes (`batch_s`) instead gets one `batch` frame per
interval holding every record and event that came meanwhile (split under the frame
limit): the per-frame cost is paid once per refresh. Opt-in keeps the protocol backward
compatible both ways: a monitor that does not ask (any client written before `batch`
existed) gets `records` / `events` frames exactly as before, and a relay that does not
know `batch_s` ignores it (unknown hello fields are ignored), so a new monitor still
reads plain frames. What the relay keeps (history, the replay log, the Prometheus
gauges) is unchanged: only what goes out to that monitor is regrouped.

The relay re-encodes the items it already decoded (it decodes every frame to check it),
once per interval per monitor; the budget counts the bodies they came in, so a batch
never exceeds the frame limit: a batch body is never larger than the sum of the bodies
its items came in (each of those spent at least 20 bytes on its own "type" and list
key), and a frame too large for the budget is forwarded to the monitor as it came.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from fsdpx.telemetry.wire.columns import to_columns
from fsdpx.telemetry.wire.protocol import MAX_FRAME_BYTES, TAG_BYTES

BATCH_S_MIN = 0.01
BATCH_S_MAX = 10.0
"""The hello's `batch_s` range in seconds (a relay refuses a hello outside it)."""
BUDGET_BYTES = MAX_FRAME_BYTES - TAG_BYTES - 1024
"""Incoming body bytes one batch frame may take in; a larger frame goes out as it came."""


def encode_batches(records: list[Any], events: list[Any], *, columns: bool = False) -> list[bytes]:
    """Bodies of `batch` messages carrying these items in order, each small enough for a
    tagged frame (halved until it is; a single item always fits: see the module note).
    Empty lists are left out of the message (readers take a missing list as empty).
    `columns`: records with equal keys go as `record_columns` (protocol 1.1,
    fsdpx/telemetry/wire/columns.py [Note: columnar batches])."""
    message: dict[str, Any] = {"type": "batch"}
    if records:
        block = to_columns(records) if columns else None
        if block is None:
            message["records"] = records
        else:
            message["record_columns"] = block
    if events:
        message["events"] = events
    body: bytes = msgpack.packb(message, use_bin_type=True)
    if len(body) <= MAX_FRAME_BYTES - TAG_BYTES or len(records) + len(events) <= 1:
        return [body]
    if len(records) > 1:
        half = len(records) // 2
        return encode_batches(records[:half], [], columns=columns) + encode_batches(
            records[half:], events, columns=columns
        )
    if records:  # one record and some events
        return encode_batches(records, [], columns=columns) + encode_batches([], events)
    half = len(events) // 2
    return encode_batches([], events[:half]) + encode_batches([], events[half:])


@dataclass
class Coalescer:
    """One monitor's pending live items (see [Note: relay coalescing]).

    Example::

        c = Coalescer(interval_s=0.5)
        send_now = c.add(records, [], body_bytes=len(body), now=time.monotonic())
        if c.due is not None and time.monotonic() >= c.due:
            send_now += c.flush()
    """

    interval_s: float
    columns: bool = False
    """Send records as `record_columns` where they have equal keys (hello `columns`)."""
    records: list[Any] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    pending_bytes: int = 0
    due: float | None = None
    """Monotonic time the pending items go out; None while nothing is pending."""

    def fits(self, body_bytes: int) -> bool:
        """Can a frame of this body size be coalesced at all (else forward it whole)?"""
        return body_bytes <= BUDGET_BYTES

    def add(
        self, records: list[Any], events: list[Any], *, body_bytes: int, now: float
    ) -> list[bytes]:
        """Take in one frame's items (`body_bytes`: its body size, at most BUDGET_BYTES).
        Returns the batch bodies to send at once: what was pending, when these would
        overflow one frame's budget."""
        out = self.flush() if self.pending_bytes + body_bytes > BUDGET_BYTES else []
        self.records.extend(records)
        self.events.extend(events)
        self.pending_bytes += body_bytes
        if self.due is None:
            self.due = now + self.interval_s
        return out

    def flush(self) -> list[bytes]:
        """The pending items as batch bodies (none when nothing is pending); resets."""
        if not self.records and not self.events:
            self.due = None
            return []
        out = encode_batches(self.records, self.events, columns=self.columns)
        self.records, self.events = [], []
        self.pending_bytes, self.due = 0, None
        return out
