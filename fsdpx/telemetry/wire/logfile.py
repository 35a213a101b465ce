"""The relay's replay log: the frame stream, zstd-compressed, append-only (stdlib + msgpack
+ zstandard; no torch, the monitor imports it).

Layout: one or more zstd frames back to back (each relay session that opens the file
appends a new one). Decompressed, the content is a sequence of protocol frames
(fsdpx/telemetry/wire/protocol.py, never authenticated): a "log" header message from each
session, then the "hello", "records" and "events" messages in the order the relay
received them. The writer flushes a zstd block at least every `flush_interval_s`, so a
relay that crashes loses at most that much; the reader stops quietly at a truncated tail.

Example::

    with open_log_writer("run.tlm") as log:
        log.write_message({"type": "records", "records": [...]})
    for message in iter_log("run.tlm"):
        print(message["type"])
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import zstandard

from fsdpx.telemetry.wire.protocol import (
    PROTOCOL_VERSION,
    FrameDecoder,
    ProtocolError,
    encode_frame,
)

LOG_SUFFIX = ".tlm"
_READ_CHUNK = 1 << 16


class LogWriter:
    """Appends frames to a zstd-compressed log; made by `open_log_writer`."""

    def __init__(self, file: BinaryIO, *, level: int, flush_interval_s: float) -> None:
        self._file = file
        self._writer = zstandard.ZstdCompressor(level=level).stream_writer(
            file, closefd=False, write_return_read=True
        )
        self._flush_interval_s = flush_interval_s
        self._last_flush = time.monotonic()
        self.frames_written = 0
        self.closed = False

    def write_frame(self, frame: bytes) -> None:
        """Append one already-encoded (unauthenticated) frame."""
        self._writer.write(frame)
        self.frames_written += 1
        if time.monotonic() - self._last_flush >= self._flush_interval_s:
            self.flush()

    def write_message(self, message: Mapping[str, Any]) -> None:
        """Encode and append one message."""
        self.write_frame(encode_frame(message))

    def flush_if_due(self) -> None:
        """flush() when the last one is older than flush_interval_s (cheap to call often)."""
        if time.monotonic() - self._last_flush >= self._flush_interval_s:
            self.flush()

    def flush(self) -> None:
        """Make everything written so far decodable from the file (a zstd block end)."""
        if self.closed:
            return
        self._writer.flush(zstandard.FLUSH_BLOCK)
        self._file.flush()
        self._last_flush = time.monotonic()

    def close(self) -> None:
        """End the zstd frame and close the file (idempotent)."""
        if self.closed:
            return
        self._writer.flush(zstandard.FLUSH_FRAME)
        self._file.flush()
        self._file.close()
        self.closed = True

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def open_log_writer(
    path: str | os.PathLike[str], *, level: int = 3, flush_interval_s: float = 1.0
) -> LogWriter:
    """Open (create or append to) a replay log and write this session's header.

    Args:
        path: the log file (conventionally `*.tlm`); parent folders are created, a new
            file is readable by its owner only (0600).
        level: zstd compression level.
        flush_interval_s: longest time written frames stay only in memory.
    Returns:
        A LogWriter (a context manager).

    Example::

        log = open_log_writer("runs/today.tlm")
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Created owner-only, like the relay's socket: the log holds the whole run's telemetry
    # (hosts, pids, losses, tracebacks), which other users of the machine must not read.
    # An existing file keeps the mode its owner gave it.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    file = os.fdopen(fd, "ab")  # the LogWriter owns and closes it
    writer = LogWriter(file, level=level, flush_interval_s=flush_interval_s)
    writer.write_message(
        {
            "type": "log",
            "version": PROTOCOL_VERSION,
            "time": time.time(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
    )
    writer.flush()
    return writer


def iter_log(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The messages of a replay log, in the order the relay received them.

    A truncated or corrupt tail (the relay crashed mid-write) ends the iteration
    quietly after the last whole frame; a file that is not a zstd log at all raises.

    Args:
        path: a log written by `open_log_writer` (e.g. by the relay's `--log`).
    Returns:
        An iterator of message dicts ("log" headers, "hello", "records", "events").
    Raises:
        ValueError: the file does not start with a zstd frame.

    Example::

        steps = [r["step"] for m in iter_log("run.tlm") if m["type"] == "records"
                 for r in m["records"]]
    """
    decoder = FrameDecoder()
    with open(path, "rb") as f:
        head = f.read(4)
        if head and head != b"\x28\xb5\x2f\xfd":
            raise ValueError(
                f"{path} is not a telemetry log (expected a zstd frame, found bytes "
                f"{head!r}); logs are written by `python -m fsdpx.telemetry.relay --log`"
            )
        f.seek(0)
        unzip = zstandard.ZstdDecompressor().decompressobj()
        while chunk := f.read(_READ_CHUNK):
            while chunk:
                try:
                    data = unzip.decompress(chunk)
                except zstandard.ZstdError:
                    return  # corrupt tail: keep what was whole
                try:
                    decoder.push(data)
                    # One message at a time: a bad frame (e.g. a msgpack timestamp a
                    # relay before the validation walk let in) keeps every one before it.
                    while (message := decoder.next_message()) is not None:
                        yield message
                except ProtocolError:
                    return
                # A session's zstd frame ended: the next one (a later session) follows.
                chunk = unzip.unused_data if unzip.eof else b""
                if unzip.eof:
                    unzip = zstandard.ZstdDecompressor().decompressobj()
