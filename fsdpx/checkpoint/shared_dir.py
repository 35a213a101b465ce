"""Is the checkpoint directory one directory for every rank?

[Note: shared checkpoint directory] The commit ([Note: atomic commit]) assumes every rank
writes into the same file system: rank 0 writes the MANIFEST and renames the directory
that all ranks filled. On several machines with a node-local path (a local disk mounted
at the same path everywhere) each node would fill its own copy, rank 0 would commit a
checkpoint missing the other nodes' files, and the loss would show only at load time.
So every save checks first: rank 0 makes the save's temp directory (named by the save's
nonce) *before* it broadcasts the nonce; every rank looks for that directory once the
nonce arrives, and says in the vote whether it saw it (and its host). A rank that does
not see it writes nothing, and every rank raises the same error naming the ranks and
hosts that do not share rank 0's directory. This costs no file and no collective (it
rides on the nonce broadcast and the vote), and a kill leaves nothing new behind: the
temp directory is what the commit renames, removes on failure, or the next save cleans
up. Network file systems can hide a new entry from another client for a moment (a
cached negative lookup): a rank that does not see it looks again a few times over about
a second before it says so.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

LOOKS = 10
LOOK_INTERVAL_S = 0.1


def announce(temp: Path) -> None:
    """Rank 0, before the nonce goes out: the save's temp directory exists."""
    temp.mkdir(parents=True, exist_ok=True)


def sees(temp: Path) -> bool:
    """Whether this rank sees the temp directory rank 0 made for this save."""
    for _ in range(LOOKS):
        if temp.is_dir():
            return True
        time.sleep(LOOK_INTERVAL_S)  # see the Note: NFS negative lookup caching
    return False


def where() -> str:
    """This rank's host as the launcher named it (fsdpx launch), else the hostname."""
    return os.environ.get("FSDPX_NODE_HOST") or socket.gethostname()


def unshared_message(root: Path, reports: list[dict[str, Any]]) -> str | None:
    """The error when some ranks do not see rank 0's temp directory; None when all do."""
    missing = [(r, rep.get("host", "?")) for r, rep in enumerate(reports) if not rep["shared"]]
    if not missing:
        return None
    hosts = sorted({h for _, h in missing})
    ranks = ", ".join(str(r) for r, _ in missing)
    return (
        f"the checkpoint directory {str(root)!r} is not shared by every rank: rank(s) {ranks} "
        f"(on {', '.join(hosts)}) do not see the directory rank 0 (on "
        f"{reports[0].get('host', '?')}) made there for this save, so no rank wrote anything "
        "and nothing was committed. Save to a "
        "directory on a file system every node mounts (NFS, Lustre, a cloud bucket mount), "
        "the same path on every rank."
    )
