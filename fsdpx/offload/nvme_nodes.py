"""NVMe offload across nodes: every node's `nvme_path` checked together, before any swap
file is made.

[Note: NVMe paths per node] `zero.offload_optimizer.nvme_path` names the same path on
every node, but each node has its own disk behind it (that is the point of NVMe offload).
NvmeStore checks its own swap file (check_nvme_path), but two things escape a rank
alone: the ranks of one node share the node's disk, so each can see room for its own
file while together they do not fit; and a rank that raises alone leaves the others
waiting in the next collective until the timeout, with the cause in one rank's log.
So fsdpx.shard runs this check on every rank first: each rank checks its path (exists, a
directory, writable) and reports it with its host, its file system (st_dev), the free
bytes there, and the bytes its swap file needs (the estimator's 12 bytes per local
element: fp32 master and two moments, counted less what an existing swap file of this
rank already holds, as NvmeStore counts it); one all-gather, then every rank makes the
same verdict: per node and file system the needs are summed against the free space. An
error names the node (the launcher's host name, `FSDPX_NODE_HOST`, else the hostname),
its ranks, the path and the numbers, and is raised on every rank. A path on a file
system shared by several nodes is counted per node (NVMe paths are local by nature);
NvmeStore's own check of the exact file size still follows.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fsdpx.checkpoint import commit
from fsdpx.checkpoint.shared_dir import where
from fsdpx.errors import NvmeOffloadError
from fsdpx.offload.nvme import _human, check_nvme_path

STATE_BYTES_PER_ELEMENT = 12
"""fp32 master, exp_avg and exp_avg_sq per local element (the estimator's nvme bytes)."""


def swap_bytes(numel: int) -> int:
    """The swap file bytes a rank with `numel` local parameter elements needs (the chunk
    padding NvmeStore adds is left to its own exact check)."""
    return STATE_BYTES_PER_ELEMENT * numel


def _report(nvme_path: str, rank: int, needed: int) -> dict[str, Any]:
    out: dict[str, Any] = {"host": where(), "path": str(Path(nvme_path).expanduser())}
    try:
        path = check_nvme_path(nvme_path, 0)
    except NvmeOffloadError as exc:
        return {**out, "error": str(exc)}
    st = os.statvfs(path)
    try:  # an existing swap file of this rank is reused: its blocks count as available
        have = os.stat(path / f"fsdpx-offload-rank{rank}.swap").st_blocks * 512
    except OSError:
        have = 0
    free = st.f_bavail * st.f_frsize
    return {**out, "error": None, "dev": os.stat(path).st_dev, "free": free, "need": needed - have}


def _ranks(rs: list[int]) -> str:
    return ", ".join(str(r) for r in rs)


def verdict(reports: list[dict[str, Any]]) -> str | None:
    """The error every rank raises, or None: the paths are usable and every node's disk
    holds its ranks' swap files."""
    broken: dict[tuple[str, str], list[int]] = {}
    for r, rep in enumerate(reports):
        if rep["error"] is not None:
            broken.setdefault((rep["host"], rep["error"]), []).append(r)
    if broken:
        lines = [f"on {host} (rank(s) {_ranks(rs)}): {why}" for (host, why), rs in broken.items()]
        return "offload nvme_path is unusable " + "; ".join(lines)
    disks: dict[tuple[str, int], list[int]] = {}
    for r, rep in enumerate(reports):
        disks.setdefault((rep["host"], rep["dev"]), []).append(r)
    short = []
    for (host, _), rs in disks.items():
        need = sum(max(reports[r]["need"], 0) for r in rs)
        free = min(reports[r]["free"] for r in rs)
        if need > free:
            short.append(
                f"on {host} '{reports[rs[0]]['path']}' has {free} bytes ({_human(free)}) free but "
                f"the swap files of rank(s) {_ranks(rs)} there need {need} bytes ({_human(need)})"
            )
    if not short:
        return None
    return (
        "offload nvme_path has not enough free space for the optimizer state (12 bytes per "
        "parameter element: fp32 master and two Adam moments): "
        + "; ".join(short)
        + ". Free space on that node, point nvme_path at a larger disk, use more nodes, or "
        "offload to 'cpu'"
    )


def check_nvme_nodes(nvme_path: str, numel: int, group: dist.ProcessGroup | None = None) -> None:
    """Check every node's `nvme_path` for this job's swap files; every rank of `group`
    calls it with its own local parameter elements.

    Raises:
        NvmeOffloadError: on every rank, naming each node whose path is unusable or whose
            disk is too small, with its ranks and the numbers.

    Example::

        check_nvme_nodes("/local/nvme", numel=sum(p.to_local().numel() for p in params))
    """
    rank, _ = commit.world(group)
    reports = commit.all_gather_obj(_report(nvme_path, rank, swap_bytes(numel)), group)
    message = verdict(reports)
    if message is not None:
        raise NvmeOffloadError(message)
