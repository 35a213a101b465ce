"""fsdpx-monitor: a terminal UI for fsdpx's live per-rank telemetry (and replays of it).

Imports only the torch-free wire package `fsdpx.telemetry.wire` from fsdpx (stdlib,
msgpack, zstandard): never torch, so it runs on a laptop next to the cluster.
"""
