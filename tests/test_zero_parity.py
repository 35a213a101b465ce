"""Every ZeRO stage, HSDP and hpZ, with and without accumulation, equals a single-process
reference on the same global batches (DESIGN.md section 7)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist import run_ranks
from tests.parity import LR, reference_run, sweep_body


def _cfg(stage: int, gas: int, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "gradient_accumulation_steps": gas,
        "zero": {"stage": stage},
        "optimizer": {"type": "adamw", "lr": LR, "weight_decay": 0.1},
    }
    for key, value in extra.items():
        cfg.setdefault(key, {}).update(value) if isinstance(value, dict) else cfg.update(
            {key: value}
        )
    return cfg


def _check(
    results: list[dict[str, Any]], cases: dict[str, dict[str, Any]], dp: int, **tol: Any
) -> dict[str, float]:
    diffs = {}
    for name, cfg in cases.items():
        dtype = (
            torch.bfloat16
            if cfg.get("precision", {}).get("param_dtype") == "bf16"
            else torch.float32
        )
        ref_losses, ref_params = reference_run(cfg, dp, compute_dtype=dtype)
        for rank_result in results:
            losses, params = rank_result[name]
            torch.testing.assert_close(
                torch.tensor(losses),
                torch.tensor(ref_losses),
                **tol,
                msg=lambda m, n=name: f"{n} losses: {m}",
            )
            for pname, ref in ref_params.items():
                torch.testing.assert_close(
                    params[pname], ref, **tol, msg=lambda m, n=name, p=pname: f"{n} {p}: {m}"
                )
        diffs[name] = max(
            float((results[0][name][1][p] - r).abs().max()) for p, r in ref_params.items()
        )
    return diffs


CASES_2 = {f"stage{s}_gas{g}": _cfg(s, g) for s in (0, 1, 2, 3) for g in (1, 2)}


def test_stages_match_single_process_reference() -> None:
    results = run_ranks(sweep_body, 2, (CASES_2,))
    diffs = _check(results, CASES_2, dp=2)
    print("max abs param diff vs reference:", diffs)


CASES_4 = {
    f"{name}_gas{g}": _cfg(3, g, **extra)
    for name, extra in {
        "hsdp2x2": {"mesh": {"dp_replicate": 2, "dp_shard": 2}},
        "hpz2": {"zero": {"stage": 3, "hpz_partition_size": 2}},
    }.items()
    for g in (1, 2)
}


def test_hsdp_and_hpz_match_single_process_reference() -> None:
    results = run_ranks(sweep_body, 4, (CASES_4,))
    diffs = _check(results, CASES_4, dp=4)
    print("max abs param diff vs reference:", diffs)


CASES_BF16 = {
    f"bf16_stage{s}": _cfg(s, 2, precision={"param_dtype": "bf16", "reduce_dtype": "fp32"})
    for s in (2, 3)
}


def test_bf16_params_fp32_reduce_match_emulated_reference() -> None:
    results = run_ranks(sweep_body, 2, (CASES_BF16,))
    diffs = _check(results, CASES_BF16, dp=2, rtol=1.6e-2, atol=1e-5)
    print("max abs param diff vs emulated bf16 reference:", diffs)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_plan_table(stage: int) -> None:
    from fsdpx.config import ZeroConfig
    from fsdpx.zero import stage_plan

    plan = stage_plan(ZeroConfig(stage=stage))
    assert plan.block_reshard_after_forward is (stage == 3)
    assert plan.sync_grads_every_micro_step is (stage >= 2)
    assert stage_plan(ZeroConfig(stage=3, hpz_partition_size=2)).block_reshard_after_forward == 2
