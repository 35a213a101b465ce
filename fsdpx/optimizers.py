"""The optimizer registry: every `optimizer.type` fsdpx builds, in one table.

Each row says which OptimizerConfig keys the optimizer reads (config validation, and the
DeepSpeed key table's `optimizer.params.*` rows), how to build it (fsdpx.optim's
build_optimizer, and the measured estimator's fake run), how many bytes of state it keeps
per local shard (the formula estimator), which DeepSpeed type names map to it, and whether
the fused CPU Adam can run it under offload.

[Note: a torch-free registry] fsdpx.config validates keys against this table and stays
importable without torch (the DeepSpeed converter and the CLI's config checks use it), so
this module imports torch only inside the builders, when an optimizer is really built.

Example::

    spec = OPTIMIZERS["adamw"]
    opt = spec.build(list(model.parameters()), OptimizerConfig(type="adamw", lr=3e-4))
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from fsdpx.config import OptimizerConfig

_FP32 = 4


# Parameters, or parameter groups (dicts with "params" and per-group options), as any
# torch optimizer takes them.
ParamsOrGroups = list[Any]


@dataclass(frozen=True)
class OptimizerSpec:
    """One row of the registry (see the module docstring)."""

    keys: frozenset[str]
    """The OptimizerConfig fields it reads; any other set away from its default is an error."""
    build: Callable[[ParamsOrGroups, OptimizerConfig], torch.optim.Optimizer]
    """Builds torch's implementation over `params` (plain tensors, DTensors or fake ones)."""
    state_bytes: Callable[[OptimizerConfig, int, int], int]
    """(cfg, bytes of the local parameter shards, number of tensors) -> state bytes."""
    deepspeed_types: tuple[str, ...]
    """Lower-cased DeepSpeed `optimizer.type` names that become this type."""
    decoupled_weight_decay: bool | None
    """For Adam variants: whether weight decay is decoupled (AdamW); these are what the fused
    CPU Adam (fsdpx.optim.AdamW, offload) runs. None: not an Adam, cannot be offloaded."""


def _build_adam(
    decoupled: bool,
) -> Callable[[ParamsOrGroups, OptimizerConfig], torch.optim.Optimizer]:
    def build(params: ParamsOrGroups, cfg: OptimizerConfig) -> torch.optim.Optimizer:
        import torch

        if not cfg.bias_correction:
            # torch.optim has no bias_correction switch; the fused op has (fsdpx.optim.AdamW).
            from fsdpx.optim import AdamW

            return AdamW(
                params,
                lr=cfg.lr,
                betas=cfg.betas,
                eps=cfg.eps,
                weight_decay=cfg.weight_decay,
                decoupled_weight_decay=decoupled,
                bias_correction=False,
            )
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        return cls(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)

    return build


def _build_sgd(params: ParamsOrGroups, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    import torch

    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def _build_onebit_adam(params: ParamsOrGroups, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    from fsdpx.onebit_adam import OneBitAdam

    # Its exchange group is the world: onebit_adam runs at ZeRO stage 0 with tp = pp = 1
    # only (checked by the config), where the data-parallel group is the world.
    return OneBitAdam(
        params,
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        freeze_step=cfg.freeze_step,
        bias_correction=cfg.bias_correction,
    )


def _build_lamb(params: ParamsOrGroups, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    from fsdpx.lamb import Lamb

    return Lamb(
        params,
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        bias_correction=cfg.bias_correction,
        max_coeff=cfg.max_coeff,
        min_coeff=cfg.min_coeff,
        eps_inside_sqrt=cfg.eps_inside_sqrt,
    )


def _build_zero_one_adam(params: ParamsOrGroups, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    from fsdpx.zero_one_adam import ZeroOneAdam

    # Like onebit_adam: ZeRO stage 0 with tp = pp = 1 only, where the data-parallel group is
    # the world.
    return ZeroOneAdam(
        params,
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        bias_correction=cfg.bias_correction,
        var_freeze_step=cfg.var_freeze_step,
        var_update_scaler=cfg.var_update_scaler,
        local_step_scaler=cfg.local_step_scaler,
        local_step_clipper=cfg.local_step_clipper,
    )


def _build_onebit_lamb(params: ParamsOrGroups, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    from fsdpx.onebit_lamb import OneBitLamb

    # Like onebit_adam: ZeRO stage 0 with tp = pp = 1 only (the data-parallel group is the
    # world).
    return OneBitLamb(
        params,
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        max_coeff=cfg.max_coeff,
        min_coeff=cfg.min_coeff,
        freeze_step=cfg.freeze_step,
        coeff_beta=cfg.coeff_beta,
        factor_max=cfg.factor_max,
        factor_min=cfg.factor_min,
        factor_threshold=cfg.factor_threshold,
    )


def _zero_one_state_bytes(cfg: OptimizerConfig, local_bytes: int, tensors: int) -> int:
    # exp_avg, exp_avg_sq, momentum_accumulator; the schedule's ints are not tensors.
    return 3 * local_bytes


def _adam_state_bytes(cfg: OptimizerConfig, local_bytes: int, tensors: int) -> int:
    return 2 * local_bytes + _FP32 * tensors  # exp_avg, exp_avg_sq; fp32 `step` per tensor


def _sgd_state_bytes(cfg: OptimizerConfig, local_bytes: int, tensors: int) -> int:
    return local_bytes if cfg.momentum > 0 else 0  # momentum_buffer, only with momentum


_ADAM_KEYS = frozenset({"lr", "betas", "eps", "weight_decay", "bias_correction"})

OPTIMIZERS: Mapping[str, OptimizerSpec] = types.MappingProxyType(
    {
        "adamw": OptimizerSpec(
            keys=_ADAM_KEYS,
            build=_build_adam(decoupled=True),
            state_bytes=_adam_state_bytes,
            deepspeed_types=("adam", "adamw"),
            decoupled_weight_decay=True,
        ),
        "adam": OptimizerSpec(
            keys=_ADAM_KEYS,
            build=_build_adam(decoupled=False),
            state_bytes=_adam_state_bytes,
            # Reached from DeepSpeed's Adam with params.adam_w_mode false (deepspeed_config).
            deepspeed_types=(),
            decoupled_weight_decay=False,
        ),
        "sgd": OptimizerSpec(
            keys=frozenset({"lr", "momentum", "weight_decay"}),
            build=_build_sgd,
            state_bytes=_sgd_state_bytes,
            deepspeed_types=("sgd",),
            decoupled_weight_decay=None,
        ),
        "onebit_adam": OptimizerSpec(
            keys=frozenset(
                {"lr", "betas", "eps", "weight_decay", "freeze_step", "bias_correction"}
            ),
            build=_build_onebit_adam,
            # exp_avg, exp_avg_sq and step as Adam's (the error-feedback buffers are not
            # optimizer state: fsdpx/onebit_adam.py).
            state_bytes=_adam_state_bytes,
            deepspeed_types=("onebitadam",),
            decoupled_weight_decay=None,
        ),
        "lamb": OptimizerSpec(
            keys=_ADAM_KEYS | {"max_coeff", "min_coeff", "eps_inside_sqrt"},
            build=_build_lamb,
            state_bytes=_adam_state_bytes,  # exp_avg, exp_avg_sq and step, as Adam's
            deepspeed_types=("lamb",),
            decoupled_weight_decay=None,
        ),
        "zero_one_adam": OptimizerSpec(
            keys=frozenset(
                {
                    "lr",
                    "betas",
                    "eps",
                    "weight_decay",
                    "bias_correction",
                    "var_freeze_step",
                    "var_update_scaler",
                    "local_step_scaler",
                    "local_step_clipper",
                }
            ),
            build=_build_zero_one_adam,
            state_bytes=_zero_one_state_bytes,
            deepspeed_types=("zerooneadam",),
            decoupled_weight_decay=None,
        ),
        "onebit_lamb": OptimizerSpec(
            keys=frozenset(
                {
                    "lr",
                    "betas",
                    "eps",
                    "weight_decay",
                    "bias_correction",
                    "max_coeff",
                    "min_coeff",
                    "freeze_step",
                    "coeff_beta",
                    "factor_max",
                    "factor_min",
                    "factor_threshold",
                }
            ),
            build=_build_onebit_lamb,
            # exp_avg, exp_avg_sq, exp_avg_sq_fresh (the ints and floats are not tensors).
            state_bytes=_zero_one_state_bytes,
            deepspeed_types=("onebitlamb",),
            decoupled_weight_decay=None,
        ),
    }
)
"""optimizer.type -> its OptimizerSpec. Adding an optimizer is one row here (plus its name
in OptimizerConfig.type's Literal, which tests/test_config.py checks against this table)."""

EXCHANGING_OPTIMIZERS = frozenset({"onebit_adam", "zero_one_adam", "onebit_lamb"})
"""Types that exchange gradients themselves (compressed): fsdpx.shard builds full replicas
with no FSDP gradient collective and calls the optimizer's `attach(model)`."""

OPTIMIZER_KEYS: Mapping[str, frozenset[str]] = types.MappingProxyType(
    {name: spec.keys for name, spec in OPTIMIZERS.items()}
)
"""optimizer.type -> the OptimizerConfig fields it reads (for config validation)."""

OPTIMIZER_PARAM_KEYS: tuple[str, ...] = tuple(
    dict.fromkeys(key for spec in OPTIMIZERS.values() for key in sorted(spec.keys))
)
"""Every OptimizerConfig field some optimizer reads (DeepSpeed's `optimizer.params.<key>`
rows in fsdpx.deepspeed._keys)."""
