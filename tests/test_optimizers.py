"""The optimizer registry (fsdpx/optimizers.py) and its readers agree."""

from __future__ import annotations

import typing

import pytest
import torch

from fsdpx.config import OptimizerConfig
from fsdpx.deepspeed._keys import DS_KEYS, OPTIMIZER_TYPES
from fsdpx.lamb import Lamb
from fsdpx.optim import build_optimizer
from fsdpx.optimizers import OPTIMIZER_PARAM_KEYS, OPTIMIZERS


def test_config_literal_lists_the_registry() -> None:
    hints = typing.get_type_hints(OptimizerConfig)
    assert set(typing.get_args(hints["type"])) == set(OPTIMIZERS)


@pytest.mark.parametrize(
    ("kind", "cls"),
    [
        ("adamw", torch.optim.AdamW),
        ("adam", torch.optim.Adam),
        ("sgd", torch.optim.SGD),
        ("lamb", Lamb),
    ],
)
def test_build_optimizer_uses_the_row(kind: str, cls: type) -> None:
    p = torch.nn.Parameter(torch.ones(3))
    extra = {"momentum": 0.9} if kind == "sgd" else {"betas": (0.8, 0.9)}
    cfg = OptimizerConfig(type=kind, lr=0.5, weight_decay=0.1, **extra)  # type: ignore[arg-type]
    opt = build_optimizer([p], cfg)
    assert type(opt) is cls
    group = opt.param_groups[0]
    # bias_correction picks the class (True: torch's), it is not a torch group key.
    for key in OPTIMIZERS[kind].keys - {"bias_correction"}:
        assert group[key] == getattr(cfg, key), key


@pytest.mark.parametrize("kind", ["adamw", "adam"])
def test_no_bias_correction_builds_the_fused_adam(kind: str) -> None:
    from fsdpx.optim import AdamW

    cfg = OptimizerConfig(type=kind, bias_correction=False)  # type: ignore[arg-type]
    opt = build_optimizer([torch.nn.Parameter(torch.ones(3))], cfg)
    assert type(opt) is AdamW and opt.param_groups[0]["bias_correction"] is False
    assert opt.param_groups[0]["decoupled_weight_decay"] is (kind == "adamw")


def test_state_bytes_match_a_real_step() -> None:
    # The formula estimator's bytes are those torch's optimizer really allocates.
    for kind, extra in (
        ("adamw", {}),
        ("adam", {}),
        ("sgd", {"momentum": 0.9}),
        ("sgd", {}),
        ("lamb", {}),
    ):
        params = [torch.nn.Parameter(torch.ones(5, 3)), torch.nn.Parameter(torch.ones(7))]
        cfg = OptimizerConfig(type=kind, **extra)  # type: ignore[arg-type]
        opt = build_optimizer(params, cfg)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        real = sum(
            t.numel() * t.element_size()
            for s in opt.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )
        local = sum(p.numel() * p.element_size() for p in params)
        assert OPTIMIZERS[kind].state_bytes(cfg, local, len(params)) == real, (kind, extra)


def test_deepspeed_table_reads_the_registry() -> None:
    assert dict(OPTIMIZER_TYPES) == {
        "adam": "adamw",
        "adamw": "adamw",
        "sgd": "sgd",
        "onebitadam": "onebit_adam",
        "lamb": "lamb",
        "zerooneadam": "zero_one_adam",
        "onebitlamb": "onebit_lamb",
    }
    assert set(OPTIMIZER_PARAM_KEYS) == {
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "momentum",
        "bias_correction",
        "freeze_step",
        "max_coeff",
        "min_coeff",
        "eps_inside_sqrt",
        "var_freeze_step",
        "var_update_scaler",
        "local_step_scaler",
        "local_step_clipper",
        "coeff_beta",
        "factor_max",
        "factor_min",
        "factor_threshold",
    }
    for key in OPTIMIZER_PARAM_KEYS:
        assert DS_KEYS[f"optimizer.params.{key}"].target == f"optimizer.{key}"


def test_unread_key_names_the_registry_keys() -> None:
    with pytest.raises(ValueError, match=r"'optimizer.momentum' \(0.9\) set, but optimizer.type"):
        OptimizerConfig(type="adamw", momentum=0.9)
