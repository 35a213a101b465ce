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
- h2d: offload's copy stream (fsdpx/offload/copies.py), on an accelerator only;
- the comm wait inside forward / backward / optimizer: the clock itself, from which of
  those spans was open when the wait was timed ([Note: comm wait by phase]).

[Note: phase spans]
Data wait, forward, backward and optimizer are disjoint spans of the training thread; comm
wait and h2d are measured inside them (a collective inside the optimizer step counts in
both), so they are never added to the others. On CPU a span is wall time. On CUDA the
compute spans (forward, backward, optimizer, comm wait, h2d) are CUDA event pairs, because
the host's wall time of a kernel launch says nothing about the kernel: the publisher reads
`elapsed_time` on its sender thread once the step's events have completed (the same
one-step-late path as the loss, [Note: publishing never blocks training]). Data wait is
host time on every device: it is the host waiting for the loader.

[Note: comm wait by phase]
Under FSDP / ZeRO-3 a rank that waits for a slow peer waits inside its own forward (the
all-gathers) or backward (re-gathers, reduce-scatters), so its forward time rises to the
slow rank's and the monitor, comparing forward times, cannot tell the rank that made the
others wait from the ranks that waited. What tells them apart is where each rank's comm
wait happened: so every comm wait the clock times is also added to the comm wait of the
span open at that moment (`comm_wait_forward_s`, `comm_wait_backward_s`,
`comm_wait_optimizer_s`; `COMM_SPLIT`), and the monitor scores forward and backward by
their compute time, the phase minus the wait inside it (monitor/stragglers.py [Note:
straggler scoring]). The open span is one int the engine's `begin` / `end` of forward,
backward and optimizer set and clear (the three are disjoint), read by the same `add`
/ `end` / `add_events` call that times the wait: a comparison and one more addition per
wait, no lookup on the training thread beyond a tuple index. On CUDA the wait's event
pair is kept twice (once per field) and read on the sender thread. A split field is 0.0
when its span ran with no wait in it and nil when the span was not timed at all (no
engine: a user's own loop, or pipeline parallelism's forward and backward), so a reader
knows which records carry the split. Waits outside the three spans (none in the
engine's loop; a user's own collectives between steps) count in `comm_wait_s` only.

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
COMM_SPLIT: tuple[int, ...] = (FORWARD, BACKWARD, OPTIMIZER)
"""The spans whose comm wait is also kept on its own, record field
`f"comm_wait_{PHASES[p]}_s"` ([Note: comm wait by phase])."""
_SPLIT_OF = tuple(COMM_SPLIT.index(p) if p in COMM_SPLIT else -1 for p in range(len(PHASES)))
"""Per phase: its index in COMM_SPLIT, -1 for the others (a tuple index, not a lookup)."""
_SLOT0 = len(PHASES)
"""An event pair's slot: a phase index, or `_SLOT0 + i` for the wait inside COMM_SPLIT[i]."""

T = TypeVar("T")
Token = float | torch.cuda.Event | None
"""What `begin` returns and `end` takes: a perf_counter value, a CUDA event, or None
(the clock is off)."""


@dataclass
class StepPhases:
    """One step's phase times as taken from the clock (resolved on the sender thread).

    `seconds[i]` is the wall time summed for phase i, None where nothing measured it;
    `events` are (slot, start, end) CUDA event pairs still to be read (slot: a phase, or
    len(PHASES) + i for the comm wait inside COMM_SPLIT[i]); `comm_in[i]` is the wall
    time of the comm waits inside COMM_SPLIT[i] ([Note: comm wait by phase]).
    """

    seconds: list[float | None]
    events: list[tuple[int, torch.cuda.Event, torch.cuda.Event]]
    comm_in: list[float | None]

    @property
    def last_event(self) -> torch.cuda.Event | None:
        """The event recorded last: once it completed, every pair can be read."""
        return self.events[-1][2] if self.events else None

    def seconds_per_phase(self) -> list[float | None]:
        """Seconds per phase (PHASES order), then the comm wait inside each COMM_SPLIT
        span, the CUDA pairs added in (call once `last_event` completed): the values of
        the record fields PHASE_FIELDS + COMM_SPLIT_FIELDS, in that order."""
        out = [*self.seconds, *self.comm_in]
        for slot, start, end in self.events:
            out[slot] = (out[slot] or 0.0) + start.elapsed_time(end) / 1000.0
        for i, phase in enumerate(COMM_SPLIT):
            if out[phase] is not None and out[_SLOT0 + i] is None:
                out[_SLOT0 + i] = 0.0  # the span ran and nothing waited in it
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
        self._comm_in: list[float | None] = [None] * len(COMM_SPLIT)
        self._open = -1
        """The COMM_SPLIT index of the span open now, -1: none ([Note: comm wait by phase])."""

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
        split = _SPLIT_OF[phase]
        if split >= 0:
            self._open = split
        if self.cuda and phase in _EVENT_TIMED:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def end(self, phase: int, token: Token) -> None:
        """End the span `token` of `phase` began (no-op when it began with the clock off)."""
        if _SPLIT_OF[phase] >= 0:
            self._open = -1
        if token is None or not self.enabled:
            return
        if isinstance(token, float):
            self.add(phase, time.perf_counter() - token)
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._events.append((phase, token, event))
        if phase == COMM_WAIT and self._open >= 0:
            self._events.append((_SLOT0 + self._open, token, event))

    def span(self, phase: int) -> Span:
        """`with clock.span(FORWARD): ...`: begin, and end when the block ends; a block a
        raise ends is closed untimed ([Note: spans closed on a raise])."""
        return Span(self, phase)

    def add(self, phase: int, seconds: float) -> None:
        """Add wall time to `phase` (for spans measured elsewhere); a comm wait also to
        the span open now ([Note: comm wait by phase])."""
        if self.enabled:
            current = self._seconds[phase]
            self._seconds[phase] = seconds if current is None else current + seconds
            if phase == COMM_WAIT and self._open >= 0:
                current = self._comm_in[self._open]
                self._comm_in[self._open] = seconds if current is None else current + seconds

    def add_events(self, phase: int, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        """Add a CUDA event pair recorded elsewhere (offload's copy stream, FSDP's waits);
        a comm wait's also to the span open now ([Note: comm wait by phase])."""
        if self.enabled:
            self._events.append((phase, start, end))
            if phase == COMM_WAIT and self._open >= 0:
                self._events.append((_SLOT0 + self._open, start, end))

    def take(self) -> StepPhases:
        """This step's times so far, and start the next step from zero."""
        out = StepPhases(self._seconds, self._events, self._comm_in)
        self._seconds = [None] * len(PHASES)
        self._events = []
        self._comm_in = [None] * len(COMM_SPLIT)
        self._open = -1  # (a span a raise left open: the next step's waits are not its)
        return out


class Span:
    """One span of a phase as a context manager (`PhaseClock.span`).

    [Note: spans closed on a raise] A span a raise left open would claim every comm wait
    timed later in the step ([Note: comm wait by phase]) until the publisher's take(). It
    is closed untimed (token None): recording a CUDA event after a CUDA error would raise
    again and hide the error.
    """

    __slots__ = ("_clock", "_phase", "_token")

    def __init__(self, clock: PhaseClock, phase: int) -> None:
        self._clock = clock
        self._phase = phase
        self._token: Token = None

    def __enter__(self) -> None:
        self._token = self._clock.begin(self._phase)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._clock.end(self._phase, self._token if exc_type is None else None)


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
