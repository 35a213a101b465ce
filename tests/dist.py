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
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 240.0


class RankError(AssertionError):
    pass


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    tmp: str,
    args: tuple[Any, ...],
    pg_timeout_s: float,
    env: dict[str, str],
) -> None:
    import torch
    import torch.distributed as dist

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
        torch.save(("ok", result), out + ".part")
    except BaseException as exc:  # report everything, including SystemExit
        code = 1
        torch.save(
            ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"), out + ".part"
        )
    os.replace(out + ".part", out)
    # A process exiting right after gloo work can SIGABRT in teardown (DESIGN.md section 3):
    # destroy the group, then leave without running atexit handlers.
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    os._exit(code)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pg_timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run fn(rank, world_size, *args) on world_size spawned CPU processes; return the
    per-rank results in rank order or raise RankError with the first failing rank's trace.
    fn must be importable (a module-level function)."""
    import torch

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, r, world_size, tmp, args, pg_timeout_s, env or {}),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        for r, p in enumerate(procs):
            path = os.path.join(tmp, f"rank{r}")
            if os.path.exists(path):
                status, payload = torch.load(path, weights_only=False)
                (results if status == "ok" else errors)[r] = payload
            else:
                errors[r] = f"no result (exit code {p.exitcode}; timeout {timeout_s}s)"
        if errors:
            first = min(errors)
            raise RankError(f"rank {first} failed:\n{errors[first]}")
        return [results[r] for r in range(world_size)]
