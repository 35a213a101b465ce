"""Process-group start-up, process-group timeouts and rank-failure handling.

`init_distributed` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT); without it the job is one process and a private one-rank gloo group is
made so every code path (FSDP2, DTensor) is the same at world size 1.

[Note: rank failure]
A rank that raises inside an engine call records "R: <type>: <message>" under one key of
the job's store (`compare_set` against "", so the first failure is kept and the cascade
of secondary errors on other ranks does not overwrite it), then re-raises its own error
unchanged; its process exits, which closes its gloo connections. A peer blocked in a
collective then fails in one of two ways (torch 2.13, gloo, checked by
tests/test_rank_failure.py):

- the failed process has exited: at once, RuntimeError "... Connection closed by peer ..."
  or "... Read error ...: Connection reset by peer ...";
- the failed process lingers (hung, sleeping, debugging): after the process-group
  timeout, RuntimeError "... Timed out waiting 5000ms for recv (or send) operation to
  complete"; a group being created times out with RuntimeError "Wait timeout".

The peer then reads the record and raises `RankFailureError` naming rank R and R's error.
A rank killed outright (SIGKILL, os._exit, the OOM killer) records nothing. Its peers on
the same host then find its process gone (fsdpx/liveness.py, [Note: vanished ranks]),
record "R: RankVanished: ..." for it the same way (first record wins), and raise
`RankFailureError` with failed_rank=R, as every later survivor does on reading the
record. A survivor on another host waits up to `_REMOTE_WAIT_S` for that record; without
it (the rank was alone on its host, or stalled rather than died) the error has
failed_rank=None and gloo's message. A rank that stops with RankFailureError records
nothing of its own, so it is never mistaken for the first failure.

Nothing waits longer than the group's timeout plus `_STORE_CALL_S` for the store lookup
(when nobody recorded an error, plus `VANISH_WAIT_S`, and `_REMOTE_WAIT_S` more with ranks
on other hosts). The timeout must be `Config.timeout_s` on every group: init_distributed sets it on the
default group, but groups made by `new_group` (so by DeviceMesh for an axis smaller than
the world: HSDP, TP, PP) get torch's 30-minute gloo default whatever the default group's
timeout, both while they are created (waiting for a dead peer's address) and afterwards.
Create them with the timeout (DeviceMesh `backend_override` options) or set it afterwards
with `set_process_group_timeouts`. The lookup runs in a daemon thread with a bounded join:
a store whose server has exited fails fast (DistNetworkError), but a stalled one blocks
`check`/`get` past the store's own timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdpx import liveness
from fsdpx.config import Config
from fsdpx.errors import RankFailureError

_FAILURE_KEY = "fsdpx/first_failure"
_STORE_CALL_S = 5.0
"""Longest wait for one store call made while failing (see [Note: rank failure])."""
_MAX_RECORD_CHARS = 4096
_VANISHED = "RankVanished"
"""The "type" of a record written for a peer found dead (see [Note: vanished ranks])."""
_REMOTE_WAIT_S = 3.0
"""Longest wait for a record from a survivor beside a peer on another host."""
# Lower-cased fragments of the errors gloo (and NCCL) raise on a rank whose peer died or
# stalled. Deliberately not "gloo"/"nccl" alone: local misuse ("ProcessGroupGloo::broadcast:
# invalid root rank") is this rank's own error and must be recorded as such.
_PEER_FAILURE_TEXT = (
    "connection closed",
    "connection reset",
    "closed the connection",
    "broken pipe",
    "timed out",
    "timeout",
    "remote process exited",
    "communicator was aborted",
)
T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job (returned by init_distributed)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def resolve_device(cfg_device: str, local_rank: int) -> torch.device:
    if cfg_device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "config key 'device' is 'cuda' but no CUDA device is available; use 'auto' or 'cpu'"
        )
    if cfg_device == "cuda" or (cfg_device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def init_distributed(cfg: Config | None = None, *, timeout_s: float | None = None) -> DistInfo:
    """Start (or join) the default process group; gloo on CPU, nccl (+gloo for CPU) on CUDA.

    An existing default group (made by the caller, or by an earlier call) is reused; its
    timeout is set to the configured one, so `Config.timeout_s` bounds every collective
    fsdpx runs, whoever made the group.

    Args:
        cfg: supplies `device` and `timeout_s`; defaults apply when None.
        timeout_s: overrides cfg.timeout_s.
    Returns:
        DistInfo with this process's rank, world size, local rank and device.

    Example::

        info = fsdpx.init_distributed(cfg)   # under torchrun, or plain `python train.py`
    """
    cfg = cfg or Config()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(cfg.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    seconds = timeout_s if timeout_s is not None else cfg.timeout_s
    if seconds <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds; got {seconds}")
    timeout = datetime.timedelta(seconds=seconds)
    if dist.is_initialized():
        set_process_group_timeouts(seconds)
    else:
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            # No launcher: a one-rank group through an in-memory store, no port needed.
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    rank, world_size = dist.get_rank(), dist.get_world_size()
    store = _store()
    if world_size > 1 and store is not None:
        # So that peers can tell this process was killed (see [Note: rank failure]).
        _bounded(lambda: liveness.announce(store, rank))
    return DistInfo(rank, world_size, local_rank, device)


def set_process_group_timeouts(timeout_s: float, *meshes: DeviceMesh) -> None:
    """Set the timeout of the default group and of every group of `meshes`.

    Groups made by `new_group` (and so by DeviceMesh for an axis smaller than the world)
    take torch's default timeout (30 minutes on gloo), not the default group's: without
    this a rank failure inside an HSDP or TP group waits half an hour. torchtitan and
    `torch.distributed.breakpoint` set timeouts the same way.

    Args:
        timeout_s: seconds a collective may wait before it fails.
        meshes: meshes whose per-axis groups get the timeout too (a flattened view such
            as ParallelDims.dp_mesh(mesh) has its own group: pass it as well).

    Example::

        mesh = dims.build_mesh("cpu")
        set_process_group_timeouts(cfg.timeout_s, mesh, ParallelDims.dp_mesh(mesh))
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    groups: list[dist.ProcessGroup] = [dist.distributed_c10d._get_default_group()]
    for mesh in meshes:
        groups.extend(mesh.get_all_groups())
    for group in {id(g): g for g in groups}.values():
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def _bounded(call: Callable[[], T], timeout_s: float = _STORE_CALL_S) -> T | None:
    """call() in a daemon thread; None if it raised or took longer than timeout_s.

    A thread left blocked on a stalled store is abandoned: the process is failing anyway.
    """
    result: list[T] = []

    def run() -> None:
        with contextlib.suppress(Exception):  # the store's server may itself be gone
            result.append(call())

    thread = threading.Thread(target=run, name="fsdpx-failure-store", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return result[0] if result else None


def first_failure() -> tuple[int | None, str] | None:
    """The first failure recorded by any rank, as (rank, "Type: message"), or None.

    Returns None too when the store cannot answer within a few seconds.
    """
    store = _store()
    if store is None:
        return None

    def lookup() -> bytes | None:
        # check() first: get() on an absent key would wait for the store's timeout.
        return store.get(_FAILURE_KEY) if store.check([_FAILURE_KEY]) else None

    return _parse_record(_bounded(lookup))


def _parse_record(raw: bytes | None) -> tuple[int | None, str] | None:
    if not raw:
        return None
    rank_text, _, message = raw.decode(errors="replace").partition(":")
    return (int(rank_text) if rank_text.isdigit() else None, message.strip())


def record_failure(exc: BaseException) -> None:
    """Record this rank's failure for its peers; the first record of the job wins."""
    store = _store()
    if store is None or not dist.is_initialized():
        return
    text = f"{dist.get_rank()}: {type(exc).__name__}: {exc}"[:_MAX_RECORD_CHARS]
    # compare_set(key, "", value) writes only when the key is absent (FileStore, TCPStore
    # and HashStore alike), so a later, secondary failure never overwrites the first.
    _bounded(lambda: store.compare_set(_FAILURE_KEY, "", text))


def _is_peer_failure(exc: BaseException) -> bool:
    """Whether exc is a collective failing because another rank died or stalled."""
    if isinstance(exc, dist.DistError):  # DistNetworkError, DistBackendError, DistStoreError
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(s in text for s in _PEER_FAILURE_TEXT)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _vanished_record(me: int) -> tuple[int | None, str] | None:
    """With no record of the first failure: look for peers whose processes ended, record
    the first of them for the others, and return the job's record; None if none was found.
    See [Note: vanished ranks] in fsdpx/liveness.py."""
    store = _store()
    if store is None or not dist.is_initialized():
        return None
    world_size = dist.get_world_size()
    peers = _bounded(lambda: liveness.neighbours(store, me, world_size)) or []

    def explained() -> set[int]:
        marks = _bounded(lambda: liveness.stopped(store))
        # The store cannot say which ends were reported (its host may be the rank whose
        # process ended, as with a plain env:// store on rank 0): no evidence, no name.
        return {p.rank for p in peers} if marks is None else marks

    gone = liveness.vanished(peers, explained=explained)
    if gone:
        text = (
            f"{gone[0].rank}: {_VANISHED}: {liveness.describe(gone)} vanished: its process "
            f"ended without recording an error (found by rank {me})"
        )
        # The first record wins: every survivor reports what the first one found.
        winner = _bounded(lambda: store.compare_set(_FAILURE_KEY, "", text))
        return _parse_record(winner) or _parse_record(text.encode())
    if len(peers) + 1 < world_size:
        # Ranks on other hosts cannot be checked from here; a survivor beside the dead one
        # may record it (bounded: the dead rank may have been alone on its host).
        deadline = time.monotonic() + _REMOTE_WAIT_S
        while time.monotonic() < deadline:
            failure = first_failure()
            if failure is not None and failure[0] is not None:
                return failure
            time.sleep(0.05)
    return None


def _peer_failure_error(exc: BaseException) -> RankFailureError:
    error = _describe_peer_failure(exc)
    store = _store()
    if store is not None and dist.is_initialized():
        # This process is about to end for a reason it reports: peers still looking for a
        # vanished rank must not take its end for one ([Note: vanished ranks]).
        rank = dist.get_rank()
        _bounded(lambda: liveness.mark_stopped(store, rank))
    return error


def _describe_peer_failure(exc: BaseException) -> RankFailureError:
    me = dist.get_rank() if dist.is_initialized() else 0
    failure = first_failure()
    if failure is None:
        failure = _vanished_record(me)
    if failure is not None and failure[0] is not None and failure[0] != me:
        rank, what = failure
        if what.startswith(f"{_VANISHED}: "):
            return RankFailureError(
                f"{what.removeprefix(f'{_VANISHED}: ')}. It was probably killed (SIGKILL, "
                "the out-of-memory killer), called os._exit, or failed outside an fsdpx "
                f"engine call. Rank {me} stops too (its "
                f"collective failed: {_first_line(exc)}). Look in rank {rank}'s output and "
                "the kernel log (dmesg) for why it ended.",
                failed_rank=rank,
            )
        return RankFailureError(
            f"rank {rank} failed with {what}; rank {me} stops too (its collective failed: "
            f"{_first_line(exc)}). The traceback is in rank {rank}'s output.",
            failed_rank=rank,
        )
    earlier = f" This rank failed earlier with {failure[1]}." if failure is not None else ""
    return RankFailureError(
        f"a collective failed on rank {me} ({_first_line(exc)}) and no other rank recorded "
        "an error: a rank was probably killed (SIGKILL, out of memory, os._exit) or stalled "
        f"past the process-group timeout (Config.timeout_s).{earlier} Check the other "
        "ranks' output.",
        failed_rank=None,
    )


@contextlib.contextmanager
def failure_guard() -> Iterator[None]:
    """Turn a peer's failure into RankFailureError and record this rank's own failures.

    This rank's own errors are re-raised unchanged. See [Note: rank failure]. Used by the
    engine around every call that communicates.

    Example::

        with failure_guard():
            loss.backward()
    """
    try:
        yield
    except RankFailureError:
        raise
    except Exception as exc:
        if _is_peer_failure(exc):
            raise _peer_failure_error(exc) from exc
        record_failure(exc)
        raise


def guarded(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorator form of failure_guard for engine methods."""

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> T:
        with failure_guard():
            return fn(*args, **kwargs)

    return wrapper
