"""The `checkpoint_saved` / `checkpoint_loaded` telemetry events of the engine's saves and
loads (fields: monitor/PROTOCOL.md, Event; who sends them: [Note: checkpoint events] in
fsdpx/checkpoint/saving.py).

Example::

    on_commit = saved_reporter(engine.telemetry, step=engine.global_steps)
    checkpointer.save(root, model=model, tag="step100", on_commit=on_commit)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsdpx.checkpoint.loading import LoadResult
    from fsdpx.checkpoint.saving import Committed
    from fsdpx.telemetry.publisher import Publisher


def saved_reporter(publisher: Publisher | None, *, step: int) -> Callable[[Committed], None] | None:
    """The `on_commit` callback that sends `checkpoint_saved` for a save made at `step`
    (None without telemetry). Checkpointer calls it on rank 0 only, from the writer thread
    for a background save (Publisher.event only appends to a queue: safe there)."""
    if publisher is None:
        return None

    def send(c: Committed) -> None:
        detail = {"path": str(c.path), "tag": c.tag, "bytes": c.bytes}
        detail |= {"duration_s": c.duration_s, "async": c.background}
        publisher.event("checkpoint_saved", step=step, detail=detail)

    return send


def report_loaded(
    publisher: Publisher | None, result: LoadResult, *, step: int, duration_s: float
) -> None:
    """Send `checkpoint_loaded` on rank 0 (every rank loaded the same checkpoint; one event
    per load is what a monitor shows, as for saves)."""
    if publisher is None or publisher.rank != 0:
        return
    detail = {"path": str(result.path), "tag": result.path.name, "bytes": result.bytes}
    detail["duration_s"] = duration_s
    publisher.event("checkpoint_loaded", step=step, detail=detail)
