"""Live per-rank telemetry: publisher (per rank), relay (per node), wire protocol and
replay log. The monitor TUI lives in monitor/; the protocol in monitor/PROTOCOL.md.

`fsdpx.shard` calls `fsdpx.telemetry.start.start_telemetry`; with `telemetry.enabled` the
engine then publishes a record per optimizer step through `engine.telemetry` (a Publisher).

This package file imports nothing: the monitor imports `fsdpx.telemetry.protocol` and
`fsdpx.telemetry.logfile` and must not pay for torch.
"""
