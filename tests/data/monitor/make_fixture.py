"""Regenerate this folder's fixtures after an intentional change (review the diff!):

    python tests/data/monitor/make_fixture.py          # run.tlm: the fixed replay log
    python tests/data/monitor/make_fixture.py --svg    # expected.svg: the screenshot

run.tlm is 12 synthetic ranks x 80 steps written with the relay's own log writer: rank 3
is a straggler, rank 5 near its memory capacity, rank 7 has a NaN loss from step 40 and
rank 9 stops publishing after step 20. expected.svg is the monitor paused 15 s into that
replay in an 80x24 terminal (tests/test_monitor_app.py::test_screenshot_matches).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from monitor.synthetic import SyntheticRun  # noqa: E402

LOG = HERE / "run.tlm"
SVG = HERE / "expected.svg"
SCREEN_SIZE = (80, 24)
SEEK_S = 15.0


def fixture_run() -> SyntheticRun:
    return SyntheticRun(
        n_ranks=12,
        seed=0,
        straggler=3,
        memory_hog=5,
        nan_rank=7,
        nan_from_step=40,
        stop_rank=9,
        stop_after_step=20,
    )


def fixture_messages() -> list[dict]:
    return fixture_run().messages(steps=80, total_steps=200)


def write_log(path: Path) -> None:
    from fsdpx.telemetry.wire.logfile import open_log_writer

    with open_log_writer(path) as log:
        for message in fixture_messages():
            log.write_message(message)


async def screenshot(log: Path) -> str:
    from monitor.app import MonitorApp

    app = MonitorApp(replay=log, paused=True)
    async with app.run_test(size=SCREEN_SIZE) as pilot:
        await app.workers.wait_for_complete()
        await pilot.pause()
        app.seek_to(SEEK_S)
        await pilot.pause()
        return app.export_screenshot()


if __name__ == "__main__":
    if "--svg" in sys.argv:
        SVG.write_text(asyncio.run(screenshot(LOG)))
        print(f"wrote {SVG}")
    else:
        LOG.unlink(missing_ok=True)
        write_log(LOG)
        print(f"wrote {LOG} ({LOG.stat().st_size} bytes)")
