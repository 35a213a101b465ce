"""Start the agents, relay their output, stop the job when one fails.

[Note: one failure stops every node] torchrun stops its own host's ranks when one fails,
but the agents on other hosts only notice when a collective times out (minutes). The
launcher watches every agent: the first one to exit non-zero (or by a signal) is the job's
failure; the others get SIGTERM (their ranks' process groups, so torchrun's workers
too), then SIGKILL after a grace period, and the launcher exits with the failed agent's
code after naming the node, its host and, when torchrun's exit summary says it, the
global rank that failed first. SIGINT / SIGTERM to the launcher go to every agent.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import IO

from fsdpx.launch.commands import AgentCommand

# torchrun's exit summary: "rank      : 3 (local_rank: 1)" under "Root Cause".
_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
GRACE_S = 20.0


@dataclass
class AgentExit:
    node: int
    host: str
    returncode: int
    failed_rank: int | None


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class _Agent:
    def __init__(self, command: AgentCommand, out: IO[str], lock: threading.Lock) -> None:
        self.command = command
        self.failed_rank: int | None = None
        env = {**os.environ, **command.env}
        self.proc = subprocess.Popen(
            command.argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,  # its own process group: stop() reaches its ranks
        )
        self.pump = threading.Thread(target=self._relay, args=(out, lock), daemon=True)
        self.pump.start()

    def _relay(self, out: IO[str], lock: threading.Lock) -> None:
        assert self.proc.stdout is not None
        prefix = f"{self.command.host}: "
        for line in self.proc.stdout:
            match = _ROOT_RANK.match(line)
            if match is not None and self.failed_rank is None:
                self.failed_rank = int(match[1])
            with lock:
                out.write(prefix + line)
                out.flush()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)


def run_agents(
    commands: list[AgentCommand],
    out: IO[str] = sys.stdout,
    err: IO[str] = sys.stderr,
    on_started: Callable[[list[int]], None] | None = None,
) -> int:
    """Run every command to the end; the job's exit code (0, or the first failure's)."""
    lock = threading.Lock()
    agents = [_Agent(c, out, lock) for c in commands]
    if on_started is not None:
        on_started([a.proc.pid for a in agents])
    done: list[_Agent] = []
    changed = threading.Condition()

    def watch(agent: _Agent) -> None:
        # Counted when the agent itself ends, not when its output does: a killed agent's
        # workers can hold the pipe open after it, and the job's failure is the first exit.
        agent.proc.wait()
        with changed:
            done.append(agent)
            changed.notify_all()

    for a in agents:
        threading.Thread(target=watch, args=(a,), daemon=True).start()

    def forward(sig: int, frame: FrameType | None) -> None:
        for a in agents:
            a.signal(sig)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    first_failure: _Agent | None = None
    try:
        with changed:
            while len(done) < len(agents):
                changed.wait()
                failed = [a for a in done if a.proc.returncode != 0]
                if failed and first_failure is None:
                    first_failure = failed[0]
                    _stop_others(agents, changed, done)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    for a in agents:
        a.pump.join(timeout=GRACE_S)  # orphaned workers of a killed agent may keep it open
    if first_failure is None:
        return 0
    c, code = first_failure.command, first_failure.proc.returncode
    rank = (
        f"; rank {first_failure.failed_rank} failed first (torchrun's summary above)"
        if first_failure.failed_rank is not None
        else ""
    )
    print(
        f"fsdpx launch: node {c.node} ({c.host}) ended with {_describe(code)}{rank}; "
        "stopped the other nodes",
        file=err,
        flush=True,
    )
    return code if code > 0 else 128 - code


def _stop_others(agents: list[_Agent], changed: threading.Condition, done: list[_Agent]) -> None:
    """SIGTERM every running agent, SIGKILL what is left after GRACE_S (called with
    `changed` held; waits on it, so the watchers keep reporting)."""
    for a in agents:
        a.signal(signal.SIGTERM)
    if not changed.wait_for(lambda: len(done) == len(agents), timeout=GRACE_S):
        for a in agents:
            a.signal(signal.SIGKILL)
