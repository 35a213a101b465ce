"""`fsdpx demo`: argument checks (fast), that `fsdpx` runs it as the monitor's without
importing monitor ([Note: fsdpx demo] in fsdpx/cli.py), and a real 2-rank CPU run in
plain mode (slow), also from a non-editable install (slow)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fsdpx.cli import main as fsdpx_main
from fsdpx.telemetry.wire.logfile import iter_log
from monitor.cli import main as monitor_main

ROOT = Path(__file__).resolve().parent.parent


def test_demo_rejects_bad_numbers(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert monitor_main(["demo", "--steps", "0", "--out", str(tmp_path)]) == 2
    assert "--steps, --ranks and --every must be >= 1; got 0, 2, 10" in capsys.readouterr().err


def test_fsdpx_demo_passes_its_arguments_to_the_monitors_demo(
    capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`fsdpx demo ...` is `fsdpx-monitor demo ...` in a child process: its options, its
    errors and its exit code."""
    assert fsdpx_main(["demo", "--ranks", "3", "--every=0", "--out", str(tmp_path)]) == 2
    assert "must be >= 1; got 150, 3, 0" in capfd.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        fsdpx_main(["config", "show", "x.json", "--steps", "3"])  # only demo passes them on
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --steps 3" in capfd.readouterr().err


def test_the_fsdpx_command_does_not_import_the_monitor() -> None:
    code = (
        "import sys, fsdpx.cli; fsdpx.cli.build_parser(); "
        "bad = [m for m in sys.modules if m == 'monitor' or m.startswith(('monitor.', 'textual'))]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.slow
def test_demo_plain_progress_matches_the_replay_log(tmp_path: Path) -> None:
    """Not a terminal: progress lines, then the relay's log holds the same steps."""
    result = subprocess.run(
        [sys.executable, "-m", "fsdpx.cli", "demo", "--steps", "6", "--every", "2",
         "--out", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    steps = [int(m) for m in re.findall(r"^step\s+(\d+)", result.stdout, re.MULTILINE)]
    assert steps and steps[-1] == 6 and steps == sorted(steps)
    assert "done: step 6" in result.stdout and "ranks 2 exited 0 dead" in result.stdout
    logged = {
        (r["rank"], r["step"])
        for m in iter_log(tmp_path / "run.tlm")
        if m["type"] == "records"
        for r in m["records"]
    }
    assert logged == {(r, s) for r in range(2) for s in range(1, 7)}
    # The training's own output names the same last step.
    assert "step    6 |" in (tmp_path / "train.log").read_text()


@pytest.mark.slow
def test_demo_runs_from_a_non_editable_install(tmp_path: Path) -> None:
    """A wheel of this tree, installed (no editable finder, no source tree on the path),
    runs the demo from a directory outside the tree: its training module ships in the
    package ([Note: fsdpx demo] in fsdpx/cli.py). By hand, in a fresh venv:
    `pip install torch==2.13.0 . && cd /tmp && fsdpx demo --steps 4 --every 2 | cat`."""
    src, site, run = tmp_path / "src", tmp_path / "site", tmp_path / "run"
    skip = shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "out", "*.egg-info", "__pycache__", ".*_cache"
    )
    shutil.copytree(ROOT, src, ignore=skip)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    wheel = tmp_path / "wheel"
    built = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheel), str(src)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (whl,) = wheel.glob("fsdpx-*.whl")
    installed = subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), str(whl)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stdout + installed.stderr
    shutil.rmtree(src)  # nothing of a source tree is left to fall back on
    run.mkdir()
    # PYTHONPATH comes before the editable install's finder (a sys.meta_path hook at the
    # end), so every process of the demo, torchrun's ranks included, imports the wheel.
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run(
        [sys.executable, "-c", "import fsdpx.demo.train, monitor.demo as m; print(m.__file__)"],
        cwd=run, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert where.returncode == 0 and where.stdout.startswith(str(site)), where
    result = subprocess.run(
        [sys.executable, "-m", "fsdpx.cli", "demo", "--steps", "2", "--every", "1",
         "--out", str(run / "out")],
        cwd=run, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "done: step 2" in result.stdout and "ranks 2 exited 0 dead" in result.stdout
