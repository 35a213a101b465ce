"""The small error hierarchy users can catch. Bad input is a plain ValueError."""

from __future__ import annotations


class FsdpxError(RuntimeError):
    """Base class of fsdpx's runtime failures (not of bad-input ValueErrors)."""


class RankFailureError(FsdpxError):
    """Another rank of the job failed; this rank stops instead of waiting forever.

    `failed_rank` is the rank that failed first when it could be known, else None.
    """

    def __init__(self, message: str, *, failed_rank: int | None = None) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank
