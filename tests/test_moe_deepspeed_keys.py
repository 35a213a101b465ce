"""DeepSpeed's MoE config keys (the `expert_parallel` block) in the translation table, and
mesh.ep taken from the model's MoE(ep_size=...) by `deepspeed.initialize`."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fsdpx
from fsdpx.deepspeed._config import explain
from fsdpx.deepspeed._keys import DS_KEYS
from fsdpx.deepspeed._moe import with_model_ep
from tests import moe_bodies as mb
from tests.dist import run_ranks

BASE: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}


def _cfg(ep: dict[str, Any]) -> fsdpx.Config:
    return fsdpx.Config.from_deepspeed({**BASE, "expert_parallel": ep}, world_size=4)


def test_autoep_size_is_mesh_ep() -> None:
    assert _cfg({"enabled": True, "autoep_size": 2}).mesh.ep == 2
    assert _cfg({"enabled": False, "autoep_size": 4}).mesh.ep == 1
    # Module-finding keys are ignored: fsdpx finds fused experts by structure.
    assert _cfg({"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}).mesh.ep == 2


@pytest.mark.parametrize(
    ("ep", "match"),
    [
        (
            {"enabled": True, "autoep_size": 2, "top_k": 2},
            r"expert_parallel.top_k' = 2: fsdpx keeps",
        ),
        (
            {"enabled": True, "autoep_size": 0},
            r"'expert_parallel.autoep_size' must be an integer >= 1",
        ),
        (
            {"enabled": True, "autoep_size": 2, "expert_tensor_parallel_size": 2},
            r"tensor parallelism inside experts is not implemented",
        ),
    ],
)
def test_refused_moe_keys(ep: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _cfg(ep)


def test_every_autoep_key_has_a_row() -> None:
    assert DS_KEYS["expert_parallel.autoep_size"].action == "mapped"
    assert DS_KEYS["use_data_before_expert_parallelism"].action == "refused"
    rows, cfg, error = explain(
        {**BASE, "expert_parallel": {"enabled": True, "autoep_size": 2, "comm_backend": "x"}},
        world_size=4,
    )
    by_key = {row.key: row for row in rows}
    assert error is None and cfg is not None
    assert by_key["expert_parallel.autoep_size"].status == "mapped"
    assert by_key["expert_parallel.comm_backend"].status == "ignored"


def test_initialize_takes_ep_from_the_model() -> None:
    moe = {"num_experts": 4, "ep_size": 2, "k": 1}
    cfg = with_model_ep(mb.make_model(moe), fsdpx.Config())
    assert cfg.mesh.ep == 2
    assert with_model_ep(mb.make_model({**moe, "ep_size": 1}), fsdpx.Config()).mesh.ep == 1
    # A config that asks for another size is left alone: fsdpx.shard names both.
    asked = fsdpx.Config.from_dict({"mesh": {"ep": 4}})
    assert with_model_ep(mb.make_model(moe), asked).mesh.ep == 4
    mixed = mb.make_model(moe)
    mixed.blocks[1].moe.ep_size = 4
    with pytest.raises(ValueError, match=r"different ep_size values \[2, 4\]"):
        with_model_ep(mixed, fsdpx.Config())


@pytest.mark.slow
def test_deepspeed_script_with_moe_matches_one_process() -> None:
    """A DeepSpeed-style script (`deepspeed.initialize`, MoE(ep_size=2), ZeRO-2, clipping)
    on 2 ranks trains as one process does."""
    moe = {"num_experts": 4, "ep_size": 2, "k": 2, "capacity_factor": None, "reinit_experts": True}
    results = run_ranks(mb.ds_initialize_body, 2, args=(moe, 0.5))
    ref_losses, _, ref_params = mb.reference_run(moe, 2, 0.5)
    for losses, params in results:
        torch.testing.assert_close(losses, ref_losses)
        for n, p in ref_params.items():
            torch.testing.assert_close(params[n], p, msg=n)
