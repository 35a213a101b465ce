"""A SIGTERM hook for the publisher: the rank says "exit, terminated" before it dies.

SIGTERM is how a job is preempted or cancelled (SLURM, Kubernetes, torchrun forwarding
its own SIGTERM to the ranks). By default it kills the process without running atexit,
so the publisher's exit event never went out and the monitor showed the ranks as dead,
as if they had crashed.

[Note: chaining SIGTERM] The hook is a guest in a process-wide table, so it
- installs only from the main thread (Python's rule) and only where the publisher already
  installs hooks (`install_hooks=True`);
- leaves an ignored SIGTERM ignored, and a handler installed from C (getsignal() is None)
  alone: it cannot call it, so it does not replace it;
- with the default action there (a plain rank), runs `on_term` (the publisher sends its
  exit event and flushes), then removes itself and re-raises SIGTERM, so the process
  still dies of it with the same exit status as without telemetry;
- with a Python handler there, only notes the signal and calls that handler, which
  decides the process's fate: it may stop training gracefully and go on publishing, or
  raise (SystemExit runs atexit, where the publisher closes); either way the exit event
  that follows says "terminated";
- puts the previous handler back on `uninstall()` (the publisher's close), unless someone
  installed another handler after it, which it then leaves in place;
- over another publisher's hook (two engines in one process), runs its own `on_term` when
  the chain ends in the default action, then hands the signal down; the default action is
  always taken with SIG_DFL set explicitly, so a hook left on top can never bounce the
  re-raised signal back down the chain (found in review: two hooks recursed until a
  RecursionError escaped into training).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

_Handler = Callable[[int, FrameType | None], Any] | int | None


class SigtermHook:
    """Notes SIGTERM and calls the handler that was there before; runs `on_term()` first
    when that is the default action, which kills the process ([Note: chaining SIGTERM]).

    Args:
        on_term: the last words before a SIGTERM death (the publisher: send the exit
            event, flush). Anything it raises is swallowed: the process dies regardless.

    Example::

        hook = SigtermHook(lambda: publisher.close(reason="terminated"))
        hook.install()
        ...
        hook.uninstall()
    """

    def __init__(self, on_term: Callable[[], None]) -> None:
        self._on_term = on_term
        self._previous: _Handler = None
        self.installed = False
        self.received = False
        """A SIGTERM arrived while installed (the publisher's exit reason)."""

    def install(self) -> bool:
        """Install over the current handler; False (nothing done) off the main thread,
        when SIGTERM is ignored, or when its handler was not installed from Python."""
        if self.installed or threading.current_thread() is not threading.main_thread():
            return False
        previous = signal.getsignal(signal.SIGTERM)
        if previous is None or previous == signal.SIG_IGN:
            return False
        self._previous = previous
        signal.signal(signal.SIGTERM, self._handle)
        self.installed = True
        return True

    def uninstall(self) -> None:
        """Put the previous handler back, if ours is still the one installed."""
        if not self.installed or threading.current_thread() is not threading.main_thread():
            return
        self.installed = False
        if signal.getsignal(signal.SIGTERM) == self._handle:
            signal.signal(signal.SIGTERM, self._previous)

    def _dies(self) -> bool:
        """Whether a SIGTERM reaching this hook ends in the default action (death)."""
        below = getattr(self._previous, "__self__", None)
        if isinstance(below, SigtermHook):
            return below._dies()
        return not callable(self._previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True
        previous = self._previous
        if self._dies():
            # Telemetry must never change how the process ends.
            with contextlib.suppress(Exception):
                self._on_term()
        if callable(previous):  # a script's handler decides, or another hook passes it on
            previous(signum, frame)
            return
        self.installed = False
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # the default action: die of SIGTERM
