"""Live per-rank telemetry: publisher (per rank), relay (per node), wire protocol and
replay log. The monitor TUI lives in monitor/; the protocol in monitor/PROTOCOL.md.

    wire/        the torch-free wire: protocol, transport, runs, history, logfile, relay
    publisher    the per-rank publisher (records per step, events)
    start        `start_telemetry`, called by `fsdpx.shard`
    flops, probes, sigterm   what the publisher measures and hooks
    phases       per-step phase times (the phase clock) and `timed_loader`
    relay        `python -m fsdpx.telemetry.relay` (runs wire.relay's main)

`fsdpx.shard` calls `fsdpx.telemetry.start.start_telemetry`; with `telemetry.enabled` the
engine then publishes a record per optimizer step through `engine.telemetry` (a Publisher).

This package file imports nothing: the monitor imports `fsdpx.telemetry.wire` modules and
must not pay for torch ([Note: the wire package is torch-free] in wire/__init__.py):
`fsdpx.telemetry.timed_loader` is imported on first use (PEP 562).
"""

from __future__ import annotations

from typing import Any

__all__ = ["timed_loader"]


def __getattr__(name: str) -> Any:
    if name == "timed_loader":
        from fsdpx.telemetry.phases import timed_loader

        return timed_loader
    raise AttributeError(f"module 'fsdpx.telemetry' has no attribute {name!r}")
