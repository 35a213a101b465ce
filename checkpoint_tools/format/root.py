"""The checkpoint root (FORMAT.md §2.1): tags, `latest`, what "committed" means, and the
durable-write steps (fsync of files and directories) every writer of the root uses.

This module is the one owner of these rules: the training runtime (`fsdpx/checkpoint/`)
and the offline tools (`checkpoint_tools`) both import them from here, so a `latest`
file or a tag is judged the same way whichever side reads it.

[Note: one owner of the checkpoint root]
A root is `<root>/<tag>/` directories plus an optional `<root>/latest` text file naming
one of them. The rules, stated once:

- A tag is one plain directory name: not empty, no `/`, `\\` or NUL, not starting with
  `.`, not `latest`, and without `.tmp-` (that marks the temporary directories and files
  of saves in progress, which readers never see as checkpoints).
- `latest` is read like every other checkpoint file: never through a symlink, only when
  it is a regular file (a FIFO is refused without blocking), at most 4096 bytes, UTF-8,
  and its content (surrounding whitespace stripped) must be a valid tag. Anything else is
  CheckpointFormatError: a damaged or planted `latest` is never "no checkpoint".
- `latest` is replaced atomically: a temp file `latest.tmp-<nonce>`, fsync, rename over
  `latest`, fsync of the root directory.
- A checkpoint is committed when `<root>/<tag>` is a directory with a valid tag as name
  that holds a MANIFEST which is a regular file (not a symlink: readers refuse those).
  Committed checkpoints are ordered by the MANIFEST's modification time (the commit
  time), then by name.
- A DeepSpeed checkpoint folder (its `latest` plus `global_stepN/*_states.pt`) is never
  mistaken for "no checkpoint here": both resolvers raise DeepSpeedCheckpointError.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path
from typing import IO, Any

from checkpoint_tools.format.deepspeed_folder import deepspeed_evidence, deepspeed_folder_error
from checkpoint_tools.format.errors import CheckpointFormatError, CheckpointNotFoundError
from checkpoint_tools.format.files import open_inside
from checkpoint_tools.format.layout import MANIFEST_NAME

LATEST = "latest"
TMP_MARK = ".tmp-"
MAX_LATEST_BYTES = 4096


# --- tags -------------------------------------------------------------------------------


def tag_problem(tag: object) -> str | None:
    """Why `tag` is not a valid checkpoint tag, or None when it is."""
    if not isinstance(tag, str) or not tag:
        return "a tag is a non-empty string"
    if any(c in tag for c in "/\\\0"):
        return "a tag is one directory name: no '/', '\\' or NUL"
    if tag.startswith("."):
        return "a tag must not start with '.' (this also rules out '.' and '..')"
    if tag == LATEST:
        return f"{LATEST!r} is the file naming the newest checkpoint"
    if TMP_MARK in tag:
        return f"{TMP_MARK!r} marks the temporary files of saves in progress"
    if any(ord(c) < 0x20 for c in tag):
        return "a tag must not hold control characters"
    return None


def check_tag(tag: str) -> str:
    """Return `tag` when it is a plain directory name under the root; else ValueError."""
    problem = tag_problem(tag)
    if problem is not None:
        raise ValueError(
            f"checkpoint tag must be a plain directory name (no '/', not starting with "
            f"'.', not {LATEST!r}, without {TMP_MARK!r}); got {tag!r}: {problem}"
        )
    return tag


# --- durable writes ---------------------------------------------------------------------


def fsync_file(f: IO[Any]) -> None:
    """Flush `f` and fsync it: its bytes are on disk when this returns."""
    f.flush()
    os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Fsync a directory, so that renames and new files in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_latest(root: Path, tag: str) -> None:
    """Atomically make `<root>/latest` name `tag`: temp file, fsync, rename, fsync dir."""
    check_tag(tag)
    tmp = root / f"{LATEST}{TMP_MARK}{secrets.token_hex(6)}"
    try:
        with open(tmp, "xb") as f:
            f.write(tag.encode("utf-8") + b"\n")
            fsync_file(f)
        os.replace(tmp, root / LATEST)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(root)


# --- reading the root -------------------------------------------------------------------


def read_latest(root: Path) -> str | None:
    """The tag `<root>/latest` names, or None when there is no `latest` entry.

    Raises:
        CheckpointFormatError: `latest` is a symlink, not a regular file, above
            MAX_LATEST_BYTES, not UTF-8, or does not hold a valid tag.
    """
    path = root / LATEST
    if not os.path.lexists(path):
        return None
    with open_inside(root, LATEST) as f:  # no symlinks, no FIFOs
        raw = f.read(MAX_LATEST_BYTES + 1)
    if len(raw) > MAX_LATEST_BYTES:
        raise CheckpointFormatError(
            f"{LATEST} must hold one plain directory name; it has more than "
            f"{MAX_LATEST_BYTES} bytes. Rewrite it with the tag of a committed checkpoint",
            path=path,
        )
    try:
        tag = raw.decode("utf-8").strip()
        problem = tag_problem(tag)
    except UnicodeDecodeError:
        tag, problem = "", "not UTF-8 text"
    if problem is not None:
        raise CheckpointFormatError(
            f"{LATEST} must hold one plain directory name (a checkpoint tag: {problem}); "
            f"found {raw[:80]!r}. Rewrite it with the tag of a committed checkpoint",
            path=path,
        )
    return tag


def is_committed(directory: Path) -> bool:
    """True when `directory` holds a MANIFEST that is a regular file (not a symlink)."""
    try:
        return stat.S_ISREG(os.lstat(directory / MANIFEST_NAME).st_mode)
    except OSError:
        return False


def committed(root: Path) -> list[Path]:
    """Committed checkpoints under `root`, oldest first by the MANIFEST's modification
    time (its commit time), then by name; [] when `root` is not a directory."""
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if tag_problem(d.name) is not None or not d.is_dir():
            continue
        with contextlib.suppress(OSError):
            manifest = os.lstat(d / MANIFEST_NAME)
            if stat.S_ISREG(manifest.st_mode):
                found.append((manifest.st_mtime_ns, d.name, d))
    return [d for _, _, d in sorted(found)]


# --- resolving --------------------------------------------------------------------------


def _refuse_deepspeed(path: Path) -> None:
    evidence = deepspeed_evidence(path)
    if evidence is not None:
        raise deepspeed_folder_error(path, evidence)


def resolve(root: str | os.PathLike[str], tag: str | None = None) -> Path:
    """The checkpoint directory `<root>/<tag>` (tag None: the one `<root>/latest` names).
    The runtime's resolver: `root` is always a checkpoint root.

    Raises:
        ValueError: `tag` is not a valid tag.
        CheckpointNotFoundError: no such root, no `latest` (tag None), or no such tag
            directory; the message lists the committed checkpoints found.
        CheckpointFormatError: a bad `latest` (see read_latest).
        DeepSpeedCheckpointError: `root` is a DeepSpeed checkpoint folder.

    Example::

        resolve("ckpts")                  # ckpts/global_step100 when latest says so
        resolve("ckpts", "global_step50")
    """
    root = Path(root)
    if not root.is_dir():
        raise CheckpointNotFoundError(
            f"checkpoint directory {str(root)!r} does not exist (or is not a directory)"
        )
    if tag is None:
        tag = read_latest(root)
        named = " (the one 'latest' names)"
        if tag is None:
            _refuse_deepspeed(root)
            raise CheckpointNotFoundError(
                f"no checkpoint to load: {str(root)!r} has no 'latest' file (written after "
                f"a checkpoint is committed). {_listing(root)}"
            )
    else:
        check_tag(tag)
        named = ""
    path = root / tag
    if not path.is_dir():
        raise CheckpointNotFoundError(
            f"checkpoint {str(path)!r}{named} does not exist. {_listing(root)}"
        )
    if not os.path.lexists(path / MANIFEST_NAME):
        _refuse_deepspeed(path)
    return path


def _listing(root: Path) -> str:
    found = [d.name for d in committed(root)]
    if found:
        return f"Committed checkpoints there: {found}; pass tag=<one of them> to load one."
    return "It holds no committed checkpoint either; check the path."


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """Return the checkpoint directory `path` refers to: `path` itself when it holds a
    MANIFEST, else the tag its `latest` file names. The offline tools' resolver.

    Args:
        path: a checkpoint directory (holds MANIFEST) or a root holding `latest`.

    Returns:
        The tag directory (it may still fail validation when opened).

    Raises:
        CheckpointNotFoundError: nothing there, or a root without `latest` (the message
            lists the committed tags found), or `latest` naming a missing directory.
        CheckpointFormatError: a bad `latest` (see read_latest).
        DeepSpeedCheckpointError: `path` is a DeepSpeed checkpoint folder.

    Example::

        resolve_checkpoint("ckpt")             # -> ckpt/global_step100 (from ckpt/latest)
        resolve_checkpoint("ckpt/global_step50")
    """
    p = Path(path)
    if not p.is_dir():
        raise CheckpointNotFoundError("no such checkpoint directory", path=p)
    if os.path.lexists(p / MANIFEST_NAME):  # the reader judges a bad MANIFEST precisely
        return p
    tag = read_latest(p)
    if tag is None:
        _refuse_deepspeed(p)
        tags = [d.name for d in committed(p)]
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
    target = p / tag
    if not target.is_dir():
        raise CheckpointNotFoundError(
            f"{LATEST} names {tag!r}, which does not exist (deleted?); pass an existing tag "
            "directory explicitly",
            path=target,
        )
    if not os.path.lexists(target / MANIFEST_NAME):
        _refuse_deepspeed(target)
    return target
