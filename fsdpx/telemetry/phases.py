"""Per-step phase times of this rank: data wait, forward, backward, optimizer step,
exposed communication and host-to-device copies (the record fields `PHASE_FIELDS` of
fsdpx/telemetry/wire/protocol.py, monitor/PROTOCOL.md "Phase times").

Who measures what:

- data wait: `timed_loader` (user loops) and `Engine.train_batch` (its `next(data_iter)`);
- forward / backward / optimizer: the engine, around `module(...)`, the loss's backward and
  the optimizer-step boundary (overflow check, clipping, step, scheduler, zero_grad);
- comm wait: the one comm layer (fsdpx/comm/counted.py), around each blocking collective,
  and FSDP's comm slot (fsdpx/comm/fsdp_slot.py [Note: timing FSDP's waits]) around the
  waits of FSDP's own all-gathers / reduce-scatters on a CPU device;
- h2d: offload's copy stream (fsdpx/offload/copies.py), on an accelerator only.

[Note: phase spans]
Data wait, forward, backward and optimizer are disjoint spans of the training thread; comm
wait and h2d are measured inside them (a collective inside the optimizer step counts in
both), so they are never added to the others. On CPU a span is wall time. On CUDA the
compute spans (forward, backward, optimizer, comm wait, h2d) are CUDA event pairs, because
the host's wall time of a kernel launch says nothing about the kernel: the publisher reads
`elapsed_time` on its sender thread once the step's events have completed (the same
one-step-late path as the loss, [Note: publishing never blocks training]). Data wait is
host time on every device: it is the host waiting for the loader.

[Note: one phase clock]
The clock is process-wide (`phase_clock()`), like the comm log ([Note: one comm log] in
fsdpx/comm/counted.py): the comm layer and `timed_loader` are called from places that
know nothing of the engine. It measures only while a publisher has it enabled (otherwise
every call returns at once and nothing accumulates); the publisher takes the step's times
at each optimizer step, which also resets them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

PHASES: tuple[str, ...] = ("data_wait", "forward", "backward", "optimizer", "comm_wait", "h2d")
"""Phase names, in record order; the record field of phase `p` is `f"{p}_s"`."""
DATA_WAIT, FORWARD, BACKWARD, OPTIMIZER, COMM_WAIT, H2D = range(len(PHASES))
_EVENT_TIMED = frozenset({FORWARD, BACKWARD, OPTIMIZER, COMM_WAIT, H2D})

T = TypeVar("T")
Token = float | torch.cuda.Event | None
"""What `begin` returns and `end` takes: a perf_counter value, a CUDA event, or None
(the clock is off)."""


@dataclass
class StepPhases:
    """One step's phase times as taken from the clock (resolved on the sender thread).

    `seconds[i]` is the wall time summed for phase i, None where nothing measured it;
    `events` are (phase, start, end) CUDA event pairs still to be read.
    """

    seconds: list[float | None]
    events: list[tuple[int, torch.cuda.Event, torch.cuda.Event]]

    @property
    def last_event(self) -> torch.cuda.Event | None:
        """The event recorded last: once it completed, every pair can be read."""
        return self.events[-1][2] if self.events else None

    def seconds_per_phase(self) -> list[float | None]:
        """Seconds per phase, the CUDA pairs added in (call once `last_event` completed)."""
        out = list(self.seconds)
        for phase, start, end in self.events:
            out[phase] = (out[phase] or 0.0) + start.elapsed_time(end) / 1000.0
        return out


class PhaseClock:
    """Accumulates this step's phase times (module docstring, [Note: phase spans]).

    Example::

        clock = phase_clock()
        token = clock.begin(FORWARD)
        out = model(x)
        clock.end(FORWARD, token)
        phases = clock.take()          # the publisher does this once per optimizer step
    """

    def __init__(self) -> None:
        self.enabled = False
        self.cuda = False
        self._users = 0
        self._seconds: list[float | None] = [None] * len(PHASES)
        self._events: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []

    def enable(self, device: torch.device) -> None:
        """Start measuring (a publisher on `device`); pair with `disable`."""
        self._users += 1
        self.enabled = True
        self.cuda = device.type == "cuda"

    def disable(self) -> None:
        """Stop measuring when the last publisher that enabled the clock closes."""
        self._users = max(0, self._users - 1)
        if self._users == 0:
            self.enabled = False
            self.take()

    def begin(self, phase: int) -> Token:
        """Start a span of `phase`; pass the result to `end`."""
        if not self.enabled:
            return None
        if self.cuda and phase in _EVENT_TIMED:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def end(self, phase: int, token: Token) -> None:
        """End the span `token` of `phase` began (no-op when it began with the clock off)."""
        if token is None or not self.enabled:
            return
        if isinstance(token, float):
            self.add(phase, time.perf_counter() - token)
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._events.append((phase, token, event))

    def add(self, phase: int, seconds: float) -> None:
        """Add wall time to `phase` (for spans measured elsewhere)."""
        if self.enabled:
            current = self._seconds[phase]
            self._seconds[phase] = seconds if current is None else current + seconds

    def add_events(self, phase: int, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        """Add a CUDA event pair recorded elsewhere (offload's copy stream)."""
        if self.enabled:
            self._events.append((phase, start, end))

    def take(self) -> StepPhases:
        """This step's times so far, and start the next step from zero."""
        out = StepPhases(self._seconds, self._events)
        self._seconds = [None] * len(PHASES)
        self._events = []
        return out


_CLOCK = PhaseClock()


def phase_clock() -> PhaseClock:
    """This process's phase clock ([Note: one phase clock])."""
    return _CLOCK


class _TimedIterator(Iterator[T]):
    def __init__(self, it: Iterator[T], clock: PhaseClock) -> None:
        self._it = it
        self._clock = clock

    def __next__(self) -> T:
        clock = self._clock
        if not clock.enabled:
            return next(self._it)
        started = time.perf_counter()
        try:
            return next(self._it)
        finally:  # the wait that ended the epoch (StopIteration) is data wait too
            clock.add(DATA_WAIT, time.perf_counter() - started)


def next_batch(data_iter: Iterator[T]) -> T:
    """`next(data_iter)`, its wait counted as data wait (unless `data_iter` came from a
    `timed_loader`, which counts it already): `Engine.train_batch` reads batches so."""
    if type(data_iter) is _TimedIterator or not _CLOCK.enabled:
        return next(data_iter)
    started = time.perf_counter()
    try:
        return next(data_iter)
    finally:
        _CLOCK.add(DATA_WAIT, time.perf_counter() - started)


class timed_loader(Iterable[T]):  # noqa: N801 (a function-like wrapper, named as one)
    """Wrap a data loader (any iterable) so the time spent waiting for each batch is this
    step's `data_wait_s` in the telemetry records (nothing is measured without telemetry).

    Every `iter()` of the wrapper iterates the wrapped loader afresh, so epochs work as
    with the loader itself; `len()` is the loader's.

    Args:
        loader: a torch DataLoader or any iterable of batches.

    Example::

        for x, y in fsdpx.telemetry.timed_loader(loader):
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
    """

    def __init__(self, loader: Iterable[T]) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[T]:
        return _TimedIterator(iter(self.loader), _CLOCK)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # The loader's own attributes (sampler, batch_size, dataset) stay reachable.
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)
