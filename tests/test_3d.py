"""Tensor x pipeline (x data) parallelism on one mesh equals a single process: gradients,
grad norms (clipped per mesh, summed over pp), losses and parameters after AdamW steps."""

from __future__ import annotations

import pytest

from tests import tp_bodies as tb
from tests.dist import run_ranks

TP_PP = {
    "tp2_pp2_1f1b": tb.base_cfg(2, mesh={"tp": 2, "pp": 2}),
    "tp2_pp2_sp_zbv": tb.base_cfg(
        4,
        mesh={"tp": 2, "pp": 2},
        tensor_parallel={"sequence_parallel": True},
        pipeline={"schedule": "ZBVZeroBubble", "stages_per_rank": 2},
    ),
}


def test_tp2_pp2_matches_single_process() -> None:
    results = run_ranks(tb.sweep_body, 4, (TP_PP,))
    for name, cfg in TP_PP.items():
        tb.check_against_reference(results, tb.reference(cfg, dp=1), name)


DP_TP_PP = {
    "dp2_tp2_pp2_interleaved_sp": tb.base_cfg(
        4,
        mesh={"tp": 2, "pp": 2},
        tensor_parallel={"sequence_parallel": True},
        pipeline={"schedule": "Interleaved1F1B", "stages_per_rank": 2},
    ),
}


@pytest.mark.slow
def test_dp2_tp2_pp2_on_8_ranks_matches_single_process() -> None:
    results = run_ranks(tb.sweep_body, 8, (DP_TP_PP,), timeout_s=900)
    for name, cfg in DP_TP_PP.items():
        tb.check_against_reference(results, tb.reference(cfg, dp=2), name)
