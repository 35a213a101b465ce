"""Errors that cross ranks: a rank's exception as a msgpack report in a vote, and the
same exception rebuilt from it on every rank (type and message of the failing rank)."""

from __future__ import annotations

from typing import Any

from checkpoint_tools.format import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    DeepSpeedCheckpointError,
)

_REBUILDABLE: dict[str, type[Exception]] = {
    c.__name__: c
    for c in (
        ValueError,
        NotImplementedError,
        CheckpointError,
        CheckpointNotFoundError,
        CheckpointCorruptError,
        CheckpointFormatError,
        CheckpointVersionError,
        DeepSpeedCheckpointError,
    )
}


def rebuild_error(report: dict[str, Any], rank: int) -> Exception:
    cls = _REBUILDABLE.get(report["type"])
    message = report["message"]
    if cls is None:
        return CheckpointError(f"loading failed on rank {rank}: {report['type']}: {message}")
    # Bypass __init__ (CheckpointError's appends file/tensor/offset, already in message).
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    exc.__dict__.update(report.get("attrs") or {})
    return exc


def error_report(exc: Exception, message: str) -> dict[str, Any]:
    attrs = {k: v for k, v in vars(exc).items() if v is None or isinstance(v, str | int)}
    return {"ok": False, "type": type(exc).__name__, "message": message, "attrs": attrs}
