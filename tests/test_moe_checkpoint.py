"""Expert-parallel checkpoints reshard: expert weights are saved as their global
[num_experts, ...] tensors, so a checkpoint saved at one ep size loads bitwise (parameters
and Adam moments) at another, and without expert parallelism."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import moe_bodies as mb
from tests.dist import run_ranks

DROPLESS = dict(num_experts=4, k=2, capacity_factor=None, reinit_experts=True)


def _equal(saved: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor], where: str) -> None:
    assert saved.keys() == loaded.keys(), where
    for key, value in saved.items():
        assert torch.equal(value, loaded[key]), f"{where}: {key} differs after the load"


def test_save_at_ep2_load_without_ep(tmp_path: Path) -> None:
    moe = {**DROPLESS, "ep_size": 2}
    results = run_ranks(mb.ckpt_body, 2, args=(moe, {"mesh": {"ep": 2}}, {}, str(tmp_path)))
    for rank, (saved, loaded) in enumerate(results):
        _equal(saved, loaded, f"rank {rank}")


@pytest.mark.slow
def test_save_at_ep4_load_at_ep2_and_one_rank(tmp_path: Path) -> None:
    moe = {**DROPLESS, "ep_size": 4}
    root = str(tmp_path)
    results = run_ranks(mb.ckpt_body, 4, args=(moe, {"mesh": {"ep": 4}}, {"mesh": {"ep": 2}}, root))
    for rank, (saved, loaded) in enumerate(results):
        _equal(saved, loaded, f"ep 4 -> 2, rank {rank}")
    (one,) = run_ranks(mb.load_only_body, 1, args=({**DROPLESS, "ep_size": 1}, {}, root))
    _equal(results[0][0], one, "ep 4 -> 1 rank")
