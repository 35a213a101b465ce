"""Hang diagnosis from the ranks' dumps: which rank is inside which collective, and which
rank never arrived at it (monitor/PROTOCOL.md "Hang dumps"). Pure Python, no Textual.

[Note: who never arrived]
Every rank numbers the collectives it issues through fsdpx.comm from 0, in program order,
and the same program issues them in the same order on every rank of a group; a dump says
how many a rank entered and how many returned. A rank blocked in a collective entered
seq S = `completed` and has not returned from it. The furthest such S is the collective
the job is stuck in; a rank that entered no more than S collectives (`entered <= S`)
never arrived at it, and its own stack says where it is instead. FSDP2's own collectives
are not numbered (they do not go through fsdpx.comm yet): a hang inside one shows in the
stacks, not in this verdict.

Example::

    book = DumpBook()
    book.add(dump)                           # each rank's answer, as it arrives
    report = book.report()                   # the newest request's verdict
    report.never_arrived                     # e.g. [1]
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

MAX_REQUESTS = 8
"""Dump requests kept (the newest first shown)."""


@dataclass(frozen=True)
class RankDiagnosis:
    """One rank in a hang report."""

    rank: int
    host: Any
    step: Any
    """Its last finished optimizer step (per its dump)."""
    inside: tuple[int, str] | None
    """(seq, kind) of the collective it is blocked in; None: not inside one."""
    entered: int | None
    where: str
    """The innermost frame of its main thread: 'file:line in function'."""
    stack: str
    """Its main thread's stack, formatted."""


@dataclass(frozen=True)
class HangReport:
    """The verdict over one request's dumps ([Note: who never arrived])."""

    request_id: str | None
    ranks: list[RankDiagnosis]
    stuck_in: tuple[int, str] | None
    """The furthest collective a rank is blocked in, (seq, kind)."""
    never_arrived: list[int]
    """Ranks that answered and have not entered `stuck_in`."""
    no_answer: list[int]
    """Expected ranks whose dump has not come."""

    def lines(self) -> list[str]:
        """The report as text: the verdict first, then one line per rank."""
        out = []
        if self.stuck_in is not None:
            seq, kind = self.stuck_in
            late = ", ".join(map(str, self.never_arrived)) or "none"
            out.append(f"stuck in {kind} #{seq}; never arrived: rank {late}")
        else:
            out.append("no rank is inside an fsdpx collective")
        if self.no_answer:
            out.append("no dump yet from rank " + ", ".join(map(str, self.no_answer)))
        for d in self.ranks:
            state = (
                f"inside {d.inside[1]} #{d.inside[0]}"
                if d.inside is not None
                else "never arrived"
                if d.rank in self.never_arrived
                else "not in a collective"
            )
            out.append(f"rank {d.rank} ({d.host}, step {d.step}): {state}  at {d.where}")
        return out


def _inside(collectives: Any) -> tuple[tuple[int, str] | None, int | None]:
    if type(collectives) is not dict:
        return None, None
    entered, completed = collectives.get("entered"), collectives.get("completed")
    if type(entered) is not int or type(completed) is not int:
        return None, None
    if entered <= completed:
        return None, entered
    kind = "?"
    for item in collectives.get("last") or []:
        if type(item) is dict and item.get("seq") == completed:
            kind = str(item.get("kind"))
    return (completed, kind), entered


def _main_stack(threads: Any) -> str:
    if type(threads) is not list:
        return ""
    for t in threads:
        if type(t) is dict and t.get("main") is True and type(t.get("stack")) is str:
            return t["stack"]
    return ""


def _innermost(stack: str) -> str:
    """'file.py:12 in fn' of the last frame of a traceback.format_stack text."""
    for line in reversed(stack.splitlines()):
        line = line.strip()
        if line.startswith('File "'):
            # File "/x/y.py", line 12, in fn
            try:
                path, rest = line[6:].split('", line ', 1)
                number, fn = rest.split(", in ", 1)
            except ValueError:
                return line
            return f"{path.rsplit('/', 1)[-1]}:{number} in {fn}"
    return "?"


def diagnose(
    dumps: dict[int, dict[str, Any]], expected: Iterable[int] = (), request_id: str | None = None
) -> HangReport:
    """The verdict over the dumps of one request ([Note: who never arrived])."""
    ranks = []
    for rank in sorted(dumps):
        dump = dumps[rank]
        inside, entered = _inside(dump.get("collectives"))
        stack = _main_stack(dump.get("threads"))
        ranks.append(
            RankDiagnosis(
                rank, dump.get("host"), dump.get("step"), inside, entered, _innermost(stack), stack
            )
        )
    blocked = [d.inside for d in ranks if d.inside is not None]
    stuck = max(blocked) if blocked else None
    never = []
    if stuck is not None:
        never = [d.rank for d in ranks if d.entered is not None and d.entered <= stuck[0]]
    missing = sorted(set(expected) - set(dumps))
    return HangReport(request_id, ranks, stuck, never, missing)


@dataclass
class DumpBook:
    """The dumps of the last MAX_REQUESTS requests, by request id and rank."""

    requests: OrderedDict[str, dict[int, dict[str, Any]]] = field(default_factory=OrderedDict)

    def start(self, request_id: str) -> None:
        """A request went out: its (so far empty) set of answers becomes the newest."""
        self.requests[request_id] = {}
        while len(self.requests) > MAX_REQUESTS:
            self.requests.popitem(last=False)

    def add(self, dump: Any) -> bool:
        """Store one rank's dump; False for a malformed one (not a map with an int rank
        and a str request_id)."""
        if type(dump) is not dict:
            return False
        rank, rid = dump.get("rank"), dump.get("request_id")
        if type(rank) is not int or type(rid) is not str:
            return False
        if rid not in self.requests:
            self.start(rid)  # another monitor's request, or a replayed log
        self.requests[rid][rank] = dump
        return True

    @property
    def latest(self) -> str | None:
        return next(reversed(self.requests), None)

    def report(self, request_id: str | None = None, expected: Iterable[int] = ()) -> HangReport:
        """The verdict over one request's answers (default: the newest request)."""
        rid = request_id if request_id is not None else self.latest
        return diagnose(self.requests.get(rid or "", {}), expected, rid)
