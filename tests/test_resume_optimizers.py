"""Resume equals uninterrupted (tests/test_ckpt_resume.py's bodies and bar: per-step losses,
final parameters, optimizer state and counters bitwise equal on CPU, gloo, two ranks) for
the optimizers with state of their own: 0/1 Adam and 1-bit Lamb (schedules, frozen trust
ratios, per-rank error feedback) saved before and after their compressed phase starts,
and bf16 master weights with bf16 optimizer states (precision.master_dtype bf16)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests import ckpt_bodies
from tests.dist import run_ranks

STEPS, AT = 4, 2
SCHED = {"type": "WarmupLR", "warmup_num_steps": 8, "warmup_type": "linear"}
ZERO_ONE = {"type": "zero_one_adam", "lr": 1e-2, "var_update_scaler": 1}
LAMB = {"type": "onebit_lamb", "lr": 1e-2, "bias_correction": False}
CASES: dict[str, dict[str, Any]] = {
    # Saved at step 2 of the variance phase (steps 1, 2 and 4 average in fp32, step 3
    # exchanges compressed gradients), frozen from step 4 on.
    "zero_one_adam_warm": {
        "zero": {"stage": 0},
        "optimizer": {**ZERO_ONE, "var_freeze_step": 3},
        "scheduler": SCHED,
    },
    # Frozen from step 2: saved after a compressed synchronisation (error feedback live),
    # the local-step interval doubling every step up to 2 (step 3 local, step 4 a sync).
    "zero_one_adam_frozen": {
        "zero": {"stage": 0},
        "optimizer": {
            **ZERO_ONE,
            "var_freeze_step": 1,
            "local_step_scaler": 1,
            "local_step_clipper": 2,
        },
    },
    "onebit_lamb_warm": {"zero": {"stage": 0}, "optimizer": {**LAMB, "freeze_step": 3}},
    "onebit_lamb_compressed": {
        "zero": {"stage": 0},
        "optimizer": {**LAMB, "freeze_step": 1},
        "scheduler": SCHED,
    },
    "bf16_masters": {
        "zero": {"stage": 3},
        "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32", "master_dtype": "bf16"},
        "optimizer": {"lr": 1e-2},
        "scheduler": SCHED,
    },
}


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], list[Any]]:
    root = str(tmp_path_factory.mktemp("resume_optimizers"))
    first = run_ranks(ckpt_bodies.resume_first_body, 2, (CASES, root, STEPS, AT))
    second = run_ranks(ckpt_bodies.resume_second_body, 2, (CASES, root, STEPS, AT))
    return first, second


@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_bitwise_equal_to_uninterrupted(case: str, runs: Any) -> None:
    first, second = runs
    for rank in range(2):
        a, b = first[rank][case], second[rank][case]
        assert a["saving_losses"] == a["full_losses"]
        assert not _differ(a["saving_final"]["state"], a["reference"]["state"])
        assert b["losses"] == a["full_losses"][AT:]
        assert not _differ(b["final"]["state"], a["reference"]["state"])
        for key in ("global_steps", "micro_steps", "lr", "sched"):
            assert b["final"][key] == a["reference"][key], key
