"""The atomic commit protocol and the small collectives it needs.

[Note: atomic commit]
1. Rank 0 picks a random nonce and broadcasts it; every rank writes its files into
   `<root>/<tag>.tmp-<nonce>/` and fsyncs them.
2. Every rank reports (ok or its error, its file info, its RNG state) in one all-gather:
   that is both the barrier and the vote. If any rank failed, nobody commits: rank 0
   removes the temp directory and every rank raises the same error.
3. Rank 0 writes the MANIFEST last (atomically), renames the temp directory to
   `<root>/<tag>`, fsyncs `<root>`, then replaces `<root>/latest` atomically (temp file,
   fsync, rename, fsync `<root>`). It broadcasts whether that worked.

A rank killed at any point leaves either the previous state (no rename happened, `latest`
names the previous checkpoint) or a complete new checkpoint: `latest` is only ever
replaced by a rename, after the directory it names is complete and durable. Leftover
`*.tmp-*` directories of interrupted saves are removed by the next successful save.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from fsdpx.checkpoint.format import MANIFEST_NAME

LATEST = "latest"
TMP_MARK = ".tmp-"


def check_tag(tag: str) -> str:
    """A tag is one directory name under the checkpoint root."""
    if (
        not isinstance(tag, str)
        or not tag
        or tag in (".", "..", LATEST)
        or "/" in tag
        or "\\" in tag
        or "\0" in tag
        or tag.startswith(".")
        or TMP_MARK in tag
    ):
        raise ValueError(
            f"checkpoint tag must be a plain directory name (no '/', not starting with "
            f"'.', not 'latest', without '{TMP_MARK}'); got {tag!r}"
        )
    return tag


# --- collectives ------------------------------------------------------------------------


def world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, world size) in `group`; (0, 1) without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_bytes(payload: bytes, group: dist.ProcessGroup | None) -> list[bytes]:
    """Every rank's payload, in rank order, on every rank (CPU tensors: the group must be
    gloo or have a CPU backend)."""
    _, size = world(group)
    if size == 1:
        return [payload]
    n = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(sizes, n, group=group)
    longest = max(int(s) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(out, buf, group=group)
    return [o[: int(s)].numpy().tobytes() for o, s in zip(out, sizes, strict=True)]


def all_gather_obj(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """all_gather_bytes of msgpack-encoded values (never pickle)."""
    raw = all_gather_bytes(msgpack.packb(value, use_bin_type=True), group)
    return [msgpack.unpackb(r, raw=False, strict_map_key=False) for r in raw]


def broadcast_obj(value: Any, group: dist.ProcessGroup | None, src_rank: int = 0) -> Any:
    """Rank src_rank's value on every rank (msgpack, via all_gather_bytes: the payloads
    here are a few bytes, so one code path beats a second protocol)."""
    rank, _ = world(group)
    mine = value if rank == src_rank else None
    return all_gather_obj(mine, group)[src_rank]


def new_nonce() -> str:
    return secrets.token_hex(6)


# --- filesystem -------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_dir(root: Path, tag: str, nonce: str) -> Path:
    return root / f"{tag}{TMP_MARK}{nonce}"


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def commit_dir(temp: Path, final: Path) -> None:
    """Rename the complete temp directory into place (rank 0, after the MANIFEST).

    A checkpoint of the same tag is replaced by an atomic exchange where the OS offers
    one (a directory rename cannot replace a non-empty directory); elsewhere it is moved
    aside first, which leaves a moment where `final` does not exist.
    """
    if final.exists():
        if _exchange(temp, final):
            fsync_dir(final.parent)
            shutil.rmtree(temp, ignore_errors=True)  # now holds the old checkpoint
            return
        old = final.with_name(f"{final.name}{TMP_MARK}old-{new_nonce()}")
        os.rename(final, old)
        os.rename(temp, final)
        fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    os.rename(temp, final)
    fsync_dir(final.parent)


def write_latest(root: Path, tag: str) -> None:
    """Atomically make `<root>/latest` name `tag`: temp file, fsync, rename, fsync dir."""
    tmp = root / f"{LATEST}{TMP_MARK}{new_nonce()}"
    try:
        with open(tmp, "w") as f:
            f.write(tag + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / LATEST)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(root)


def read_latest(root: Path) -> str | None:
    """The tag `<root>/latest` names, or None when there is no such file."""
    try:
        text = (root / LATEST).read_text()
    except FileNotFoundError:
        return None
    return text.strip()


def committed(root: Path) -> list[Path]:
    """Committed checkpoints under `root` (directories holding a MANIFEST), oldest first by
    the MANIFEST's modification time (its commit time), then by name."""
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if TMP_MARK in d.name or not d.is_dir():
            continue
        manifest = d / MANIFEST_NAME
        with contextlib.suppress(OSError):
            found.append((manifest.stat().st_mtime_ns, d.name, d))
    return [d for _, _, d in sorted(found)]


def remove_stale_temps(root: Path) -> None:
    """Remove what interrupted saves left under `root`: `*.tmp-*` directories and
    `latest.tmp-*` files (never a committed checkpoint: those have no TMP_MARK)."""
    for p in root.iterdir():
        if TMP_MARK not in p.name:
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith(LATEST + TMP_MARK):
            p.unlink(missing_ok=True)


def apply_retention(root: Path, keep_last: int, *, protect: set[str]) -> list[Path]:
    """Remove all but the `keep_last` newest checkpoints, never one named in `protect`
    (the one `latest` names, the one just written). Returns the removed directories."""
    if keep_last <= 0:
        return []
    ckpts = committed(root)
    removed = []
    for d in ckpts[: max(len(ckpts) - keep_last, 0)]:
        if d.name in protect:
            continue
        # Rename first so a crash mid-removal never leaves a half-deleted checkpoint that
        # still looks committed.
        doomed = d.with_name(f"{d.name}{TMP_MARK}del-{new_nonce()}")
        os.rename(d, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(d)
    return removed
