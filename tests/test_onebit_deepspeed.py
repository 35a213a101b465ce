"""DeepSpeed's 1-bit optimizer configs through Config.from_deepspeed: OneBitAdam and its
parameters are mapped, ZeroOneAdam / OneBitLamb refused with the reason."""

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


@pytest.mark.parametrize(
    ("opt_type", "params", "name"),
    [
        ("ZeroOneAdam", {"var_freeze_step": 100, "local_step_scaler": 10}, "0/1 Adam"),
        ("OneBitLamb", {"freeze_step": 10, "max_coeff": 0.3, "factor_max": 4.0}, "1-bit Lamb"),
    ],
)
def test_unbuilt_onebit_optimizers_are_refused_with_the_reason(
    opt_type: str, params: dict[str, Any], name: str
) -> None:
    with pytest.raises(ValueError, match=f"{name} .* is not implemented in fsdpx"):
        Config.from_deepspeed(_ds(opt_type, **params), world_size=2)
    rows = {r.key: r for r in explain(_ds(opt_type, **params), world_size=2)[0]}
    for key in params:
        if key != "freeze_step":
            assert rows[f"optimizer.params.{key}"].status == "refused"
            assert "0/1 Adam / 1-bit Lamb" in rows[f"optimizer.params.{key}"].detail


def test_freeze_step_with_adam_is_an_error() -> None:
    with pytest.raises(ValueError, match="freeze_step"):
        Config.from_deepspeed(_ds("Adam", freeze_step=10), world_size=2)
