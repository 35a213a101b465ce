"""The monitor TUI driven headless with App.run_test() and Pilot.

Most tests replay the fixed log tests/data/monitor/run.tlm (12 ranks: rank 3 straggles,
rank 5 is near its memory capacity, rank 7's loss turns NaN at step 40, rank 9 stops after
step 20); a replay's clock is the records' own time, so what is on screen is the same on
every machine. Regenerate the fixtures with tests/data/monitor/make_fixture.py.
"""

from __future__ import annotations

import asyncio
import functools
import html
import re
import subprocess
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from monitor.app import MonitorApp
from monitor.cli import main as monitor_main
from monitor.messages import TelemetryBatch
from monitor.model import MonitorSettings, RankStatus
from monitor.screens.rank_detail import RankDetailScreen
from monitor.synthetic import SyntheticRun
from monitor.widgets.curves import Curves
from monitor.widgets.rank_table import RankTable

DATA = Path(__file__).parent / "data" / "monitor"
LOG = DATA / "run.tlm"
sys.path.insert(0, str(DATA))
from make_fixture import SCREEN_SIZE, SEEK_S, fixture_messages, screenshot  # noqa: E402


def sync(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test in its own event loop (no pytest asyncio plugin needed)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))

    return wrapper


def screen_lines(app: MonitorApp) -> list[str]:
    """The screen's text, one string per row, read back from the SVG screenshot."""
    rows: dict[float, list[tuple[float, str]]] = {}
    pattern = r'<text class="[^"]*" x="([\d.]+)" y="([\d.]+)"[^>]*>(.*?)</text>'
    for x, y, text in re.findall(pattern, app.export_screenshot()):
        rows.setdefault(float(y), []).append((float(x), html.unescape(text).replace("\xa0", " ")))
    return ["".join(t for _, t in sorted(rows[y])) for y in sorted(rows)]


async def open_replay(pilot_app: MonitorApp, pilot) -> None:  # type: ignore[no-untyped-def]
    await pilot_app.workers.wait_for_complete()
    await pilot.pause()
    assert pilot_app.player is not None, pilot_app.replay_error


def table_lines(app: MonitorApp) -> list[str]:
    lines = screen_lines(app)
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("rank"))
    return lines[start + 1 :]


@sync
async def test_summary_table_and_outliers_at_80x24() -> None:
    app = MonitorApp(replay=LOG, paused=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await open_replay(app, pilot)
        app.seek_to(SEEK_S)
        await pilot.pause()
        lines = screen_lines(app)
        assert lines[0].startswith("step 75  loss 4.2481  tok/s")
        assert "ranks 11 alive 1 stale" in lines[0]
        assert "elapsed 0:15  ETA 0:25  replay run.tlm  paused" in lines[1]
        rows = {int(line.split()[0]): line for line in table_lines(app)[:12]}
        assert rows[3].rstrip().endswith("S")  # straggler
        assert rows[5].rstrip().endswith("M") and " 97%" in rows[5]  # memory
        assert " nan " in rows[7] and rows[7].rstrip().endswith("N")
        # Rank 9 stopped publishing: stale, and hung (no step for 10 median step times).
        assert " stale " in rows[9] and " 11s " in rows[9] and rows[9].rstrip().endswith("ZH")
        assert rows[0].split()[2:4] == ["alive", "75"]
        assert "checkpoint_saved  3.00 GiB  1.50s" in "\n".join(lines)


@sync
async def test_sort_keys_and_reverse() -> None:
    app = MonitorApp(replay=LOG, paused=True)
    async with app.run_test(size=(100, 30)) as pilot:
        await open_replay(app, pilot)
        app.seek_to(SEEK_S)
        table = app.query_one(RankTable)
        assert table.order[:3] == [0, 1, 2]
        await pilot.press("s")  # -> step time
        assert table.sort_key == "step_time"
        await pilot.press("r")  # descending: the straggler first
        assert table.order[0] == 3 and table.descending
        await pilot.press("s", "s")  # -> loss -> mem
        assert table.sort_key == "mem" and table.order[0] == 5
        await pilot.pause()
        assert table_lines(app)[0].split()[0] == "5"
        assert "mem%↓" in screen_lines(app)[5]
        table.set_sort("rank", descending=True)  # (by rank: one sort, then reversed)
        assert table.order == sorted(app.snapshot.rows, reverse=True)


@sync
async def test_filter_box_and_outliers_key() -> None:
    app = MonitorApp(replay=LOG, paused=True)
    async with app.run_test(size=(100, 30)) as pilot:
        await open_replay(app, pilot)
        app.seek_to(SEEK_S)
        table = app.query_one(RankTable)
        await pilot.press("slash", *"node001", "enter")
        assert table.order == [8, 9, 10, 11]
        await pilot.press("o")  # outliers on node001: the stale rank 9
        assert table.order == [9]
        await pilot.press("escape")
        assert len(table.order) == 12 and table.filter_text == ""
        await pilot.press("o")
        assert table.order == [3, 5, 7, 9]
        # Keys typed into the filter box are text, not replay keys.
        await pilot.press("slash", "space", "right")
        assert app.player is not None and app.player.paused


@sync
async def test_live_rank_turns_stale_within_the_configured_time(tmp_path: Path) -> None:
    clock = [1000.0]
    settings = MonitorSettings(stale_after_s=2.0, dead_after_s=5.0)
    app = MonitorApp(
        sources=[str(tmp_path / "nobody.sock")], settings=settings, clock=lambda: clock[0]
    )
    run = SyntheticRun(n_ranks=3, step_time_s=0.5, start_time=999.5)
    async with app.run_test(size=(80, 24)) as pilot:
        for step in range(1, 5):
            records = [r for r in run.records(step) if r["rank"] != 1 or step < 2]
            app.post_message(TelemetryBatch("test", records, [], received_at=clock[0]))
            await pilot.pause()
            clock[0] += 0.5
        # Rank 1 was last heard at t=1000.0; now t=1002.0.
        app.refresh_view()
        assert app.snapshot.rows[1].status is RankStatus.ALIVE
        clock[0] = 1002.1
        app.refresh_view()
        assert app.snapshot.rows[1].status is RankStatus.STALE
        assert app.snapshot.rows[0].status is RankStatus.ALIVE
        await pilot.pause()
        assert "2 alive 1 stale" in screen_lines(app)[0]
        clock[0] = 1005.1
        app.refresh_view()
        assert app.snapshot.rows[1].status is RankStatus.DEAD
        await pilot.pause()
        # The unreachable relay is reported, not fatal.
        assert "cannot reach relay" in app._source_text()
        assert screen_lines(app)[1].startswith(f"elapsed 0:05  {tmp_path}")


@sync
async def test_malformed_telemetry_does_not_crash_the_app(tmp_path: Path) -> None:
    app = MonitorApp(sources=[str(tmp_path / "nobody.sock")], clock=lambda: 5.0)
    junk: list[Any] = [None, 7, "x", [], {"rank": 1}, {"rank": 0, "step": 3, "loss": "high"}]
    events: list[Any] = [None, "exit", {"kind": "exit"}, {"rank": 0, "kind": 5, "detail": []}]
    async with app.run_test(size=(80, 24)) as pilot:
        app.post_message(TelemetryBatch("test", junk, events, received_at=5.0))
        await pilot.pause()
        app.refresh_view()
        await pilot.pause()
        assert app.model.bad_records == 5
        assert list(app.snapshot.rows) == [0]
        row = next(line for line in table_lines(app) if line.split()[:1] == ["0"])
        # No step time, and the odd loss ("high") shown as unknown.
        assert row.split()[2:6] == ["alive", "3", "-", "-"]


@sync
async def test_detail_screen_opens_and_closes() -> None:
    app = MonitorApp(replay=LOG, paused=True)
    async with app.run_test(size=(100, 30)) as pilot:
        await open_replay(app, pilot)
        app.seek_to(SEEK_S)
        await pilot.press("down", "down", "down", "enter")
        await pilot.pause()
        assert isinstance(app.screen, RankDetailScreen) and app.screen.rank == 3
        text = "\n".join(screen_lines(app))
        assert "rank 3  alive" in text and "flags S" in text
        assert "step_time_s" in text and "0.4928" in text and "node000" in text
        await pilot.press("escape")
        assert not isinstance(app.screen, RankDetailScreen)


@sync
async def test_replay_keys_seek_pause_and_speed() -> None:
    app = MonitorApp(replay=LOG, paused=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await open_replay(app, pilot)
        player = app.player
        assert player is not None
        assert app.snapshot.summary.step is None  # paused at the start: nothing yet
        await pilot.press("right")
        assert player.position - player.start == pytest.approx(10.0)
        assert app.snapshot.summary.step == 50
        await pilot.press("left")
        assert app.snapshot.summary.step is None and player.cursor > 0
        await pilot.press("shift+right")  # past the end: clamped, all ranks exited
        assert app.snapshot.summary.step == 80 and app.snapshot.summary.exited == 11
        await pilot.press("right_square_bracket", "right_square_bracket")
        assert player.speed == 4.0
        await pilot.press("left_square_bracket")
        assert player.speed == 2.0
        await pilot.press("left", "space")
        assert not player.paused
        before = player.position
        await pilot.pause(0.3)
        assert player.position > before  # it plays


@sync
async def test_large_terminal_shows_every_column() -> None:
    app = MonitorApp(replay=LOG, paused=True)
    async with app.run_test(size=(200, 60)) as pilot:
        await open_replay(app, pilot)
        app.seek_to(SEEK_S)
        await pilot.pause()
        header = next(line for line in screen_lines(app) if line.lstrip().startswith("rank"))
        assert header.split() == [
            "rank↑", "node", "host", "state", "step", "step_s", "loss", "alloc", "resv", "peak",
            "cap", "mem%", "util", "rss", "age", "flags",
        ]  # fmt: skip
        assert app.query_one(Curves).size.height == 8


@sync
async def test_q_and_ctrl_c_quit() -> None:
    for key in ("q", "ctrl+c"):
        app = MonitorApp(replay_messages=fixture_messages(), paused=True)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press(key)
            await pilot.pause()
            assert not app.is_running


@sync
async def test_screenshot_matches() -> None:
    """The whole screen of a fixed replay, compared with tests/data/monitor/expected.svg.
    After an intentional UI change, regenerate it (make_fixture.py --svg) and review."""
    svg = await screenshot(LOG)
    assert SCREEN_SIZE == (80, 24)
    assert svg == (DATA / "expected.svg").read_text()


def test_replay_command_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert monitor_main(["replay", str(tmp_path / "missing.tlm")]) == 2
    assert "missing.tlm: No such file or directory" in capsys.readouterr().err
    bogus = tmp_path / "notes.txt"
    bogus.write_text("hello")
    assert monitor_main(["replay", str(bogus)]) == 2
    assert "is not a telemetry log (expected a zstd frame" in capsys.readouterr().err
    assert monitor_main(["localhost:notaport"]) == 2
    assert "neither a Unix socket path" in capsys.readouterr().err
    assert monitor_main(["replay", str(LOG), "--stale-after", "9", "--dead-after", "3"]) == 2
    assert "stale_after_s <= dead_after_s" in capsys.readouterr().err
    with pytest.raises(ValueError, match="exactly one of sources"):
        MonitorApp()


def test_missing_textual_gives_a_clear_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "textual", None)  # `import textual` now fails
    monkeypatch.delitem(sys.modules, "monitor.app")
    assert monitor_main(["replay", str(LOG)]) == 2
    assert "needs the optional `textual` package" in capsys.readouterr().err


def test_monitor_does_not_import_the_training_runtime() -> None:
    code = (
        "import sys, monitor.app, monitor.cli, monitor.export, monitor.replay; "
        "bad = [m for m in ('torch', 'fsdpx.engine') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]


WIRE_MODULES = (
    "protocol",
    "validate",
    "transport",
    "runs",
    "history",
    "logfile",
    "prometheus",
    "metrics_http",
    "relay",
    "coalesce",
    "discovery",
    "columns",
)


def test_the_monitor_and_the_wire_package_import_only_the_wire() -> None:
    """[Note: the wire package is torch-free]: every wire module, every monitor module
    (the demo included) and the relay's command line (`python -m fsdpx.telemetry.relay`,
    run to its --help) load no torch and nothing of fsdpx outside the wire package."""
    code = "\n".join(
        [
            "import contextlib, importlib, runpy, sys",
            *(f"import fsdpx.telemetry.wire.{m}" for m in WIRE_MODULES),
            "import monitor.app, monitor.cli, monitor.demo, monitor.export, monitor.replay",
            "import monitor.export_lines, monitor.hangs, monitor.stragglers, monitor.discover",
            "sys.argv = ['relay', '--help']",
            "with contextlib.redirect_stdout(None), contextlib.suppress(SystemExit):",
            "    runpy.run_module('fsdpx.telemetry.relay', run_name='__main__')",
            "allowed = {'fsdpx', 'fsdpx.telemetry', 'fsdpx.telemetry.relay'}",
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')",
            "    or (m.startswith('fsdpx') and m not in allowed",
            "        and not m.startswith('fsdpx.telemetry.wire')))",
            "loaded = [m for m in sys.modules if m.startswith('fsdpx.telemetry.wire.')]",
            f"assert len(loaded) == {len(WIRE_MODULES)}, loaded  # the imports above really ran",
            "sys.exit(f'imported {bad}' if bad else 0)",
        ]
    )
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]


@sync
async def test_refresh_and_key_checks_survive_an_empty_screen_stack() -> None:
    # While the app tears down, its screen stack is empty and `App.screen` raises; the refresh
    # timer and the binding checks can still run then (a CI run at load ~80 saw a
    # ScreenStackError at teardown). Empty the stack by hand and call both.
    app = MonitorApp(replay=LOG, paused=True)
    async with app.run_test(size=(100, 30)) as pilot:
        await open_replay(app, pilot)
        stack = app._screen_stack
        saved = list(stack)
        stack.clear()
        try:
            app.refresh_view()
            assert app.check_action("filter", ()) is True
            assert app.check_action("request_dumps", ()) is False
        finally:
            stack.extend(saved)


def test_automatic_refresh_rate_halves_above_large_run_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # [Note: refresh rate at scale]: the timer redraws every tick up to LARGE_RUN_RANKS
    # ranks, every other tick above (automatic rate only); an explicit rate is honoured.
    from monitor.app import LARGE_RUN_RANKS

    def redraws(refresh_hz: float | None, ranks: int) -> int:
        app = MonitorApp(replay_messages=[], refresh_hz=refresh_hz)
        app.runs.add_records([{"rank": r, "step": 1} for r in range(ranks)], now=1.0)
        drawn: list[float] = []
        monkeypatch.setattr(app, "refresh_view", lambda: drawn.append(app.refresh_hz))
        for _ in range(6):
            app.refresh_tick()
        return len(drawn)

    assert redraws(None, LARGE_RUN_RANKS) == 6
    assert redraws(None, LARGE_RUN_RANKS + 1) == 3
    assert redraws(2.0, LARGE_RUN_RANKS + 1) == 6
    assert MonitorApp(replay_messages=[]).refresh_hz == 2.0
    with pytest.raises(ValueError, match=r"^refresh_hz must be > 0; got 0$"):
        MonitorApp(replay_messages=[], refresh_hz=0)
