"""One background writer thread at a time, whose failure is never lost.

The foreground snapshots state to host memory and hands a closure to `BackgroundWriter`;
training continues while the thread compresses, writes, votes and commits (its collectives
run on a process group of their own, so they never interleave with training's).
`wait()` joins the thread and raises what it raised; it is called by the next save, by
load, by `Checkpointer.close()` and at interpreter exit (atexit), so a failed background
save surfaces at the latest there.
"""

from __future__ import annotations

import atexit
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path


class BackgroundWriter:
    """Runs one job at a time in a non-daemon thread (so a normal exit lets it finish)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._result: Path | None = None
        self._error: BaseException | None = None
        self._registered = False

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def submit(self, job: Callable[[], Path]) -> None:
        """Start `job` in the background; the previous job must have been waited for."""
        assert self._thread is None, "wait() before submitting the next job"
        if not self._registered:
            atexit.register(self._wait_at_exit)
            self._registered = True

        def run() -> None:
            try:
                self._result = job()
            except BaseException as exc:  # kept for wait(): a background error never vanishes
                self._error = exc

        self._result, self._error = None, None
        self._thread = threading.Thread(target=run, name="fsdpx-checkpoint-writer")
        self._thread.start()

    def wait(self) -> Path | None:
        """Block until the running job (if any) ends; its path, or re-raise its error."""
        thread, self._thread = self._thread, None
        if thread is None:
            return None
        thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self._result

    def close(self) -> Path | None:
        """wait(), then stop watching for interpreter exit."""
        try:
            return self.wait()
        finally:
            if self._registered:
                atexit.unregister(self._wait_at_exit)
                self._registered = False

    def _wait_at_exit(self) -> None:
        try:
            self.wait()
        except BaseException:
            # Raising in atexit is swallowed after printing; say what failed first.
            sys.stderr.write("fsdpx: the asynchronous checkpoint save failed:\n")
            traceback.print_exc()
