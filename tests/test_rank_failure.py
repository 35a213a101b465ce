"""Rank failure: when one rank raises or dies, every other rank exits non-zero within the
configured timeout with a RankFailureError that names the failing rank where it can be
known; nothing hangs. See [Note: rank failure] in fsdpx/distributed.py."""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch.distributed as dist

from fsdpx.distributed import _bounded, _is_peer_failure
from tests import failure_bodies
from tests.dist import RankOutcome, run_ranks, spawn_ranks

TIMEOUT_S = 5.0  # Config.timeout_s of the lingering run; spawn_ranks's own group uses 120 s
LINGER_S = 12.0  # the lingering rank outlives rank 0's timeout
# Config.timeout_s of the runs whose failure is found at once (raise, exit, SIGKILL): long,
# so that "found at once" is told from "timed out" by a bound that a loaded machine cannot
# reach (DETECTED_S, half of it), not by a few seconds of slack (CI failed on 4 s).
DETECT_TIMEOUT_S = 60.0
DETECTED_S = 30.0
HANG_S = 240.0  # spawn_ranks kills anything still alive after this (start-up included)
REPO = Path(__file__).resolve().parent.parent

# Text of the errors gloo raised on rank 0 in these runs (torch 2.13).
GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
    "closed by peer [127.0.0.1]:4748. This is typically caused by a remote worker crashing."
)
GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:42674: Connection reset by peer. This is typically caused by a remote "
    "worker hanging or bugs in the application."
)
GLOO_TIMEOUT = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed "
    "out waiting 5000ms for recv operation to complete"
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[RankOutcome], float]]:
    """Every failure mode, one 2-rank job each, two jobs at a time (the lingering one beside
    the three others) to keep the module fast: how -> (outcomes, time.time() when rank 1
    failed). Timings are measured from the failure, so start-up on a loaded machine does
    not count."""

    def run(how: str) -> tuple[list[RankOutcome], float]:
        marks = tmp_path_factory.mktemp(how)
        timeout_s = TIMEOUT_S if how == "linger" else DETECT_TIMEOUT_S
        args = (how, str(marks), timeout_s, LINGER_S)
        outcomes = spawn_ranks(failure_bodies.train_and_fail, 2, args, timeout_s=HANG_S)
        failed_at = marks / "failed_at"
        assert failed_at.exists(), [o.error for o in outcomes]
        return outcomes, float(failed_at.read_text())

    order = ("linger", "raise", "exit", "sigkill")
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(order, pool.map(run, order), strict=True))


def _check_all_ranks_fail(outcomes: list[RankOutcome], failed_at: float, bound_s: float) -> None:
    for o in outcomes:
        assert not o.killed_by_harness, f"rank {o.rank} hung: {o.error}"
        assert o.exitcode not in (0, None), f"rank {o.rank} exited {o.exitcode}"
    peer = outcomes[0]
    took = peer.ended_at - failed_at
    assert took < bound_s, f"rank 0 ended {took:.1f}s after rank 1 failed (bound {bound_s}s)"
    assert peer.error_type == "RankFailureError", peer.error


@pytest.mark.parametrize("how", ["raise", "linger"])
def test_raising_rank_is_named_by_the_others(runs, how: str) -> None:
    outcomes, failed_at = runs[how]
    # Lingering, rank 0 times out (TIMEOUT_S) while rank 1 is still alive (LINGER_S): the
    # bound is rank 1's own end, a state; raising, rank 0 finds the error at once.
    bound = outcomes[1].ended_at - failed_at if how == "linger" else DETECTED_S
    _check_all_ranks_fail(outcomes, failed_at, bound)
    peer, failing = outcomes
    assert peer.failed_rank == 1
    assert peer.error_message.startswith(
        "rank 1 failed with ValueError: bad batch at step 2 on rank 1; rank 0 stops too"
    ), peer.error_message
    # The failing rank's own error comes out unchanged.
    assert (failing.exitcode, failing.error_type) == (1, "ValueError"), failing.error
    assert failing.error_message == "bad batch at step 2 on rank 1"
    if how == "linger":
        # Rank 1 is alive with its connections open: rank 0 can only have timed out, after
        # Config.timeout_s (spawn_ranks made the group with 120 s), long before rank 1 exits.
        assert "timed out" in peer.error_message.lower(), peer.error_message
        assert failing.ended_at - failed_at >= LINGER_S


@pytest.mark.parametrize(("how", "exitcode"), [("exit", 3), ("sigkill", -9)])
def test_killed_rank_is_named_by_the_others(runs, how: str, exitcode: int) -> None:
    """os._exit(3) in the forward, SIGKILL in the backward: the killed rank records
    nothing, yet rank 0 finds its process gone and names it (with its pid), at once."""
    outcomes, failed_at = runs[how]
    _check_all_ranks_fail(outcomes, failed_at, DETECTED_S)
    peer, failing = outcomes
    assert failing.exitcode == exitcode
    assert peer.failed_rank == 1, peer.error_message
    assert re.match(
        r"rank 1 \(pid \d+ on host \S+\) vanished: its process ended without recording an "
        r"error \(found by rank 0\)\. It was probably killed .*Rank 0 stops too \(its "
        r"collective failed: RuntimeError: .*\)\. Look in rank 1's output",
        peer.error_message,
    ), peer.error_message


def test_every_survivor_names_the_killed_rank_alike(tmp_path: Path) -> None:
    """Three ranks, rank 1 SIGKILLed: ranks 0 and 2 both name it, with the same finding
    (the first survivor's record), without waiting for the 60 s process-group timeout."""
    outcomes = spawn_ranks(failure_bodies.killed_peer_body, 3, (str(tmp_path),), timeout_s=HANG_S)
    failed_at = float((tmp_path / "failed_at").read_text())
    assert outcomes[1].exitcode == -9
    survivors = [outcomes[0], outcomes[2]]
    for o in survivors:
        assert not o.killed_by_harness and o.exitcode == 1, o.error
        assert o.error_type == "RankFailureError" and o.failed_rank == 1, o.error
        # A state, not a race: well under the group's timeout, so not a timeout.
        assert o.ended_at - failed_at < 30, o.error
        assert "timed out" not in (o.error_message or "").lower(), o.error
    pattern = r"rank 1 \(pid \d+ on host \S+\) vanished: .* \(found by rank [02]\)\."
    findings = [re.match(pattern, o.error_message or "") for o in survivors]
    assert all(findings), [o.error_message for o in survivors]
    assert findings[0][0] == findings[1][0]  # type: ignore[index]


def test_own_errors_pass_through_and_the_first_is_kept() -> None:
    first = (1, "ValueError: bad input on rank 1")
    rank0, rank1 = run_ranks(failure_bodies.own_error_body, 2)
    assert rank1["same_object"] is True
    assert rank1["local_gloo_type"] == "RuntimeError"  # recorded as its own, not a peer's
    for out in (rank0, rank1):
        assert out["after_first"] == first
        assert out["after_second"] == first  # rank 0's later TypeError did not overwrite
        assert out["new_group_timeout"] == 1800.0  # torch's gloo default, not 120 s
        assert out["timeouts_after"] == (4.0, 4.0)


def test_world_size_one_uses_a_hash_store_and_reuses_the_group() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    code = "from tests.failure_bodies import world_one_check; world_one_check()"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0 and "world-one ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError(GLOO_CLOSED),
        RuntimeError(GLOO_RESET),
        RuntimeError(GLOO_TIMEOUT),
        dist.DistNetworkError("Broken pipe"),
        dist.DistStoreError("wait timeout after 5000ms"),
    ],
)
def test_peer_failures_are_recognised(exc: Exception) -> None:
    assert _is_peer_failure(exc)


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("connection closed"),  # not a RuntimeError: a user's error
        RuntimeError("ProcessGroupGloo::broadcast: invalid root rank: 3"),
        RuntimeError("ProcessGroupGloo::allgather: invalid tensor size at index 0"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"),
    ],
)
def test_local_errors_are_not_peer_failures(exc: Exception) -> None:
    assert not _is_peer_failure(exc)


@pytest.mark.parametrize("kind", ["hash", "file", "tcp"])
def test_compare_set_against_empty_writes_once(kind: str, tmp_path: Path) -> None:
    """record_failure relies on this: the key is absent, so compare_set(key, "", v) sets
    it; once set, later calls leave the first value."""
    timeout = datetime.timedelta(seconds=10)
    store = {
        "hash": lambda: dist.HashStore(),
        "file": lambda: dist.FileStore(str(tmp_path / "store"), 1),
        "tcp": lambda: dist.TCPStore("127.0.0.1", 0, 1, True, timeout, wait_for_workers=False),
    }[kind]()
    prefixed = dist.PrefixStore("default_pg", store)  # what init_process_group hands out
    assert prefixed.compare_set("k", "", "first") == b"first"
    assert prefixed.compare_set("k", "", "second") == b"first"
    assert prefixed.get("k") == b"first"


def test_bounded_store_call_gives_up() -> None:
    """A stalled store (its host gone without a reset) blocks get/check past the store's
    own timeout; the failure path waits a bounded time instead."""
    release = threading.Event()
    start = time.monotonic()
    assert _bounded(lambda: release.wait(600), timeout_s=0.2) is None
    assert time.monotonic() - start < 300  # gave up, did not wait the call out
    release.set()
    assert _bounded(lambda: 1 / 0) is None
    assert _bounded(lambda: b"x") == b"x"


def test_failure_lookup_gives_up_on_a_stalled_store() -> None:
    """The store server's process is stopped (a host gone without a reset): get/check
    block past the store's own timeout, yet the bounded lookup returns."""
    server = (
        "import datetime, sys, time, torch.distributed as d; "
        "s = d.TCPStore('127.0.0.1', 0, 2, True, datetime.timedelta(seconds=30), "
        "wait_for_workers=False); print(s.port, flush=True); time.sleep(120)"
    )
    proc = subprocess.Popen([sys.executable, "-c", server], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        timeout = datetime.timedelta(seconds=1)
        store = dist.PrefixStore("default_pg", dist.TCPStore("127.0.0.1", port, 2, False, timeout))
        store.set("k", "v")
        os.kill(proc.pid, signal.SIGSTOP)
        _wait_until_stopped(proc.pid)  # SIGSTOP is asynchronous: the server could still answer
        start = time.monotonic()
        assert _bounded(lambda: store.get("k"), timeout_s=1.0) is None
        assert _bounded(lambda: store.compare_set("k2", "", "v"), timeout_s=1.0) is None
        assert time.monotonic() - start < 60  # gave up: the stopped server never answers
    finally:
        proc.kill()
        proc.wait()
    # The abandoned lookups now fail and log C++ warnings: let them do so inside this test.
    time.sleep(0.5)


def _wait_until_stopped(pid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            # Field 3 (after the parenthesised command name) is the state; T = stopped.
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {timeout_s}s")
