"""Checkpoints under pipeline parallelism (mesh.pp > 1), where each rank holds only its
stages: resume at dp2 x pp2 with 1F1B is bitwise equal to the uninterrupted run; a pp2
checkpoint loads without pipeline parallelism at 1 rank and consolidates to the full model
([Note: pipeline checkpoints] in fsdpx/checkpoint/saving.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from checkpoint_tools import load_state_dict
from tests import ckpt_bodies
from tests import tp_bodies as tb
from tests.dist import run_ranks

STEPS, AT = 4, 2
SCHED = {"type": "WarmupLR", "warmup_num_steps": 8, "warmup_type": "linear"}


def _cfg(**mesh: int) -> dict[str, Any]:
    return tb.base_cfg(2, mesh=mesh, pipeline={"schedule": "1F1B"}, scheduler=SCHED)


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_resume_under_dp2_pp2_is_bitwise_equal(tmp_path: Path) -> None:
    cfg = _cfg(pp=2, dp_shard=2)
    root = str(tmp_path)
    first = run_ranks(ckpt_bodies.pp_resume_first_body, 4, (cfg, root, STEPS, AT))
    second = run_ranks(ckpt_bodies.pp_resume_second_body, 4, (cfg, root, STEPS, AT))
    # Each pp stage holds different parameters: the two stages' states are disjoint.
    stage0, stage1 = (set(first[r]["reference"]["state"]) for r in (0, 2))
    assert stage0 and stage1 and not stage0 & stage1
    for a, b in zip(first, second, strict=True):
        assert a["saving_losses"] == a["full_losses"]
        assert b["losses"] == a["full_losses"][AT:]
        assert not _differ(b["final"]["state"], a["reference"]["state"])
        for key in ("global_steps", "micro_steps", "skipped_steps", "lr", "sched", "scaler"):
            assert b["final"][key] == a["reference"][key], key
        assert b["loaded_steps"] == AT and b["client_state"] == {"at": AT}
        assert Path(b["path"]).name == f"global_step{AT}" == Path(a["path"]).name


def test_pp2_checkpoint_loads_without_pipeline_and_consolidates(tmp_path: Path) -> None:
    root = str(tmp_path)
    saved = run_ranks(ckpt_bodies.pp_save_body, 2, (_cfg(pp=2), root))
    # The stages together: every parameter and optimizer state of the model, once.
    expected = {**saved[0]["state"], **saved[1]["state"]}
    assert len(expected) == len(saved[0]["state"]) + len(saved[1]["state"])
    (loaded,) = run_ranks(ckpt_bodies.plain_load_body, 1, (tb.base_cfg(1, scheduler=SCHED), root))
    assert not _differ(loaded["state"], expected)
    assert loaded["global_steps"] == 2 and loaded["sched"] == saved[0]["sched"]
    full = load_state_dict(root)
    assert not _differ(
        full, {k[len("model/") :]: v for k, v in expected.items() if k[:6] == "model/"}
    )
    # A model the stages cannot cover (2 blocks for a 4-block checkpoint): every rank raises.
    for r in saved:
        assert "no rank holds ['blocks.2." in r["mismatch"], r["mismatch"]
        assert "pipeline stages together must hold every model tensor" in r["mismatch"]
