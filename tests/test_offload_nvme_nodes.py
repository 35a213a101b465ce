"""NVMe offload paths checked per node, on every rank (fsdpx/offload/nvme_nodes.py
[Note: NVMe paths per node]): 4 ranks standing in for 2 nodes of 2 ranks, each node's
"local disk" a directory of its own."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import fsdpx
from fsdpx.offload.nvme_nodes import check_nvme_nodes, verdict
from tests.ckpt_bodies import odd_net
from tests.dist import run_ranks


def _error(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return ("none", "")


def _body(rank: int, world_size: int, base: str) -> dict[str, Any]:
    node = rank // 2
    os.environ["FSDPX_NODE_HOST"] = f"node-{node}"  # what fsdpx launch sets per node
    mine = Path(base) / f"node{node}" / "nvme"
    out: dict[str, Any] = {}
    if node == 0:
        mine.mkdir(parents=True, exist_ok=True)
    out["missing"] = _error(lambda: check_nvme_nodes(str(mine), 1000))
    if node == 1:
        mine.mkdir(parents=True, exist_ok=True)
    out["fits"] = _error(lambda: check_nvme_nodes(str(mine), 1000))
    # Each of node 1's ranks fits alone (60% of the free space), the two together do not.
    st = os.statvfs(mine)
    share = int(0.6 * st.f_bavail * st.f_frsize) // 12
    out["short"] = _error(lambda: check_nvme_nodes(str(mine), share if node == 1 else 10))
    # The engine runs the check before it makes any swap file.
    cfg = {
        "zero": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(mine)}},
        "optimizer": {"lr": 1e-2},
    }
    dist.barrier()
    if rank == 2:
        mine.rmdir()
    dist.barrier()
    out["engine"] = _error(lambda: fsdpx.shard(odd_net(), fsdpx.Config.from_dict(cfg)))
    out["swap_files"] = sorted(p.name for p in Path(base).rglob("*.swap"))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("nvme_nodes")
    return {"base": base, "ranks": run_ranks(_body, 4, (str(base),))}


def test_a_node_whose_path_is_missing_is_named_on_every_rank(results: dict[str, Any]) -> None:
    for result in results["ranks"]:
        kind, message = result["missing"]
        assert kind == "NvmeOffloadError"
        assert re.fullmatch(
            r"offload nvme_path is unusable on node-1 \(rank\(s\) 2, 3\): offload nvme_path "
            r"'.*/node1/nvme' does not exist; create it .*",
            message,
        ), message
        assert result["fits"] == ("none", "")


def test_ranks_that_fit_alone_but_not_together_on_one_node(results: dict[str, Any]) -> None:
    for result in results["ranks"]:
        kind, message = result["short"]
        assert kind == "NvmeOffloadError"
        match = re.fullmatch(
            r"offload nvme_path has not enough free space for the optimizer state \(12 bytes "
            r"per parameter element: fp32 master and two Adam moments\): on node-1 "
            r"'.*/node1/nvme' has (\d+) bytes \(.*\) free but the swap files of rank\(s\) 2, 3 "
            r"there need (\d+) bytes \(.*\)\. Free space on that node, point nvme_path at a "
            r"larger disk, use more nodes, or offload to 'cpu'",
            message,
        )
        assert match is not None, message
        free, need = int(match[1]), int(match[2])
        assert free < need < 2 * free  # each rank alone (need / 2) would fit


def test_the_engine_checks_every_node_before_making_swap_files(results: dict[str, Any]) -> None:
    for result in results["ranks"]:
        kind, message = result["engine"]
        assert kind == "NvmeOffloadError"
        assert message.startswith("offload nvme_path is unusable on node-1 (rank(s) 2, 3): ")
        assert result["swap_files"] == []


def test_verdict_groups_ranks_by_node_and_file_system() -> None:
    def rep(host: str, dev: int, free: int, need: int) -> dict[str, Any]:
        return {
            "host": host,
            "path": "/nvme",
            "error": None,
            "dev": dev,
            "free": free,
            "need": need,
        }

    # Two file systems on one node are counted apart; a reused swap file needs nothing.
    assert verdict([rep("a", 1, 100, 60), rep("a", 2, 100, 60), rep("a", 1, 100, -5)]) is None
    message = verdict([rep("a", 1, 100, 60), rep("a", 1, 100, 60), rep("b", 1, 100, 60)])
    assert message is not None
    assert "on a '/nvme' has 100 bytes (0.0 MiB) free but the swap files of rank(s) 0, 1" in message
    assert "on b" not in message
