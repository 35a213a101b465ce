"""Host-to-device copies of the updated parameters, on a side stream.

Both state stores write each updated parameter (or its 16-bit copy) from host memory into
the device parameter through `DeviceCopies`: the copy of one bucket or chunk overlaps the
computation of the next, and the next forward is ordered after the copies without blocking
the host. Without an accelerator every copy is a plain synchronous copy.

With telemetry on, the copies of one step are timed on the copy stream by a CUDA event
pair (`h2d_s` of the record, fsdpx/telemetry/phases.py [Note: phase spans]); without an
accelerator there is no host-to-device copy and `h2d_s` stays nil.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fsdpx.telemetry.phases import H2D, phase_clock


class DeviceCopies:
    """The copy stream of one offloaded optimizer.

    Args:
        on_accel: whether the device parameters live on an accelerator.

    Example::

        copies.begin(); copies.copy(local(p), host_master); copies.finish()
    """

    def __init__(self, on_accel: bool) -> None:
        self.stream = torch.cuda.Stream() if on_accel and torch.cuda.is_available() else None
        self._h2d_done: torch.cuda.Event | None = None
        self._clock = phase_clock()
        self._h2d_start: torch.cuda.Event | None = None

    def begin(self) -> None:
        """Order the side stream after everything queued so far on the current stream
        (the last reads of the parameters, FSDP's wait for its reductions)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
            if self._clock.enabled:
                self._h2d_start = torch.cuda.Event(enable_timing=True)
                self._h2d_start.record(self.stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy host `src` into the device parameter `dst` (async on the side stream)."""
        if self.stream is None:
            dst.copy_(src.view(dst.shape))
            return
        with torch.cuda.stream(self.stream):
            dst.copy_(src.view(dst.shape), non_blocking=True)

    def finish(self) -> None:
        """Order the next forward after the copies back, without blocking the host."""
        if self.stream is None:
            return
        start, self._h2d_start = self._h2d_start, None
        event = torch.cuda.Event(enable_timing=start is not None)
        event.record(self.stream)
        torch.cuda.current_stream().wait_event(event)
        self._h2d_done = event
        if start is not None:
            self._clock.add_events(H2D, start, event)

    def wait_done(self) -> None:
        """Block until the copies of the last `finish` landed (their host buffers are free)."""
        if self._h2d_done is not None:
            self._h2d_done.synchronize()

    def fence(self) -> Callable[[], None] | None:
        """A callable that blocks until the copies queued so far landed (None: no stream)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event.synchronize
