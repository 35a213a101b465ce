"""Find the checkpoint a path means: a tag directory itself, or a root whose `latest`
file names the tag (`<root>/<tag>/` with `<root>/latest` = "<tag>\\n")."""

from __future__ import annotations

import os
from pathlib import Path

from checkpoint_tools.format import MANIFEST_NAME, CheckpointFormatError, CheckpointNotFoundError
from checkpoint_tools.format.files import open_inside

LATEST = "latest"
_MAX_LATEST_BYTES = 4096


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """Return the checkpoint directory `path` refers to.

    Args:
        path: a checkpoint directory (holds MANIFEST) or a root holding `latest`.

    Returns:
        The tag directory (it may still fail validation when opened).

    Raises:
        CheckpointNotFoundError: nothing there, or a root without `latest` (the message
            lists the committed tags found), or `latest` naming a missing directory.
        CheckpointFormatError: `latest` does not hold a plain directory name.

    Example::

        resolve_checkpoint("ckpt")             # -> ckpt/global_step100 (from ckpt/latest)
        resolve_checkpoint("ckpt/global_step50")
    """
    p = Path(path)
    if not p.is_dir():
        raise CheckpointNotFoundError("no such checkpoint directory", path=p)
    if (p / MANIFEST_NAME).exists():
        return p
    latest = p / LATEST
    if not os.path.lexists(latest):
        tags = sorted(d.name for d in p.iterdir() if (d / MANIFEST_NAME).is_file())
        hint = (
            f"committed checkpoints here: {', '.join(tags)}"
            if tags
            else "no committed checkpoint here"
        )
        raise CheckpointNotFoundError(
            f"neither a checkpoint (no {MANIFEST_NAME}) nor a checkpoint root (no {LATEST} "
            f"file); {hint}. Pass a tag directory explicitly",
            path=p,
        )
    with open_inside(p, LATEST) as f:  # no symlinks, no FIFOs, a bounded read
        raw = f.read(_MAX_LATEST_BYTES + 1)
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = ""
    bad = (
        not tag
        or len(raw) > _MAX_LATEST_BYTES
        or tag in (".", "..")
        or any(c in tag for c in "/\\\0\n")
    )
    if bad:
        raise CheckpointFormatError(
            f"{LATEST} must hold one plain directory name; found {raw[:80]!r}", path=latest
        )
    target = p / tag
    if not target.is_dir():
        raise CheckpointNotFoundError(
            f"{LATEST} names {tag!r}, which does not exist (deleted?); pass an existing tag "
            "directory explicitly",
            path=target,
        )
    return target
