"""Process-group start-up and rank-failure handling.

`init_distributed` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT); without it the job is one process and a private one-rank gloo group is
made so every code path (FSDP2, DTensor) is the same at world size 1.

[Note: rank failure] A rank that raises inside an engine call records
"rank R: <error>" in the job's store before re-raising; its process then exits, which
closes its gloo connections. Peers blocked in a collective fail (connection closed, or the
process-group timeout when the failed rank lingers), read the record and raise
`RankFailureError` naming rank R. Nothing waits longer than `Config.timeout_s`.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from fsdpx.config import Config
from fsdpx.errors import RankFailureError

_FAILURE_KEY = "fsdpx/first_failure"
T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
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
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else cfg.timeout_s)
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            # No launcher: a one-rank group through an in-memory store, no port needed.
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def first_failure() -> tuple[int | None, str] | None:
    """The first failure recorded by any rank, as (rank, message), or None."""
    store = _store()
    if store is None:
        return None
    try:
        if not store.check([_FAILURE_KEY]):
            return None
        text = store.get(_FAILURE_KEY).decode(errors="replace")
    except Exception:  # the store's owner (rank 0) may itself be gone
        return None
    rank_text, _, message = text.partition(":")
    return (int(rank_text) if rank_text.isdigit() else None, message.strip())


def record_failure(exc: BaseException) -> None:
    """Record this rank's failure for its peers; the first record wins."""
    store = _store()
    if store is None or not dist.is_initialized():
        return
    text = f"{dist.get_rank()}: {type(exc).__name__}: {exc}".encode()[:4096]
    try:
        # compare_set only writes when the key is absent (expected value b""), so the first
        # failure is kept and a cascade of secondary errors does not overwrite it.
        store.compare_set(_FAILURE_KEY, b"", text)
    except Exception:
        pass


def _is_peer_failure(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        s in text
        for s in (
            "connection closed",
            "connection reset",
            "timed out",
            "timeout",
            "broken pipe",
            "gloo",
            "nccl",
        )
    )


@contextmanager
def failure_guard() -> Iterator[None]:
    """Turn a peer's failure into RankFailureError and record this rank's own failures.

    See [Note: rank failure]. Used by the engine around every call that communicates.
    """
    try:
        yield
    except RankFailureError:
        raise
    except Exception as exc:
        if _is_peer_failure(exc):
            failure = first_failure()
            me = dist.get_rank() if dist.is_initialized() else 0
            if failure is not None and failure[0] != me:
                raise RankFailureError(
                    f"rank {failure[0]} failed ({failure[1]}); rank {me} stops too",
                    failed_rank=failure[0],
                ) from exc
            raise RankFailureError(
                f"a collective failed on rank {me} ({type(exc).__name__}: {exc}); another "
                "rank probably died or stalled past the process-group timeout",
            ) from exc
        record_failure(exc)
        raise


def guarded(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorator form of failure_guard for engine methods."""

    def wrapper(*args: object, **kwargs: object) -> T:
        with failure_guard():
            return fn(*args, **kwargs)

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper
