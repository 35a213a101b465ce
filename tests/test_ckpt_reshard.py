"""Reshard on load: a checkpoint saved by 4 ranks under ZeRO-3 loads at 2 ranks under
ZeRO-1 and ZeRO-0 and at 1 rank, with parameters, buffers and optimizer state equal to
what was saved. Sizes (13, 5, 3 rows) do not divide by 4, so some ranks save empty shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint_tools.format import CheckpointReader
from tests import ckpt_bodies
from tests.dist import run_ranks

SAVE_CFG = {"zero": {"stage": 3}, "optimizer": {"lr": 1e-2}}


@pytest.fixture(scope="module")
def saved_and_loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("reshard"))
    saved = run_ranks(ckpt_bodies.reshard_save_body, 4, (SAVE_CFG, root, 3))
    at2 = run_ranks(
        ckpt_bodies.reshard_load_body,
        2,
        ({"zero1": {"zero": {"stage": 1}}, "zero0": {"zero": {"stage": 0}}}, root),
    )
    at1 = run_ranks(ckpt_bodies.reshard_load_body, 1, ({"zero3": {"zero": {"stage": 3}}}, root))
    return {
        "saved": saved[0],
        "indexes": [s["indexes"] for s in saved],
        "at2": at2,
        "at1": at1[0],
        "root": Path(root),
    }


def _assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k


def test_saved_state_has_optimizer_and_buffer(saved_and_loaded: dict[str, Any]) -> None:
    state = saved_and_loaded["saved"]["state"]
    assert "model/seen" in state and int(state["model/seen"][0]) == 3
    assert {
        "optim/mid.weight/exp_avg",
        "optim/mid.weight/exp_avg_sq",
        "optim/mid.weight/step",
    } <= set(state)


def test_reload_at_same_world_size_with_empty_shards(saved_and_loaded: dict[str, Any]) -> None:
    saved = saved_and_loaded["saved"]
    _assert_same_state(saved["reloaded"]["state"], saved["state"])


def test_reload_at_same_world_size_reads_only_its_own_index(
    saved_and_loaded: dict[str, Any],
) -> None:
    # The 1.2 tensor table spares each rank the other indexes: it reads its own (its
    # shards) and rank 0's (which alone writes plain tensors: the buffer), each once.
    assert [sorted(names) for names in saved_and_loaded["indexes"]] == [
        sorted({"rank-00000.index", f"rank-{r:05d}.index"}) for r in range(4)
    ]


def test_hsdp_writes_each_replicated_piece_once(saved_and_loaded: dict[str, Any]) -> None:
    hsdp = saved_and_loaded["saved"]["hsdp"]
    with CheckpointReader(saved_and_loaded["root"] / "hsdp" / "hsdp") as reader:
        assert reader.world_size == 4
        for name, want in hsdp["state"].items():
            assert torch.equal(reader.read(name), want), name
            pieces = reader.meta(name).pieces
            # Parameters and their states: sharded 2 ways (replicas not written again);
            # plain tensors (the buffer, Adam's step): one piece.
            plain = name == "model/seen" or name.endswith("/step")
            assert len(pieces) == (1 if plain else 2), (name, pieces)


@pytest.mark.parametrize("where", ["zero1@2", "zero0@2", "zero3@1"])
def test_load_at_other_world_size_and_stage(where: str, saved_and_loaded: dict[str, Any]) -> None:
    name, world = where.split("@")
    saved = saved_and_loaded["saved"]
    results = saved_and_loaded["at2"] if world == "2" else [saved_and_loaded["at1"]]
    for per_rank in results:
        loaded = per_rank[name]["loaded"]
        _assert_same_state(loaded["state"], saved["state"])
        for key in ("global_steps", "lr", "sched"):
            assert loaded[key] == saved[key], key
        assert per_rank[name]["client_state"] == {"world": 4}


def test_training_continues_alike_after_reshard(saved_and_loaded: dict[str, Any]) -> None:
    """One more step from the loaded state: the same update at 1 and 2 ranks (up to the
    reduction order of the gradient average)."""
    one = saved_and_loaded["at1"]["zero3"]["after"]["state"]
    for name in ("zero1", "zero0"):
        two = saved_and_loaded["at2"][0][name]["after"]["state"]
        for k in one:
            torch.testing.assert_close(two[k], one[k], msg=k)


def test_load_into_dp2_x_tp2(tmp_path: Path) -> None:
    """Saved at 2 ranks ZeRO-3 (parameters Shard(0) over dp), loaded at 4 ranks with
    tensor parallelism 2 x FSDP 2 (FSDP-over-TP strided shards): the same state."""
    root = str(tmp_path)
    saved = run_ranks(ckpt_bodies.gpt_save_body, 2, ({"zero": {"stage": 3}}, root))[0]
    loaded = run_ranks(
        ckpt_bodies.gpt_load_body, 4, ({"zero": {"stage": 3}, "mesh": {"tp": 2}}, root)
    )
    placements = loaded[0]["placements"]
    assert "_StridedShard" in placements["blocks.0.attn.q_proj.weight"]  # really 2D
    for per_rank in loaded:
        _assert_same_state(per_rank["state"], saved["state"])
        assert per_rank["global_steps"] == saved["global_steps"] == 2
