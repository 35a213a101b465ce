"""Which peer ranks' processes are gone: the evidence that lets a surviving rank name a
peer that was killed without a word (see [Note: rank failure] in fsdpx/distributed.py).

[Note: vanished ranks]
A rank killed outright (SIGKILL, the OOM killer, os._exit) records no error, and gloo's
message on its peers names only a socket address. At start-up (`init_distributed`) every
rank therefore appends "rank,pid,start;" to one store key per process namespace: the
kernel's boot id plus the inode of /proc/self/ns/pid (plus the user id), so two ranks
share a key exactly when they can see each other's pids (same host, same container). `start` is the process
start time from /proc/<pid>/stat, so a pid the kernel has since reused for another
process is not taken for the rank.

When a collective fails and nobody recorded an error, a rank reads its own namespace's
key and looks each peer up in /proc: a peer whose process no longer exists, is a zombie
or has another start time has ended. That is evidence of an end, not an inference from
silence: a rank that is slow, stopped in a debugger or swapping still exists and is never
named, however long it has been quiet. Heartbeat ages were rejected for that reason (a
loaded host delays a heartbeat as much as a hang does). The check is repeated for a
bounded time (`VANISH_WAIT_S`) because a killed process closes its sockets a moment
before the kernel marks it a zombie, and the survivor can see the reset in between.

A process that has ended is evidence only when its end is unexplained: a survivor that
raised RankFailureError (its collective failed because of a peer, or timed out on a
stalled one) ends too, moments later. Before raising, every such rank appends its rank
to one job-wide key (`mark_stopped`), and a peer listed there is never named as having
vanished; without that, a healthy rank that timed out first on a stalled-but-alive peer
and exited would be blamed by the survivors still looking (found in review).

Ranks in another namespace (other nodes) cannot be checked this way; a survivor there
waits, bounded, for a same-node survivor of the dead rank to record what it found (see
fsdpx/distributed.py). Without /proc (macOS) nothing is announced and nothing is named.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist

_PREFIX = "fsdpx/ranks_in/"
_STOPPED_KEY = "fsdpx/ranks_stopped"
VANISH_WAIT_S = 5.0
"""Longest time a survivor keeps looking for an ended peer process (see the note)."""
_POLL_S = 0.02


@dataclass(frozen=True)
class RankProcess:
    """One rank's process as announced in the store."""

    rank: int
    pid: int
    start: int
    """Start time of the process in clock ticks since boot (/proc/<pid>/stat field 22)."""


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) of a process, or None when there is no such process.

    Raises OSError or ValueError when /proc cannot tell (no /proc, no permission, an
    unexpected format): that is no evidence either way.
    """
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # the latter: it exited mid-read
        return None
    # Fields after the parenthesised command name (which may hold spaces or parentheses):
    # field 3 (state) is the first, field 22 (starttime) the 20th.
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[19])


def _namespace_key() -> str | None:
    """The store key shared by the ranks that can see this process's pids, or None
    without /proc."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    # The user too: /proc mounted with hidepid=2 hides other users' processes, which
    # would then look gone.
    ident = f"{boot}:{pid_ns}:{os.getuid()}"
    return _PREFIX + hashlib.sha256(ident.encode()).hexdigest()[:16]


def announce(store: dist.Store, rank: int) -> None:
    """Add this process to its namespace's list in the store (once per process group).

    Args:
        store: the default group's store.
        rank: this process's rank in the default group.
    """
    key = _namespace_key()
    try:
        stat = _proc_stat(os.getpid())
    except (OSError, ValueError, IndexError):
        stat = None
    if key is None or stat is None:
        return
    # Store.append (atomic on TCPStore, FileStore, HashStore and PrefixStore) is missing
    # from torch's type stubs.
    cast(Any, store).append(key, f"{rank},{os.getpid()},{stat[1]};")


def mark_stopped(store: dist.Store, rank: int) -> None:
    """Say that this rank is about to end for a reason it reported (see the note), so its
    ended process is not taken for a rank that vanished."""
    cast(Any, store).append(_STOPPED_KEY, f"{rank};")


def stopped(store: dist.Store) -> set[int]:
    """The ranks that said they were ending (mark_stopped)."""
    if not store.check([_STOPPED_KEY]):
        return set()
    text = store.get(_STOPPED_KEY).decode(errors="replace")
    return {int(r) for r in text.split(";") if r.isdigit()}


def is_gone(proc: RankProcess) -> bool:
    """Whether the announced process has ended (gone, a zombie, or its pid reused)."""
    try:
        stat = _proc_stat(proc.pid)
    except (OSError, ValueError, IndexError):
        return False  # /proc cannot tell: never name a rank without evidence
    return stat is None or stat[0] in ("Z", "X", "x") or stat[1] != proc.start


def neighbours(store: dist.Store, rank: int, world_size: int) -> list[RankProcess]:
    """The other ranks of this process's namespace, as announced (the latest entry per rank)."""
    key = _namespace_key()
    if key is None or not store.check([key]):
        return []
    found: dict[int, RankProcess] = {}
    for entry in store.get(key).decode(errors="replace").split(";"):
        parts = entry.split(",")
        if len(parts) == 3 and all(p.isdigit() for p in parts):
            r, pid, start = map(int, parts)
            if r != rank and r < world_size:
                found[r] = RankProcess(r, pid, start)
    return sorted(found.values(), key=lambda p: p.rank)


def vanished(
    peers: list[RankProcess],
    wait_s: float = VANISH_WAIT_S,
    *,
    explained: Callable[[], set[int]] = set,
) -> list[RankProcess]:
    """The peers whose processes have ended unexplained, looking again for up to wait_s
    while none has.

    Args:
        peers: the processes to check (neighbours()).
        wait_s: how long to keep looking while none has ended.
        explained: ranks whose end is explained (stopped()), read after a process is
            seen gone, so a mark made just before that process exited is seen.
    Returns:
        As soon as one has ended unexplained, all that have by then; [] after wait_s.
    """
    deadline = time.monotonic() + wait_s
    while True:
        gone = [p for p in peers if is_gone(p)]
        if gone:
            skip = explained()
            gone = [p for p in gone if p.rank not in skip]
        if gone or not peers or time.monotonic() >= deadline:
            return gone
        time.sleep(_POLL_S)


def describe(gone: list[RankProcess]) -> str:
    """'rank 1 (pid 4242 on host h)' or 'ranks 1, 2 (pids 4242, 4243 on host h)'."""
    host = socket.gethostname()
    if len(gone) == 1:
        return f"rank {gone[0].rank} (pid {gone[0].pid} on host {host})"
    ranks = ", ".join(str(p.rank) for p in gone)
    pids = ", ".join(str(p.pid) for p in gone)
    return f"ranks {ranks} (pids {pids} on host {host})"
