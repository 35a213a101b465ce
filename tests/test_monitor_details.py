"""What a person sees in the monitor's corners (issue 13, item 6): narrow terminals on a
CPU run, the outliers-only view, the detail screen's keys and units. Pilot tests that
read the rendered screen."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from monitor.app import MonitorApp
from monitor.messages import TelemetryBatch
from monitor.screens.rank_detail import RankDetailScreen
from monitor.widgets.rank_table import RankTable
from tests.test_monitor_app import LOG, open_replay, screen_lines, sync, table_lines

MIB = 1024**2


def cpu_record(rank: int, step: int, **extra: Any) -> dict[str, Any]:
    """A CPU rank's record: no device memory, no NVML; host RSS only."""
    return {
        "rank": rank,
        "host": "cpu-box",
        "step": step,
        "time": 100.0 + step,
        "loss": 3.0 - 0.01 * step,
        "step_time_s": 0.5,
        "tokens_per_s": 4096.0,
        "host_rss": 512 * MIB + rank * MIB,
        "mem_allocated": None,
        "mem_reserved": None,
        "mem_peak": None,
        "device_mem_total": None,
        "device_util": None,
        **extra,
    }


def live_app(tmp_path: Path) -> MonitorApp:
    return MonitorApp(sources=[str(tmp_path / "nobody.sock")], clock=lambda: 110.0)


async def feed_cpu_run(app: MonitorApp, pilot: Any, n_ranks: int = 3, **extra: Any) -> None:
    records = [cpu_record(r, 10, **extra) for r in range(n_ranks)]
    app.post_message(TelemetryBatch("test", records, [], received_at=110.0))
    await pilot.pause()
    app.refresh_view()
    await pilot.pause()


async def text_once(app: MonitorApp, pilot: Any, *needles: str, timeout_s: float = 10.0) -> str:
    """The screen's text once it shows every one of `needles` (a pushed screen draws a
    refresh later, which on a loaded machine can take more than one pause, and its widgets
    can be drawn in different frames: wait for everything a test then checks)."""
    text = ""
    for _ in range(int(timeout_s / 0.05)):
        app.refresh_view()
        await pilot.pause(0.05)
        text = "\n".join(screen_lines(app))
        if all(n in text for n in needles):
            return text
    raise AssertionError(f"{needles!r} never all appeared on screen:\n{text}")


def header(app: MonitorApp) -> list[str]:
    line = next(line for line in screen_lines(app) if line.lstrip().startswith("rank"))
    return line.split()


@sync
async def test_cpu_run_at_60_columns_keeps_rss_with_a_unit(tmp_path: Path) -> None:
    """Always-empty device columns (resv, mem%, ...) go before rss, which has a unit."""
    app = live_app(tmp_path)
    async with app.run_test(size=(60, 24)) as pilot:
        await feed_cpu_run(app, pilot)
        assert header(app) == [
            "rank↑", "state", "step", "step_s", "loss", "rss", "age", "flags",
        ]  # fmt: skip
        row = table_lines(app)[0].split()
        assert row[0] == "0" and row[5] == "512M"
        assert all(len(line.rstrip()) <= 60 for line in screen_lines(app))


@sync
async def test_wide_terminal_keeps_every_column_even_empty_ones(tmp_path: Path) -> None:
    """With room for all, nothing is hidden (the layout does not jump as data arrives)."""
    app = live_app(tmp_path)
    async with app.run_test(size=(120, 24)) as pilot:
        await feed_cpu_run(app, pilot)
        assert "resv" in header(app) and "mem%" in header(app) and "rss" in header(app)


@sync
async def test_sort_arrow_shows_on_the_flags_column(tmp_path: Path) -> None:
    app = live_app(tmp_path)
    async with app.run_test(size=(60, 24)) as pilot:
        await feed_cpu_run(app, pilot)
        app.query_one(RankTable).set_sort("flags", descending=True)
        await pilot.pause()
        assert header(app)[-1] == "flags↓"


@sync
async def test_outliers_only_is_shown_and_an_empty_result_says_no_outliers(
    tmp_path: Path,
) -> None:
    app = live_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await feed_cpu_run(app, pilot)
        await pilot.press("o")
        await pilot.pause()
        text = "\n".join(screen_lines(app))
        assert "outliers only (0 of 3 ranks)" in text
        assert "no outliers among 3 ranks" in text
        await pilot.press("o")  # off again: the whole run, no title
        await pilot.pause()
        text = "\n".join(screen_lines(app))
        assert "outliers only" not in text and "no outliers" not in text


@sync
async def test_outliers_only_counts_the_outliers_of_a_replay() -> None:
    app = MonitorApp(replay=LOG, paused=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await open_replay(app, pilot)
        app.seek_to(15.0)
        await pilot.press("o")
        await pilot.pause()
        assert "outliers only (4 of 12 ranks)" in "\n".join(screen_lines(app))


@sync
async def test_detail_screen_offers_no_keys_of_the_hidden_table() -> None:
    app = MonitorApp(replay=LOG, paused=True)
    async with app.run_test(size=(100, 30)) as pilot:
        await open_replay(app, pilot)
        app.seek_to(15.0)
        await pilot.press("enter")
        await text_once(app, pilot, "step_time_s")
        assert isinstance(app.screen, RankDetailScreen)
        footer = screen_lines(app)[-1]
        assert "back" in footer
        assert "filter" not in footer and "outliers" not in footer
        await pilot.press("o", "slash")  # and they do nothing behind it
        await pilot.pause()
        assert app.query_one(RankTable).filter_text == ""
        assert isinstance(app.screen, RankDetailScreen)
        await pilot.press("escape")
        await pilot.pause()
        footer = screen_lines(app)[-1]
        assert "filter" in footer and "outliers" in footer


@sync
async def test_detail_screen_uses_adaptive_units(tmp_path: Path) -> None:
    app = live_app(tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await feed_cpu_run(app, pilot, comm_bytes=12 * MIB, tflops=0.0482)
        await pilot.press("enter")
        text = await text_once(app, pilot, "comm_bytes", "12.0 MiB", "48.2 GFLOP/s", "512 MiB")
        assert "0.0 GiB" not in text


@sync
async def test_detail_screen_shows_the_expert_load(tmp_path: Path) -> None:
    """A rank with MoE layers: its expert rows, dropped assignments and imbalance
    (PROTOCOL.md "Mixture of experts") on the detail screen."""
    app = live_app(tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await feed_cpu_run(app, pilot, moe_tokens=1536, moe_dropped=12, moe_imbalance=1.875)
        await pilot.press("enter")
        await text_once(app, pilot, "moe_tokens", "1536", "moe_dropped", "moe_imbalance", "1.8750")


def elapsed_on_screen(app: MonitorApp) -> str:
    line = screen_lines(app)[1]
    assert line.startswith("elapsed "), line
    return line.split()[1]


@sync
async def test_refresh_between_push_and_mount_of_the_detail_screen(tmp_path: Path) -> None:
    """The app's refresh timer can fire after a detail screen is pushed and before it is
    composed, and while the app exits and removes its widgets (under load: NoMatches
    '#detail-title' in a rank-failure test and in a CI run of this one). Such a refresh is a
    no-op for the screen, which draws itself once mounted."""
    app = live_app(tmp_path)
    async with app.run_test(size=(120, 30)) as pilot:
        await feed_cpu_run(app, pilot)
        screen = RankDetailScreen(1)
        app.push_screen(screen)
        assert app.screen is screen and not screen.is_mounted
        app.refresh_view()  # what the timer does at that moment
        screen.call_after_refresh(lambda: screen.show(app.snapshot, app.model))
        # Wait for the last thing checked: the title can be drawn a frame before the fields.
        text = await text_once(app, pilot, "513 MiB")  # rank 1's host_rss
        assert "rank 1  alive" in text
        # The other gap: the app exiting removes the screen's widgets while the timer runs.
        await screen.query_one("#detail-title").remove()
        app.refresh_view()


@sync
async def test_elapsed_never_goes_back_when_the_ranks_stop(tmp_path: Path) -> None:
    """Live, the clock runs until the last exit arrives; it used to fall back to the last
    record's time (0:26 -> 0:23 at the end of the demo)."""
    clock = [100.0]
    app = MonitorApp(sources=[str(tmp_path / "nobody.sock")], clock=lambda: clock[0])
    shown: list[str] = []
    async with app.run_test(size=(80, 24)) as pilot:
        for step in range(1, 24):  # a record per second from t=100 to 122
            records = [cpu_record(r, step) for r in range(2)]
            app.post_message(TelemetryBatch("test", records, [], received_at=clock[0]))
            await pilot.pause()
            clock[0] += 1.0
            app.refresh_view()
            await pilot.pause()
            shown.append(elapsed_on_screen(app))
        # The ranks tear down for 3 s after their last step; the monitor keeps refreshing.
        for _ in range(3):
            clock[0] += 1.0
            app.refresh_view()
            await pilot.pause()
            shown.append(elapsed_on_screen(app))
        exits = [
            {"rank": r, "kind": "exit", "time": clock[0], "detail": {"reason": "closed"}}
            for r in range(2)
        ]
        app.post_message(TelemetryBatch("test", [], exits, received_at=clock[0]))
        await pilot.pause()
        for _ in range(3):
            clock[0] += 1.0
            app.refresh_view()
            await pilot.pause()
            shown.append(elapsed_on_screen(app))
        assert app.snapshot.summary.exited == 2
    seconds = [int(m) * 60 + int(s) for m, s in (t.split(":") for t in shown)]
    assert seconds == sorted(seconds), shown
    # First record at t=101 (its own time), exits arrived at t=126: stopped there.
    assert shown[-3:] == ["0:25"] * 3, shown
