"""A minimal progress bar on stderr, drawn only when stderr is a terminal (logs and pipes
stay clean) and at most ~10 times a second."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Usage: `with Progress("verify", total_bytes) as bar: bar.update(n)`."""

    def __init__(self, label: str, total: int, *, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty()
        self._start = time.monotonic()
        self._last = 0.0

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(self.done / self.total, 1.0)
        rate = self.done / max(now - self._start, 1e-9) / 2**20
        bar = "#" * int(frac * 30)
        self.stream.write(
            f"\r{self.label} [{bar:<30}] {frac:6.1%} {self.done / 2**20:9.1f} MiB {rate:7.1f} MiB/s"
        )
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
