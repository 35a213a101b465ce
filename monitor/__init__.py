"""fsdpx-monitor: a terminal UI for fsdpx's live per-rank telemetry (and replays of it).

Imports only fsdpx.telemetry.protocol and fsdpx.telemetry.logfile from fsdpx (stdlib,
msgpack, zstandard): never torch, so it runs on a laptop next to the cluster.
"""
