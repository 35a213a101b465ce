"""Resume equals uninterrupted: train N steps; or train k, save, load in fresh processes
and train to N. Per-step losses and final parameters and optimizer state must be bitwise
equal (CPU, gloo, same world size). Dropout and batches drawn from the global RNG make
the RNG restore matter; fp16 with a short window makes the loss scaler's state matter; a
warmup schedule makes the scheduler's state matter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests import ckpt_bodies
from tests.dist import run_ranks

STEPS, AT = 4, 2
SCHED = {"type": "WarmupLR", "warmup_num_steps": 8, "warmup_type": "linear"}
FP16 = {"param_dtype": "fp16", "reduce_dtype": "fp32"}
CASES: dict[str, dict[str, Any]] = {
    "zero3_fp16": {
        "zero": {"stage": 3},
        "precision": FP16,
        "fp16": {"initial_scale_power": 8, "window": 2},
        "scheduler": SCHED,
        "optimizer": {"lr": 1e-2},
    },
    "zero1_gas2": {
        "zero": {"stage": 1},
        "gradient_accumulation_steps": 2,
        "scheduler": SCHED,
        "optimizer": {"lr": 1e-2},
        "checkpoint": {"compression": "none"},
    },
    "zero3_async": {
        "zero": {"stage": 3},
        "scheduler": SCHED,
        "optimizer": {"lr": 1e-2},
        "checkpoint": {"async_save": True},
    },
}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], list[Any]]:
    root = str(tmp_path_factory.mktemp("resume"))
    first = run_ranks(ckpt_bodies.resume_first_body, 2, (CASES, root, STEPS, AT))
    second = run_ranks(ckpt_bodies.resume_second_body, 2, (CASES, root, STEPS, AT))
    return first, second


@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_bitwise_equal_to_uninterrupted(case: str, runs: Any) -> None:
    first, second = runs
    gas = CASES[case].get("gradient_accumulation_steps", 1)
    for rank in range(2):
        a, b = first[rank][case], second[rank][case]
        # Saving (sync or async) does not disturb the run that saved.
        assert a["saving_losses"] == a["full_losses"]
        assert not _equal(a["saving_final"]["state"], a["reference"]["state"])
        # The resumed run continues exactly where the uninterrupted one went.
        assert b["losses"] == a["full_losses"][AT * gas :]
        assert not _equal(b["final"]["state"], a["reference"]["state"])
        for key in ("global_steps", "micro_steps", "skipped_steps", "loss_scale", "lr", "sched"):
            assert b["final"][key] == a["reference"][key], key
        assert b["loaded"]["global_steps"] == AT
        assert b["client_state"] == {"case": case, "at": AT}
        assert Path(b["path"]).name == f"global_step{AT}" == Path(a["path"]).name


def test_fp16_case_exercises_the_loss_scaler(runs: Any) -> None:
    first, second = runs
    ref = first[0]["zero3_fp16"]["reference"]
    loaded = second[0]["zero3_fp16"]["loaded"]
    # A fresh scaler has cur_iter 0 and scale 2**8; window=2 doubles it every 2 steps.
    assert loaded["scaler"]["cur_iter"] == AT
    assert loaded["loss_scale"] == 2.0**9
    assert ref["scaler"]["cur_iter"] == STEPS
