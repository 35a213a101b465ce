"""The one helper that runs a function on N CPU ranks (gloo), meeting through a file store.

No ports are guessed: ranks rendezvous through a FileStore in a fresh temp directory.
Each rank's return value must be picklable: it comes back through torch.save/torch.load
of a temp file (test-only transport; never an fsdpx file format). A rank's exception is re-raised in
the test with the rank and the remote traceback.

Example::

    def body(rank, world_size, scale):
        ...
        return some_tensor

    results = run_ranks(body, world_size=2, args=(3.0,))   # one entry per rank

Tests of failures use `spawn_ranks`, which returns every rank's RankOutcome (exit code,
exception type and message, when the process ended) instead of raising.

[Note: ranks forked from a preloaded server]
Importing torch, torch.distributed.tensor and fsdpx costs a rank ~2 s of CPU, and the default
suite starts some hundreds of ranks: with the "spawn" start method that import was most of
the suite's time on 2 cores. Ranks are therefore forked from multiprocessing's forkserver,
which imports tests/rank_preload.py (torch, fsdpx, transformers) once per pytest session
and does nothing else, so every rank starts from the same freshly imported, never-used
modules (no process group, no CUDA context; a fork copies only the server's main thread).
multiprocessing gives a forked rank the caller's sys.path and working directory as it gave
a spawned one; the environment it does not, so each rank restores the caller's os.environ
at the call (the server keeps the one it started with; tests set variables with
monkeypatch before calling run_ranks). What is read once at process start cannot be
restored that way (glibc's MALLOC_* tuning, environment read while torch is imported): a
test that depends on it passes `fresh_interpreter=True` and gets a spawned rank.
FSDPX_TEST_SPAWN=1 spawns every rank (to rule the server out when a rank misbehaves).
"""

from __future__ import annotations

import datetime
import os
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing import forkserver
from typing import Any

import torch.multiprocessing as mp

# A hang detector, not a speed check: a 4-rank test at load ~30 on 2 cores (CI machines
# are shared) took most of 240 s once, so a rank gets 10 minutes before it counts as hung.
DEFAULT_TIMEOUT_S = 600.0

# The fork server imports this module once; it imports torch, fsdpx and transformers.
_PRELOAD = ["tests.rank_preload"]
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SERVER_LOCK = threading.Lock()


class RankError(AssertionError):
    pass


@dataclass(frozen=True)
class RankOutcome:
    """How one spawned rank ended."""

    rank: int
    exitcode: int | None
    """The process's exit code (negative: killed by that signal)."""
    killed_by_harness: bool
    """True when the rank was still alive at spawn_ranks's timeout_s and was killed."""
    ended_at: float
    """time.time() when the parent first saw the process gone (within ~20 ms)."""
    value: Any = None
    """fn's return value when it returned."""
    error_type: str | None = None
    """The exception's class name when fn raised (None: returned, or died without a word)."""
    error_message: str | None = None
    """str() of that exception."""
    failed_rank: int | None = None
    """The exception's `failed_rank` attribute when it has one (fsdpx.RankFailureError)."""
    error: str | None = None
    """Type, message and remote traceback, or why there is no result."""

    @property
    def ok(self) -> bool:
        return self.error is None


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    tmp: str,
    args: tuple[Any, ...],
    pg_timeout_s: float,
    env: dict[str, str],
    parent_env: dict[str, str],
) -> None:
    import torch
    import torch.distributed as dist

    # The caller's environment at the call, not the fork server's at its start.
    os.environ.clear()
    os.environ.update(parent_env)
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    out = os.path.join(tmp, f"rank{rank}")
    code = 0
    try:
        store = dist.FileStore(os.path.join(tmp, "store"), world_size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world_size, *args)
        torch.save(("ok", result, {}), out + ".part")
    except BaseException as exc:  # report everything, including SystemExit
        code = 1
        info = {
            "error_type": type(exc).__name__,
            "error_message": str(exc),
            "failed_rank": getattr(exc, "failed_rank", None),
        }
        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        torch.save(("error", text, info), out + ".part")
    os.replace(out + ".part", out)
    # A process exiting right after gloo work can SIGABRT in teardown (DESIGN.md section 3):
    # destroy the group, then leave without running atexit handlers.
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    os._exit(code)


def _context(fresh_interpreter: bool) -> Any:
    if fresh_interpreter or os.environ.get("FSDPX_TEST_SPAWN") == "1":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    with _SERVER_LOCK:  # ranks of two tests can start from two threads (test_rank_failure)
        ctx.set_forkserver_preload(_PRELOAD)
        # multiprocessing hands the server the caller's sys.path, but Python 3.11's server
        # never applies it: without the repository root on PYTHONPATH, `tests.rank_preload`
        # would not be found (silently: nothing preloaded) when pytest runs from elsewhere.
        # The server keeps the environment it starts with; ranks restore the caller's.
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, saved) if p)
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
    return ctx


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pg_timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    fresh_interpreter: bool = False,
) -> list[Any]:
    """Run fn(rank, world_size, *args) on world_size new CPU processes; return the
    per-rank results in rank order or raise RankError with the first failing rank's trace.
    fn must be importable (a module-level function). fresh_interpreter=True spawns each rank
    instead of forking it from the preloaded server ([Note: ranks forked from a preloaded
    server]): for tests of what a process reads when it starts."""
    outcomes = spawn_ranks(
        fn,
        world_size,
        args,
        timeout_s=timeout_s,
        pg_timeout_s=pg_timeout_s,
        env=env,
        fresh_interpreter=fresh_interpreter,
    )
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise RankError(f"rank {failed[0].rank} failed:\n{failed[0].error}")
    return [o.value for o in outcomes]


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pg_timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    fresh_interpreter: bool = False,
) -> list[RankOutcome]:
    """Like run_ranks, but return how every rank ended (RankOutcome, in rank order)
    instead of raising: for tests where ranks are meant to fail."""
    import torch

    ctx = _context(fresh_interpreter)
    parent_env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, r, world_size, tmp, args, pg_timeout_s, env or {}, parent_env),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        # Poll rather than join in order, so each rank's end time is known.
        deadline = time.monotonic() + timeout_s
        ended_at: dict[int, float] = {}
        while len(ended_at) < world_size and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if r not in ended_at and not p.is_alive():
                    ended_at[r] = time.time()
            time.sleep(0.02)
        killed = set()
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                killed.add(r)
            p.join()
            ended_at.setdefault(r, time.time())
        outcomes = []
        for r, p in enumerate(procs):
            outcome = RankOutcome(r, p.exitcode, r in killed, ended_at[r])
            path = os.path.join(tmp, f"rank{r}")
            if os.path.exists(path):
                status, payload, info = torch.load(path, weights_only=False)
                if status == "ok":
                    outcome = replace(outcome, value=payload)
                else:
                    outcome = replace(outcome, error=payload, **info)
            else:
                why = f"killed at the {timeout_s}s timeout" if r in killed else "no result"
                outcome = replace(outcome, error=f"{why} (exit code {p.exitcode})")
            outcomes.append(outcome)
        return outcomes
