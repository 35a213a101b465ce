"""SIGTERM (a preemption; torchrun forwards its own to the ranks) makes a rank publish its
exit event, reason "terminated", before it dies: the monitor shows it exited, not dead.
The hook chains to the handler that was there and is undone by close()."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdpx.config import TelemetryConfig
from fsdpx.telemetry.publisher import Publisher
from fsdpx.telemetry.wire.logfile import iter_log
from fsdpx.telemetry.wire.relay import Relay

ROOT = Path(__file__).resolve().parent.parent
FAST = TelemetryConfig(enabled=True, start_relay=False, poll_interval_s=0.02, send_timeout_s=0.2)

# A rank: publishes a record per step until killed; `graceful` installs its own SIGTERM
# handler first (stop at the next step, exit 0), as a preemption-aware script would.
RANK = textwrap.dedent(
    """
    import signal, sys, time, types
    import torch
    from fsdpx.config import TelemetryConfig
    from fsdpx.engine import StepResult
    from fsdpx.telemetry.publisher import Publisher

    address, graceful = sys.argv[1], sys.argv[2] == "graceful"
    stop = []
    if graceful:
        signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    cfg = TelemetryConfig(enabled=True, start_relay=False, relay=address, poll_interval_s=0.02)
    pub = Publisher(cfg, rank=3, local_rank=0, world_size=4, device=torch.device("cpu"))
    engine = types.SimpleNamespace(optimizer=torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]))
    step = 0
    while not stop:
        step += 1
        pub.on_step(engine, StepResult(step, False, 1.0, 1.0))
        if step == 3:
            print("running", flush=True)
        time.sleep(0.02)
    print(f"stopped gracefully at step {step}", flush=True)
    """
)


@pytest.fixture
def relay_with_log(tmp_path: Path) -> Iterator[tuple[Relay, Path]]:
    log = tmp_path / "run.tlm"
    relay = Relay(str(tmp_path / "r.sock"), log_path=log)
    relay.bind()
    relay.start_thread()
    yield relay, log
    relay.stop()


def _run_rank_until_sigterm(relay: Relay, mode: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", RANK, str(relay.address), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline()
        assert line.strip() == "running", line + (proc.stderr.read() if proc.stderr else "")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, line + out, err)


def _events(relay: Relay, log: Path) -> list[dict[str, Any]]:
    relay.stop()
    return [e for m in iter_log(log) if m["type"] == "events" for e in m["events"]]


def test_sigterm_sends_an_exit_event_then_dies_of_sigterm(
    relay_with_log: tuple[Relay, Path],
) -> None:
    relay, log = relay_with_log
    result = _run_rank_until_sigterm(relay, "default")
    # Still the default action's death: torchrun and schedulers see the same status.
    assert result.returncode == -signal.SIGTERM, result.stderr[-2000:]
    events = _events(relay, log)
    exits = [e for e in events if e["kind"] == "exit"]
    assert len(exits) == 1 and exits[0]["rank"] == 3, events
    assert exits[0]["detail"]["reason"] == "terminated"
    assert not [e for e in events if e["kind"] == "disconnected"]  # not shown as a crash


def test_sigterm_chains_to_the_scripts_own_handler(relay_with_log: tuple[Relay, Path]) -> None:
    """A script that handles SIGTERM itself keeps doing so; its exit says "terminated"."""
    relay, log = relay_with_log
    result = _run_rank_until_sigterm(relay, "graceful")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "stopped gracefully" in result.stdout
    exits = [e for e in _events(relay, log) if e["kind"] == "exit"]
    assert [e["detail"]["reason"] for e in exits] == ["terminated"]


def test_close_restores_the_previous_handler(tmp_path: Path) -> None:
    seen: list[int] = []

    def previous(signum: int, frame: object) -> None:
        seen.append(signum)

    old = signal.signal(signal.SIGTERM, previous)
    try:
        cfg = replace(FAST, relay=str(tmp_path / "nobody.sock"))
        pub = Publisher(cfg, rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
        assert signal.getsignal(signal.SIGTERM) != previous  # chained in front
        pub.close()
        assert signal.getsignal(signal.SIGTERM) is previous
        pub = Publisher(
            cfg, rank=0, local_rank=0, world_size=1, device=torch.device("cpu"),
            install_hooks=False,
        )  # fmt: skip
        assert signal.getsignal(signal.SIGTERM) is previous  # no hooks: left alone
        pub.close()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        pub = Publisher(cfg, rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # ignored stays ignored
        pub.close()
    finally:
        signal.signal(signal.SIGTERM, old)
    assert seen == []


_TWO_HOOKS = """
import os, signal, sys
from fsdpx.telemetry.sigterm import SigtermHook
calls = []
a = SigtermHook(lambda: calls.append("a")); a.install()
b = SigtermHook(lambda: calls.append("b")); b.install()
def report():
    print(",".join(calls), flush=True)
a._on_term = lambda: (calls.append("a"), report())  # the last hook to run prints
print("ready", flush=True)
signal.pause()
print("survived", flush=True)
"""


def test_two_hooks_in_one_process_both_speak_then_die_of_sigterm() -> None:
    """Two publishers (two engines) in one process: each says its last words once and the
    process dies of SIGTERM (in review the second hook bounced the signal back down the
    chain until a RecursionError escaped into training)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _TWO_HOOKS],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"  # both hooks installed: a state
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM, err[-2000:]
    assert out.split() == ["b,a"], err[-2000:]
