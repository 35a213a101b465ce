"""The small error hierarchy users can catch. Bad input is a plain ValueError.

FsdpxError (RuntimeError)
  RankFailureError    another rank failed; this one stops (see [Note: rank failure]
                      in fsdpx/distributed.py)
"""

from __future__ import annotations


class FsdpxError(RuntimeError):
    """Base class of fsdpx's runtime failures (not of bad-input ValueErrors)."""


class RankFailureError(FsdpxError):
    """Another rank of the job failed; this rank stops instead of waiting forever.

    Raised by engine calls on the ranks that did not fail, within the process-group
    timeout (Config.timeout_s). The failing rank itself raises its own error unchanged.

    `failed_rank` is the rank that failed first when it recorded its error (it raised
    inside an engine call) or when a rank on its host found its process gone (it was
    killed: SIGKILL, the out-of-memory killer, os._exit); else None (it stalled without
    raising, or was killed alone on another host). The message names that rank and its
    error or its pid, or quotes the collective's error.

    Example::

        try:
            engine.backward(loss)
        except fsdpx.RankFailureError as e:
            log.error("stopping: rank %s failed", e.failed_rank)
            raise
    """

    def __init__(self, message: str, *, failed_rank: int | None = None) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank
