"""Counted collectives: thin wrappers over torch.distributed that record each call.

Byte formulas (what *this rank sends* on the wire for one call, ``W`` = group size,
``B`` = the byte size of the tensor named), following the standard ring / pairwise
algorithms gloo and NCCL use:

| kind               | bytes this rank sends        |
|--------------------|------------------------------|
| all_reduce         | 2 * (W - 1) / W * B(tensor)  |
| all_to_all_single  | (W - 1) / W * B(input)       |
| (uneven splits)    | B(input) - B(own split)      |
| all_gather_single  | (W - 1) * B(input)           |
| reduce_scatter     | (W - 1) / W * B(input)       |

(all-reduce = reduce-scatter + all-gather of 1/W pieces; all-to-all keeps its own 1/W
piece; all-gather forwards W - 1 pieces of the input's size; reduce-scatter is the first
half of a ring all-reduce.) Integer division rounds down;
a one-rank group sends nothing.

[Note: one comm log] The log is process-wide (`comm_log()`), like torch's own default
group: the collectives that make up one operation (a compressed all-reduce issues four) are
recorded where they are issued, so a reader can sum any window of sequence numbers. A
caller that wants per-step figures takes `mark()` before and `bytes_since(mark)` after, or
diffs two `totals()` (cumulative bytes per kind, what telemetry records read). Only the
last `KEEP_RECORDS` records are kept (a long run issues millions); the totals are exact
over the whole process.

The blocking calls here are also timed as exposed communication (`comm_wait_s` of the
telemetry record, fsdpx/telemetry/phases.py [Note: phase spans]): they return when the
collective is done, so the time inside them is time the training thread waited for it.
FSDP's own collectives (fsdpx/comm/fsdp_slot.py) may be asynchronous: they are counted,
and marked done once issued; the slot times their waits itself ([Note: timing FSDP's
waits] there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from fsdpx.telemetry.phases import COMM_WAIT, phase_clock

Kind = Literal["all_reduce", "all_to_all_single", "all_gather_single", "reduce_scatter"]
KINDS: tuple[Kind, ...] = ("all_reduce", "all_to_all_single", "all_gather_single", "reduce_scatter")
KEEP_RECORDS = 100_000

# [Note: torch 2.11 collective names] `all_gather_single` / `reduce_scatter_single` are
# torch 2.13's names. The GPU machines fsdpx's CUDA tests run on have torch 2.11, where the
# same collectives are `all_gather_into_tensor` / `reduce_scatter_tensor` (2.13 keeps those
# as deprecated aliases of the new ones): use the old names only where the new are absent.
# Looked up at each call, not bound at import, so a test can spy on `dist.<name>`.


def _all_gather_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None
) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input, group=group)


def _reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp.RedOpType,
    group: dist.ProcessGroup | None,
) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input, op=op, group=group)


@dataclass(frozen=True)
class CommRecord:
    """One collective call."""

    kind: Kind
    seq: int
    """Position in this process's log, from 0."""
    bytes_sent: int
    """Bytes this rank sends (the module docstring's formula for `kind`)."""
    group_size: int


@dataclass
class CommLog:
    """The collectives this process issued through fsdpx.comm, in order."""

    _kept: list[CommRecord] = field(default_factory=list)
    _next_seq: int = 0
    _totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    completed: int = 0
    """Calls that returned: a call with seq >= completed was entered and has not returned
    (the hang dump's "inside which collective", fsdpx/telemetry/dump.py)."""

    def add(self, kind: Kind, bytes_sent: int, group_size: int) -> None:
        self._kept.append(CommRecord(kind, self._next_seq, bytes_sent, group_size))
        self._next_seq += 1
        self._totals[kind] += bytes_sent
        if len(self._kept) > 2 * KEEP_RECORDS:
            del self._kept[:-KEEP_RECORDS]

    def done(self) -> None:
        """The call entered last returned (calls are blocking: they return in order)."""
        self.completed = self._next_seq

    @property
    def records(self) -> list[CommRecord]:
        """The kept records (the last KEEP_RECORDS or more), oldest first."""
        return self._kept

    def mark(self) -> int:
        """The next sequence number (pass it to `since` / `bytes_since`)."""
        return self._next_seq

    def since(self, mark: int) -> list[CommRecord]:
        """The records with seq >= `mark`; an error if some of them were dropped."""
        first = self._kept[0].seq if self._kept else self._next_seq
        if mark < first:
            raise ValueError(
                f"comm log records from seq {mark} were dropped (kept from {first}); read "
                "totals() for long windows"
            )
        return self._kept[mark - first :]

    def bytes_since(self, mark: int) -> int:
        """Bytes sent by the calls with seq >= `mark`."""
        return sum(r.bytes_sent for r in self.since(mark))

    def kinds_since(self, mark: int) -> list[Kind]:
        return [r.kind for r in self.since(mark)]

    def totals(self) -> dict[str, int]:
        """Cumulative bytes sent per kind since the process started (a copy)."""
        return dict(self._totals)


_LOG = CommLog()
_CLOCK = phase_clock()


def comm_log() -> CommLog:
    """This process's log ([Note: one comm log])."""
    return _LOG


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """In-place sum all-reduce of `tensor` over `group`, counted."""
    w = _size(group)
    _LOG.add("all_reduce", 2 * (w - 1) * _nbytes(tensor) // w, w)
    token = _CLOCK.begin(COMM_WAIT)
    dist.all_reduce(tensor, group=group)
    _CLOCK.end(COMM_WAIT, token)
    _LOG.done()


def all_to_all_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None
) -> None:
    """Rank r's i-th 1/W piece of `input` lands in rank i's r-th piece of `output`, counted."""
    w = _size(group)
    _LOG.add("all_to_all_single", (w - 1) * _nbytes(input) // w, w)
    token = _CLOCK.begin(COMM_WAIT)
    dist.all_to_all_single(output, input, group=group)
    _CLOCK.end(COMM_WAIT, token)
    _LOG.done()


def all_to_all_uneven(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup,
) -> None:
    """all_to_all_single with uneven splits (rows along dim 0), counted as kind
    all_to_all_single: the bytes of every split but this rank's own (which stays here).
    Expert parallelism's token dispatch (fsdpx/moe/dispatch.py) uses it."""
    w = _size(group)
    row = _nbytes(input) // input.shape[0] if input.shape[0] else 0
    own = input_splits[dist.get_rank(group)] if input_splits else 0
    _LOG.add("all_to_all_single", (input.shape[0] - own) * row, w)
    token = _CLOCK.begin(COMM_WAIT)
    dist.all_to_all_single(output, input, output_splits, input_splits, group=group)
    _CLOCK.end(COMM_WAIT, token)
    _LOG.done()


def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None
) -> None:
    """`output` = every rank's `input`, concatenated in rank order, counted."""
    w = _size(group)
    _LOG.add("all_gather_single", (w - 1) * _nbytes(input), w)
    token = _CLOCK.begin(COMM_WAIT)
    _all_gather_single(output, input, group=group)
    _CLOCK.end(COMM_WAIT, token)
    _LOG.done()


def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> None:
    """`output` = this rank's 1/W piece of the reduction of every rank's `input`, counted."""
    w = _size(group)
    _LOG.add("reduce_scatter", (w - 1) * _nbytes(input) // w, w)
    token = _CLOCK.begin(COMM_WAIT)
    _reduce_scatter_single(output, input, op=op, group=group)
    _CLOCK.end(COMM_WAIT, token)
    _LOG.done()
