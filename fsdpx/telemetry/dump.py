"""A rank's hang dump: the Python stacks of all its threads and the last collectives it
entered, made on the telemetry sender thread when a monitor asks (monitor/PROTOCOL.md
"Hang dumps").

[Note: dumping from the sender thread]
A rank that hangs is usually blocked in a collective (gloo or NCCL) on its training
thread. The c10d calls release the GIL while they wait, so the publisher's sender thread
still runs: it reads the monitor's `dump_request` from its relay connection and answers
with `sys._current_frames()` (every thread's current frame; the training thread's shows
the collective call it is inside) and fsdpx.comm's log (which collectives it entered and
which returned: [Note: one comm log] in fsdpx/comm/counted.py). Nothing here touches the
training thread or torch, so a dump cannot harm the run: the collective goes on (or times
out) exactly as it would have.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Any

from fsdpx.comm.counted import comm_log

MAX_STACK_CHARS = 6000
"""Characters kept of each thread's formatted stack (its innermost frames)."""
LAST_COLLECTIVES = 16
"""Collectives listed per dump (the most recent)."""


def collectives(last: int = LAST_COLLECTIVES) -> dict[str, Any]:
    """fsdpx.comm's view: how many collectives this rank entered and how many returned,
    and the last `last` of them as {seq, kind, done}."""
    log = comm_log()
    records = log.records[-last:]
    completed = log.completed
    return {
        "entered": log.mark(),
        "completed": completed,
        "last": [{"seq": r.seq, "kind": r.kind, "done": r.seq < completed} for r in records],
    }


def thread_stacks() -> list[dict[str, Any]]:
    """Every thread's stack, innermost frame last, the main thread first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    out = []
    for ident, frame in sys._current_frames().items():
        text = "".join(traceback.format_stack(frame))[-MAX_STACK_CHARS:]
        out.append({"name": names.get(ident, str(ident)), "main": ident == main, "stack": text})
    out.sort(key=lambda t: not t["main"])
    return out


def make_dump(
    request_id: Any, *, rank: int, host: str, pid: int, run_id: str | None, step: int | None
) -> dict[str, Any]:
    """The `dump` item answering one request (see PROTOCOL.md for its fields)."""
    return {
        "rank": rank,
        "host": host,
        "pid": pid,
        "run_id": run_id,
        "time": time.time(),
        "request_id": request_id,
        "step": step,
        "threads": thread_stacks(),
        "collectives": collectives(),
    }
