"""The atomic commit protocol and the small collectives it needs.

[Note: atomic commit]
1. Rank 0 picks a random nonce and broadcasts it; every rank writes its files into
   `<root>/<tag>.tmp-<nonce>/` and fsyncs them.
2. Every rank reports (ok or its error, its file info, its RNG state) in one all-gather:
   that is both the barrier and the vote. If any rank failed, nobody commits: rank 0
   removes the temp directory and every rank raises the same error.
3. Every rank's piece list goes to rank 0 alone (a gather: at 1,024 ranks no other rank
   should receive 1,024 lists), for the MANIFEST's tensor table ([Note: tensor table] in
   checkpoint_tools/format/routing.py). Rank 0 writes the MANIFEST last (atomically), renames the temp directory to
   `<root>/<tag>`, fsyncs `<root>`, then replaces `<root>/latest` atomically (temp file,
   fsync, rename, fsync `<root>`). It broadcasts whether that worked.

A rank killed at any point leaves either the previous state (no rename happened, `latest`
names the previous checkpoint) or a complete new checkpoint: `latest` is only ever
replaced by a rename, after the directory it names is complete and durable. Leftover
`*.tmp-*` directories of interrupted saves are removed by the next successful save.

What a tag is, how `latest` is written and read, what "committed" means and the fsync
steps are the root's rules, owned by checkpoint_tools/format/root.py ([Note: one owner
of the checkpoint root]) and shared with the offline tools; this module adds only the
multi-rank protocol on top (the vote, the directory rename, cleanup and retention).
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import msgpack
import torch
import torch.distributed as dist
from torch import Tensor

from checkpoint_tools.format.root import LATEST, TMP_MARK, committed, fsync_dir

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
    buf, sizes = _padded(payload, size, group)
    out = [torch.empty(len(buf), dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(out, buf, group=group)
    return [o[:s].numpy().tobytes() for o, s in zip(out, sizes, strict=True)]


def _padded(payload: bytes, size: int, group: dist.ProcessGroup | None) -> tuple[Tensor, list[int]]:
    """Every rank's payload length (one all-gather), and this rank's payload padded to the
    longest: the equal-sized buffer gloo's gather and all-gather need."""
    n = torch.tensor([len(payload)], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lengths, n, group=group)
    sizes = [int(s) for s in lengths]
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    if payload:
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return buf, sizes


def gather_bytes(payload: bytes, group: dist.ProcessGroup | None) -> list[bytes] | None:
    """Every rank's payload, in rank order, on rank 0 (None elsewhere): what only rank 0
    needs costs the others nothing beyond one all-gather of sizes."""
    rank, size = world(group)
    if size == 1:
        return [payload]
    buf, sizes = _padded(payload, size, group)
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    out = [torch.empty(len(buf), dtype=torch.uint8) for _ in range(size)] if rank == 0 else None
    dist.gather(buf, out, dst=dst, group=group)
    if out is None:
        return None
    return [o[:s].numpy().tobytes() for o, s in zip(out, sizes, strict=True)]


def gather_obj(value: Any, group: dist.ProcessGroup | None) -> list[Any] | None:
    """gather_bytes of msgpack-encoded values (never pickle)."""
    raw = gather_bytes(msgpack.packb(value, use_bin_type=True), group)
    if raw is None:
        return None
    return [msgpack.unpackb(r, raw=False, strict_map_key=False) for r in raw]


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
