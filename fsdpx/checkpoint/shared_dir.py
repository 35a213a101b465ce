"""Is the checkpoint directory one directory for every rank?

[Note: shared checkpoint directory] The commit ([Note: atomic commit]) assumes every rank
writes into the same file system: rank 0 writes the MANIFEST and renames the directory
that all ranks filled. On several machines with a node-local path (a local disk mounted
at the same path everywhere) each node would fill its own copy, rank 0 would commit a
checkpoint missing the other nodes' files, and the loss would show only at load time.
So every save checks first: rank 0 writes a marker named by the save's nonce into the
root *before* it broadcasts the nonce; every rank looks for it once the nonce arrives,
and says in the vote whether it saw it (and its host). A rank that does not see it writes
nothing, and every rank raises the same error naming the ranks and hosts that do not
share rank 0's directory. The marker costs one small file per save and no extra
collective (it rides on the nonce broadcast and the vote). Network file systems can hide
a new file from another client for a moment (a cached negative lookup): a rank that
does not see the marker looks again a few times over about a second before it says so.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

MARKER_PREFIX = ".fsdpx-shared-"
LOOKS = 10
LOOK_INTERVAL_S = 0.1


def marker(root: Path, nonce: str) -> Path:
    return root / f"{MARKER_PREFIX}{nonce}"


def write_marker(root: Path, nonce: str) -> None:
    """Rank 0, before the nonce goes out: the root exists and holds the marker."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(marker(root, nonce), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, socket.gethostname().encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def sees_marker(root: Path, nonce: str) -> bool:
    path = marker(root, nonce)
    for _ in range(LOOKS):
        if path.exists():
            return True
        time.sleep(LOOK_INTERVAL_S)  # see the Note: NFS negative lookup caching
    return False


def remove_marker(root: Path, nonce: str) -> None:
    marker(root, nonce).unlink(missing_ok=True)


def where() -> str:
    """This rank's host as the launcher named it (fsdpx launch), else the hostname."""
    return os.environ.get("FSDPX_NODE_HOST") or socket.gethostname()


def unshared_message(root: Path, reports: list[dict[str, Any]]) -> str | None:
    """The error when some ranks do not see rank 0's marker; None when all do."""
    missing = [(r, rep.get("host", "?")) for r, rep in enumerate(reports) if not rep["shared"]]
    if not missing:
        return None
    hosts = sorted({h for _, h in missing})
    ranks = ", ".join(str(r) for r, _ in missing)
    return (
        f"the checkpoint directory {str(root)!r} is not shared by every rank: rank(s) {ranks} "
        f"(on {', '.join(hosts)}) do not see the files rank 0 (on {reports[0].get('host', '?')}) "
        "writes there, so no rank wrote anything and nothing was committed. Save to a "
        "directory on a file system every node mounts (NFS, Lustre, a cloud bucket mount), "
        "the same path on every rank."
    )
