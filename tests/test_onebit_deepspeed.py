"""DeepSpeed's 1-bit optimizer configs through Config.from_deepspeed: OneBitAdam and its
parameters are mapped, and so are OneBitLamb's (ZeroOneAdam's: tests/test_zero_one_adam.py)."""

from __future__ import annotations

from typing import Any

import pytest

from fsdpx.config import Config
from fsdpx.deepspeed._config import explain


def _ds(opt_type: str, **params: Any) -> dict[str, Any]:
    # The shape of DeepSpeed's BERT 1-bit Adam example configs.
    return {
        "train_batch_size": 4,
        "optimizer": {"type": opt_type, "params": {"lr": 1e-3, **params}},
    }


def test_onebit_adam_config_maps_onto_onebit_adam() -> None:
    cfg = Config.from_deepspeed(
        _ds(
            "OneBitAdam",
            weight_decay=0.01,
            bias_correction=False,
            freeze_step=400,
            cuda_aware=False,
            comm_backend_name="nccl",
        ),
        world_size=2,
    )
    assert cfg.optimizer.type == "onebit_adam"
    assert cfg.optimizer.freeze_step == 400
    assert cfg.optimizer.bias_correction is False
    assert cfg.optimizer.weight_decay == 0.01
    assert cfg.zero.stage == 0  # DeepSpeed's default without a zero_optimization block


def test_onebit_adam_rows_say_what_happens() -> None:
    data = _ds("OneBitAdam", freeze_step=10, cuda_aware=True, comm_backend_name="mpi")
    rows = {r.key: r for r in explain(data, world_size=2)[0]}
    assert rows["optimizer.params.freeze_step"].status == "mapped"
    assert rows["optimizer.params.cuda_aware"].status == "ignored"
    assert "CUDA-aware MPI" in rows["optimizer.params.cuda_aware"].detail
    assert rows["optimizer.params.comm_backend_name"].status == "ignored"
    assert "never applied" in rows["optimizer.params.bias_correction"].detail


def test_onebit_adam_needs_stage_0() -> None:
    data = {**_ds("OneBitAdam", freeze_step=10), "zero_optimization": {"stage": 2}}
    with pytest.raises(ValueError, match="needs zero.stage = 0; got 2"):
        Config.from_deepspeed(data, world_size=2)


def test_onebit_lamb_config_maps_onto_onebit_lamb() -> None:
    # The shape of DeepSpeed's BERT 1-bit Lamb example config.
    params = dict(
        weight_decay=0.01,
        bias_correction=False,
        max_coeff=0.3,
        min_coeff=0.01,
        freeze_step=1000,
        cuda_aware=False,
        comm_backend_name="nccl",
        coeff_beta=0.9,
        factor_max=4.0,
        factor_min=0.5,
        factor_threshold=0.1,
    )
    cfg = Config.from_deepspeed(_ds("OneBitLamb", **params), world_size=2)
    o = cfg.optimizer
    assert (o.type, o.freeze_step, o.max_coeff, o.coeff_beta) == ("onebit_lamb", 1000, 0.3, 0.9)
    assert (o.factor_max, o.factor_min, o.factor_threshold) == (4.0, 0.5, 0.1)
    assert o.bias_correction is False and cfg.zero.stage == 0
    rows = {r.key: r for r in explain(_ds("OneBitLamb", freeze_step=5), world_size=2)[0]}
    assert "never applies it" in rows["optimizer.params.bias_correction"].detail


def test_freeze_step_with_adam_is_an_error() -> None:
    with pytest.raises(ValueError, match="freeze_step"):
        Config.from_deepspeed(_ds("Adam", freeze_step=10), world_size=2)
