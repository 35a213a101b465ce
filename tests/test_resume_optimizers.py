"""Resume equals uninterrupted (tests/test_ckpt_resume.py's bodies and bar: per-step losses,
final parameters, optimizer state and counters bitwise equal on CPU, gloo, two ranks) for
the optimizers with state of their own: 1-bit Adam, 0/1 Adam and 1-bit Lamb (schedules,
frozen trust ratios, per-rank error feedback: [Note: per-rank optimizer state] in
fsdpx/checkpoint/state.py) saved after their compressed phase started (and, slow tier,
before it), and bf16 master weights with bf16 optimizer states (precision.master_dtype
bf16)."""

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
    # 0/1 Adam frozen from step 2: saved after a compressed synchronisation (error feedback
    # live), the local-step interval doubling every step up to 2 (step 3 local, 4 a sync).
    "zero_one_adam_frozen": {
        "zero": {"stage": 0},
        "optimizer": {
            **ZERO_ONE,
            "var_freeze_step": 1,
            "local_step_scaler": 1,
            "local_step_clipper": 2,
        },
    },
    "onebit_lamb_compressed": {
        "zero": {"stage": 0},
        "optimizer": {**LAMB, "freeze_step": 1},
        "scheduler": SCHED,
    },
    "onebit_adam_compressed": {
        "zero": {"stage": 0},
        "optimizer": {"type": "onebit_adam", "lr": 1e-2, "freeze_step": 1},
    },
    "bf16_masters": {
        "zero": {"stage": 3},
        "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32", "master_dtype": "bf16"},
        "optimizer": {"lr": 1e-2},
        "scheduler": SCHED,
    },
}
WARM_CASES: dict[str, dict[str, Any]] = {
    # Saved at step 2 of 0/1 Adam's variance phase (steps 1, 2 and 4 average in fp32,
    # step 3 exchanges compressed gradients), frozen from step 4 on.
    "zero_one_adam_warm": {
        "zero": {"stage": 0},
        "optimizer": {**ZERO_ONE, "var_freeze_step": 3},
        "scheduler": SCHED,
    },
    "onebit_lamb_warm": {"zero": {"stage": 0}, "optimizer": {**LAMB, "freeze_step": 3}},
}


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def _check_resume(cases: dict[str, dict[str, Any]], root: str) -> None:
    first = run_ranks(ckpt_bodies.resume_first_body, 2, (cases, root, STEPS, AT))
    second = run_ranks(ckpt_bodies.resume_second_body, 2, (cases, root, STEPS, AT))
    for case in cases:
        for rank in range(2):
            a, b = first[rank][case], second[rank][case]
            assert a["saving_losses"] == a["full_losses"], case
            assert not _differ(a["saving_final"]["state"], a["reference"]["state"]), case
            assert b["losses"] == a["full_losses"][AT:], case
            assert not _differ(b["final"]["state"], a["reference"]["state"]), case
            for key in ("global_steps", "micro_steps", "lr", "sched"):
                assert b["final"][key] == a["reference"][key], (case, key)


def test_resume_after_the_compressed_phase_starts_is_bitwise_equal(tmp_path: Any) -> None:
    _check_resume(CASES, str(tmp_path))


@pytest.mark.slow
def test_resume_before_the_compressed_phase_is_bitwise_equal(tmp_path: Any) -> None:
    """The default-tier twin is the test above (saved after the freeze)."""
    _check_resume(WARM_CASES, str(tmp_path))
