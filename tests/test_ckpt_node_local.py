"""Node-local checkpoints (`checkpoint.node_local`, DeepSpeed's use_node_local_storage):
two simulated nodes of two ranks on one machine, each with a "local disk" of its own
(fsdpx/checkpoint/node_local.py [Note: node-local checkpoints])."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import fsdpx
from checkpoint_tools.consolidate import consolidate
from checkpoint_tools.format import CheckpointError, CheckpointNotFoundError, CheckpointReader
from fsdpx.checkpoint.node_local import disagreement, nodes_from
from tests import node_local_bodies
from tests.dist import run_ranks


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("node_local")
    results = run_ranks(node_local_bodies.save_and_load_body, 4, (str(base),))
    return {"base": base, "ranks": results}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_each_node_holds_its_ranks_files_and_the_same_manifest(run: dict[str, Any]) -> None:
    ranks = run["ranks"]
    node0 = ["MANIFEST", "rank-00000.data", "rank-00000.index"]
    node0 += ["rank-00001.data", "rank-00001.index"]
    assert ranks[0]["files"] == ranks[1]["files"] == node0
    assert (
        ranks[2]["files"]
        == ranks[3]["files"]
        == [
            "MANIFEST",
            "rank-00002.data",
            "rank-00002.index",
            "rank-00003.data",
            "rank-00003.index",
        ]
    )
    base = run["base"]
    one, two = (base / f"node{n}" / "ckpt" / "s1" / "MANIFEST" for n in (0, 1))
    assert one.read_bytes() == two.read_bytes()
    # Each node has its own `latest` (s2 on node 0; node 1's was set back by the test).
    assert (base / "node0" / "ckpt" / "latest").read_text() == "s2\n"


def test_in_place_load_restores_every_rank_bitwise(run: dict[str, Any]) -> None:
    for result in run["ranks"]:
        _same(result["loaded"], result["saved"])
        assert result["client"] == {"epoch": 1}


def test_a_shared_directory_with_node_local_is_one_ordinary_checkpoint(
    run: dict[str, Any],
) -> None:
    files = run["ranks"][0]["shared_files"]
    assert files == ["MANIFEST"] + [
        f"rank-0000{r}.{x}" for r in range(4) for x in ("data", "index")
    ]
    with CheckpointReader(run["base"] / "shared" / "s1") as r:
        assert r.state["node_local"]["nodes"] == [{"ranks": [0, 1, 2, 3], "host": "node-0"}]


def test_a_missing_node_part_fails_on_every_rank_naming_the_node(run: dict[str, Any]) -> None:
    for result in run["ranks"]:
        kind, message = result["missing"]
        assert kind == "CheckpointNotFoundError", message
        assert re.fullmatch(
            r"checkpoint '.*/node1/ckpt/s1' does not exist\..*\(rank 2 of 4, on node-1\)",
            message,
        ), message


def test_nodes_holding_different_saves_are_refused_before_loading(run: dict[str, Any]) -> None:
    root = str(run["base"] / "node0" / "ckpt")
    for rank, result in enumerate(run["ranks"]):
        kind, message = result["mixed"]
        assert kind == "CheckpointError"
        mine = str(run["base"] / f"node{rank // 2}" / "ckpt")
        assert re.match(
            re.escape(f"a node-local load needs every node's {mine!r} to hold the same save, ")
            + r"but rank\(s\) 0, 1 \(on node-0\) found 's2' \(save [0-9a-f]{12}\); rank\(s\) "
            r"2, 3 \(on node-1\) found 's1' \(save [0-9a-f]{12}\): a save was interrupted "
            r"between the nodes' commits",
            message,
        ), message
        assert "load with tag= naming a checkpoint every node holds" in message
    assert root  # each rank names its own root (the same path on real nodes)


def test_node_local_parts_loaded_as_shared_name_the_missing_nodes(run: dict[str, Any]) -> None:
    kind, message = run["ranks"][0]["not_node_local"]
    assert kind == "CheckpointNotFoundError"
    assert re.search(
        r"missing checkpoint file 'rank-00002.index' and 3 more: the MANIFEST lists the "
        r"files of 4 rank\(s\), but the files of rank\(s\) 2, 3 "
        r"\(node 1 on node-1: ranks 2, 3\) are not in '.*node0/ckpt/s2': this is one node's "
        r"part of a node-local checkpoint \(checkpoint.node_local\). Copy the rank-\* files of "
        r"every node's 's2' directory into one directory",
        message,
    ), message
    assert message.endswith("(rank 0 of 4)")


def test_gathered_parts_load_at_any_layout_and_consolidate(
    run: dict[str, Any], tmp_path: Path
) -> None:
    for result in run["ranks"]:  # loaded with node_local off, from the gathered directory
        _same(result["gathered_load"], result["s2"])
    gathered = run["base"] / "gathered" / "s2"
    with CheckpointReader(gathered) as r:
        r.verify()
    # One process, the full model (another world size than the 4 that saved it).
    model = node_local_bodies.odd_net(seed=5)
    fsdpx.checkpoint.load(gathered.parent, model, tag="s2", load_module_only=True)
    want = {k[6:]: v for k, v in run["ranks"][0]["full2"].items() if k.startswith("model/")}
    _same(model.state_dict(), want)
    (out,) = consolidate(gathered, tmp_path / "full.safetensors")
    _same(safetensors.torch.load_file(out), want)


def test_consolidating_one_node_part_names_the_missing_node(
    run: dict[str, Any], tmp_path: Path
) -> None:
    part = run["base"] / "node1" / "ckpt" / "s1"
    with pytest.raises(
        CheckpointNotFoundError,
        match=r"files of rank\(s\) 0, 1 \(node 0 on node-0: ranks 0, 1\) are not in .*: this "
        r"is one node's part of a node-local checkpoint",
    ):
        consolidate(part, tmp_path / "out.safetensors")


def test_a_rectangle_of_another_node_is_refused_in_place(run: dict[str, Any]) -> None:
    part = run["base"] / "node1" / "ckpt" / "s1"
    with CheckpointReader(part, present_only=True) as r:
        assert r.absent_ranks == [0, 1]
        r.read("model/inp.weight", (8, 0), (5, 7))  # rows 8..12: ranks 2 and 3 hold them
        with pytest.raises(
            CheckpointNotFoundError,
            match=r"element \(0, 0\) of the \(13, 7\) tensor is in none of the files here: "
            r"they are in the files of rank\(s\) 0, 1 \(node 0 on node-0: ranks 0, 1\).*gather "
            r"every node's directory into one",
        ):
            r.read("model/inp.weight")


def test_a_node_missing_one_of_its_own_files_is_incomplete(
    run: dict[str, Any], tmp_path: Path
) -> None:
    copy = tmp_path / "s1"
    shutil.copytree(run["base"] / "shared" / "s1", copy)
    (copy / "rank-00003.data").unlink()
    with pytest.raises(
        CheckpointNotFoundError,
        match=r"^missing checkpoint file 'rank-00003.data': the MANIFEST lists the files of 4 "
        r"rank\(s\), but the files of rank\(s\) 3 \(node 0 on node-0: ranks 0-3\) are "
        r"not in '.*/s1': the checkpoint is incomplete; restore the missing files",
    ):
        CheckpointReader(copy)


def test_ranks_that_see_each_others_files_inconsistently_are_an_error() -> None:
    assert nodes_from([[0, 1], [0, 1], [2], [3]], ["a", "a", "b", "c"]) == [
        {"ranks": [0, 1], "host": "a"},
        {"ranks": [2], "host": "b"},
        {"ranks": [3], "host": "c"},
    ]
    with pytest.raises(
        CheckpointError,
        match=r"rank 0 \(on a\) sees the files of ranks \[0, 1\] and rank 1 \(on a\) sees "
        r"\[0, 1, 2\]; nothing was committed\. A network file system",
    ):
        nodes_from([[0, 1], [0, 1, 2], [1, 2]], ["a", "a", "b"])
    with pytest.raises(CheckpointError, match=r"rank 1 \(on b\) sees the files of ranks \[0\]"):
        nodes_from([[0], [0]], ["a", "b"])


def test_the_load_check_tells_saves_apart_by_their_files() -> None:
    votes = [
        {"save": "aaaaaaaaaaaa", "tag": "s1", "host": "n0"},
        {"save": "bbbbbbbbbbbb", "tag": "s1", "host": "n1"},
    ]
    message = disagreement("/ckpt", votes)
    assert message is not None
    assert "found 's1' (save aaaaaaaaaaaa); rank(s) 1 (on n1) found 's1' (save bbbb" in message
    assert disagreement("/ckpt", [votes[0], {**votes[0], "host": "n1"}]) is None


def test_node_local_loads_an_ordinary_checkpoint(tmp_path: Path) -> None:
    saved = node_local_bodies.odd_net(seed=1)
    fsdpx.checkpoint.save(tmp_path, saved, tag="t")
    model = node_local_bodies.odd_net(seed=2)
    fsdpx.checkpoint.load(tmp_path, model, node_local=True)
    _same(model.state_dict(), saved.state_dict())


def test_an_async_node_local_save_of_one_process(tmp_path: Path) -> None:
    model = node_local_bodies.odd_net(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 7)).sum().backward()
    opt.step()
    saver = fsdpx.checkpoint.Checkpointer(
        fsdpx.checkpoint.SaveOptions(node_local=True), async_save=True
    )
    saver.save(tmp_path, model=model, optimizer=opt, tag="a")
    assert saver.close() == tmp_path / "a"
    with CheckpointReader(tmp_path / "a") as r:
        assert [n["ranks"] for n in r.state["node_local"]["nodes"]] == [[0]]
    again = node_local_bodies.odd_net(seed=2)
    fsdpx.checkpoint.load(tmp_path, again, node_local=True, load_module_only=True)
    _same(again.state_dict(), model.state_dict())


def test_deepspeed_use_node_local_storage_maps_to_node_local() -> None:
    ds = {"train_micro_batch_size_per_gpu": 1, "checkpoint": {"use_node_local_storage": True}}
    assert fsdpx.Config.from_deepspeed(ds, world_size=1).checkpoint.node_local
    ds["checkpoint"] = {"tag_validation": "Warn", "load_universal": False}
    assert not fsdpx.Config.from_deepspeed(ds, world_size=1).checkpoint.node_local
    ds["checkpoint"] = {"use_node_local_storage": "yes"}
    with pytest.raises(
        ValueError, match=r"'checkpoint.node_local' must be true or false; got 'yes'"
    ):
        fsdpx.Config.from_deepspeed(ds, world_size=1)


HSDP_PP: dict[str, dict[str, Any]] = {
    # HSDP as run across nodes: each node's two ranks shard one replica.
    "hsdp": {"mesh": {"dp_replicate": 2, "dp_shard": 2}},
    # Pipeline stages across nodes: one stage per node, sharded over its two ranks.
    "pp": {"mesh": {"pp": 2, "dp_shard": 2}, "pipeline": {"schedule": "1F1B"}},
}


@pytest.mark.parametrize("case", sorted(HSDP_PP))
def test_node_local_under_hsdp_and_pp_loads_in_place_and_gathered(
    case: str, tmp_path: Path
) -> None:
    from tests import tp_bodies

    cfg = tp_bodies.base_cfg(2, **HSDP_PP[case])
    ranks = run_ranks(node_local_bodies.mesh_save_and_load_body, 4, (cfg, str(tmp_path)))
    for r, out in enumerate(ranks):
        node = r // 2
        want = [
            f"rank-{n:05d}.{ext}" for n in (2 * node, 2 * node + 1) for ext in ("data", "index")
        ]
        assert out["files"] == ["MANIFEST", *want], (r, out["files"])
        saved = out["saved"]
        # Parameters and optimizer state (every full tensor) and the step counters, back
        # bit for bit from each node's own part and from the gathered directory.
        for how in ("in_place", "gathered"):
            got = out[how]
            assert sorted(got["state"]) == sorted(saved["state"]), (r, how)
            assert any(k.startswith("optim/") for k in saved["state"])
            for k, v in saved["state"].items():
                assert torch.equal(got["state"][k], v), (r, how, k)
            for key in ("global_steps", "micro_steps", "lr", "sched"):
                assert got[key] == saved[key], (r, how, key)
        assert out["client"] == {"tag": "s1"}
        # The loaded engine takes the next step exactly as the saving one did.
        assert out["in_place_next_loss"] == out["next_loss"]
    if case == "pp":  # each node held only its stage: the nodes' states are disjoint
        stage0, stage1 = (set(ranks[r]["saved"]["state"]) for r in (0, 2))
        assert stage0 and stage1 and not stage0 & stage1
