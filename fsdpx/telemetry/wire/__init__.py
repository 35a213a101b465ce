"""The telemetry wire: everything a reader of fsdpx telemetry needs, and nothing of torch.

    protocol    frames, message fields (RECORD_FIELDS, EVENT_KINDS), handshake
    validate    checks of every message a relay accepts
    transport   addresses, sockets, secrets, the client side of the handshake
    runs        run ids and jobs: which launch a record belongs to
    history     the relay's bounded per-rank history for late monitors
    logfile     the zstd replay log (writer and `iter_log`)
    relay       the per-node relay (`python -m fsdpx.telemetry.relay`)
    coalesce    `batch` frames for monitors that ask (hello `batch_s`)
    columns     records as columns in those batches (protocol 1.1, hello `columns`)

[Note: the wire package is torch-free]
The monitor (monitor/) and the relay run where torch may not be installed (a laptop, a
login node), so this package and the package files above it (`fsdpx/__init__.py`,
`fsdpx/telemetry/__init__.py`, both of which import nothing eagerly) use only the
standard library, msgpack and zstandard; tests/test_monitor_app.py checks that
importing it, the monitor and the relay's command line never loads torch (the monitor
itself also uses numpy, a dependency of fsdpx, for its straggler scores). The
training side (publisher, probes, FLOP counting, start-up) lives one level up in
fsdpx/telemetry/ and imports from here, never the other way round.

This package file imports nothing: import the module you need.
"""
