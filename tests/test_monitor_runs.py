"""The monitor's run selector, driven headless with Pilot: a new run is shown (and starts
clean) as it arrives, `p` / `n` step through the runs, the summary bar names the run."""

from __future__ import annotations

import asyncio
import html
import re
from pathlib import Path
from typing import Any

from monitor.app import MonitorApp
from monitor.messages import TelemetryBatch
from monitor.state import Flag


def screen_text(app: MonitorApp) -> str:
    texts = re.findall(r"<text [^>]*>(.*?)</text>", app.export_screenshot())
    return html.unescape("".join(texts)).replace("\xa0", " ")


def _run(run: str, t0: float, *, fail_rank: int | None = None) -> TelemetryBatch:
    events: list[dict[str, Any]] = [
        {"rank": r, "host": "h", "kind": "start", "time": t0, "step": 0, "run_id": run,
         "detail": {"world_size": 2, "job": "nightly"}}
        for r in (0, 1)
    ]  # fmt: skip
    records = [
        {"rank": r, "host": "h", "step": s, "time": t0 + s, "loss": 1.0, "step_time_s": 1.0,
         "run_id": run, "job": "nightly"}
        for s in (1, 2) for r in (0, 1)
    ]  # fmt: skip
    if fail_rank is not None:
        events.append(
            {"rank": fail_rank, "host": "h", "kind": "exception", "time": t0 + 2, "step": 2,
             "run_id": run, "detail": {"type": "RuntimeError", "message": "boom"}}
        )  # fmt: skip
    return TelemetryBatch("test", records, events, received_at=t0 + 2)


def test_run_selector(tmp_path: Path) -> None:
    asyncio.run(_selector(tmp_path))


async def _selector(tmp_path: Path) -> None:
    app = MonitorApp(sources=[str(tmp_path / "nobody.sock")], clock=lambda: 103.0)
    async with app.run_test(size=(120, 30)) as pilot:
        app.post_message(_run("a", 100.0, fail_rank=1))
        await pilot.pause()
        await pilot.press("p")  # one run: nothing to step to
        app.refresh_view()
        await pilot.pause()
        assert app.shown_run == "a" and "run 1/1 a job nightly" in screen_text(app)
        assert Flag.ERROR in app.snapshot.rows[1].flags

        # A new run of the same job on the same relay: shown at once, clean.
        app.post_message(_run("b", 100.5))
        await pilot.pause()
        app.refresh_view()
        await pilot.pause()
        assert app.shown_run == "b"
        assert "run 2/2 b job nightly (resume)" in screen_text(app)
        assert not any(Flag.ERROR in row.flags for row in app.snapshot.rows.values())
        assert "RuntimeError" not in screen_text(app)  # the events log shows run b's

        await pilot.press("p")  # back to the first run, its error and its events
        await pilot.pause()
        assert app.shown_run == "a" and "run 1/2 a job nightly" in screen_text(app)
        assert Flag.ERROR in app.snapshot.rows[1].flags
        assert "RuntimeError" in screen_text(app)

        # A picked run stays on screen when another arrives.
        app.post_message(_run("c", 101.0))
        await pilot.pause()
        app.refresh_view()
        await pilot.pause()
        assert app.shown_run == "a" and "run 1/3 a" in screen_text(app)

        await pilot.press("n", "n")  # forward to the newest: new runs are followed again
        await pilot.pause()
        assert app.shown_run == "c" and app.follow_newest
        app.post_message(_run("d", 102.0))
        await pilot.pause()
        assert app.shown_run == "d"
