"""DeepSpeed's MoE config keys (the `expert_parallel` block) in the translation table."""

from __future__ import annotations

from typing import Any

import pytest

import fsdpx
from fsdpx.deepspeed._config import explain
from fsdpx.deepspeed._keys import DS_KEYS

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
