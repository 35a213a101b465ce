"""`deepspeed.ops.adam`: `FusedAdam` and `DeepSpeedCPUAdam` with DeepSpeed's arguments, as
`fsdpx.optim.AdamW` (the fused native CPU step, torch's fused step on the GPU).

`adam_w_mode`/`adamw_mode` choose decoupled weight decay (AdamW, the default) or Adam's L2
penalty; `bias_correction=False` drops Adam's bias correction (fsdpx.optim.AdamW runs such a
group through `fsdpx.ops.adam_step` on every device).
"""

from collections.abc import Iterable as _Iterable
from typing import Any as _Any

import torch as _torch

from fsdpx.optim import AdamW as _AdamW


def _check(amsgrad: bool, name: str) -> None:
    if amsgrad and name == "FusedAdam":
        raise RuntimeError("FusedAdam does not support the AMSGrad variant.")  # DeepSpeed's


class FusedAdam(_AdamW):
    """DeepSpeed's FusedAdam."""

    def __init__(
        self,
        params: _Iterable[_torch.Tensor] | _Iterable[dict[str, _Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        _check(amsgrad, "FusedAdam")
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            decoupled_weight_decay=adam_w_mode,
            bias_correction=bias_correction,
        )


class DeepSpeedCPUAdam(_AdamW):
    """DeepSpeed's DeepSpeedCPUAdam (the same fused CPU step fsdpx's offload runs)."""

    def __init__(
        self,
        model_params: _Iterable[_torch.Tensor] | _Iterable[dict[str, _Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        _check(amsgrad, "DeepSpeedCPUAdam")
        if not fp32_optimizer_states:
            raise NotImplementedError(
                "DeepSpeedCPUAdam(fp32_optimizer_states=False) (16-bit moments) is not "
                "implemented; use the default True"
            )
        super().__init__(
            model_params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            decoupled_weight_decay=adamw_mode,
            bias_correction=bias_correction,
        )


__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
