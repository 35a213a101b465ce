"""fsdpx/liveness.py: a peer's process counts as gone only on evidence (no such process, a
zombie, a reused pid), never because it was quiet. See [Note: vanished ranks]."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any, cast

import pytest
import torch.distributed as dist

from fsdpx import liveness
from fsdpx.liveness import RankProcess

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _as_rank(rank: int, proc: subprocess.Popen[bytes]) -> RankProcess:
    stat = liveness._proc_stat(proc.pid)
    assert stat is not None
    return RankProcess(rank, proc.pid, stat[1])


def test_a_live_process_is_not_gone_and_an_ended_one_is() -> None:
    proc = _sleeper()
    try:
        peer = _as_rank(1, proc)
        assert not liveness.is_gone(peer)
        # A slow or stopped process still exists: never named, however long it is quiet.
        assert liveness.vanished([peer], wait_s=0.1) == []
        # Another process that got the same pid later has another start time.
        assert liveness.is_gone(RankProcess(1, proc.pid, peer.start + 1))
        proc.kill()
        _wait_for_state(proc.pid, "Z")  # killed, not yet reaped by its parent
        assert liveness.is_gone(peer)
        proc.wait()  # reaped: no /proc entry at all
        assert liveness.is_gone(peer)
        start = time.monotonic()
        assert liveness.vanished([peer], wait_s=300) == [peer]
        # Found at once, not after the 300 s wait (a bound no loaded machine reaches).
        assert time.monotonic() - start < 150
    finally:
        proc.kill()
        proc.wait()


def test_no_evidence_is_not_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc unreadable (hidepid, a permission error, an odd format): the peer is kept."""

    def unreadable(self: object) -> str:
        raise PermissionError("no access")

    monkeypatch.setattr(liveness.Path, "read_text", unreadable)
    assert not liveness.is_gone(RankProcess(1, os.getpid(), 0))
    assert liveness.vanished([RankProcess(1, os.getpid(), 0)], wait_s=0) == []


def test_neighbours_are_the_other_ranks_of_this_namespace() -> None:
    store = dist.HashStore()
    assert liveness.neighbours(store, 0, 4) == []  # nobody announced (no key: no wait)
    liveness.announce(store, 0)
    key = liveness._namespace_key()
    assert key is not None
    add = cast(Any, store).append  # missing from torch's type stubs
    add(key, "2,111,5;garbage;3,x,1;1,222,6;")
    add(key, "2,333,7;")  # rank 2 announced again (a second init): the last wins
    add(key, "9,444,8;")  # not a rank of this world
    assert liveness.neighbours(store, 0, 4) == [RankProcess(1, 222, 6), RankProcess(2, 333, 7)]
    me = liveness.neighbours(store, 1, 4)[0]
    assert (me.rank, me.pid) == (0, os.getpid())
    assert not liveness.is_gone(me)


def test_describe_names_ranks_pids_and_host() -> None:
    one = liveness.describe([RankProcess(1, 42, 0)])
    assert one.startswith("rank 1 (pid 42 on host ") and one.endswith(")")
    two = liveness.describe([RankProcess(1, 42, 0), RankProcess(3, 43, 0)])
    assert two.startswith("ranks 1, 3 (pids 42, 43 on host ")


def _wait_for_state(pid: int, state: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stat = liveness._proc_stat(pid)
        if stat is not None and stat[0] == state:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not reach state {state} within {timeout_s}s")


def test_a_rank_that_stopped_on_purpose_is_not_named() -> None:
    """A survivor that raised RankFailureError marks itself stopped before it exits: its
    ended process is explained, and the ranks still looking must not blame it (found in
    review: a rank that timed out first on a stalled-but-alive peer was named as killed)."""
    store = dist.HashStore()
    stopped_proc, killed_proc = _sleeper(), _sleeper()
    try:
        survivor, killed = _as_rank(0, stopped_proc), _as_rank(1, killed_proc)
        liveness.mark_stopped(store, 0)  # rank 0 reports its own end, then exits
        stopped_proc.kill()
        stopped_proc.wait()
        assert liveness.stopped(store) == {0}

        def explained() -> set[int]:
            return liveness.stopped(store)

        assert liveness.vanished([survivor], wait_s=0.2, explained=explained) == []
        killed_proc.kill()  # rank 1 ends without a word: it is the one named
        killed_proc.wait()
        found = liveness.vanished([survivor, killed], wait_s=30, explained=explained)
        assert found == [killed]
    finally:
        for proc in (stopped_proc, killed_proc):
            proc.kill()
            proc.wait()
