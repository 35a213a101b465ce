"""`deepspeed.ops.lamb`: `FusedLamb` with DeepSpeed's arguments, as `fsdpx.lamb.Lamb` (the
fused native CPU step, its pure-PyTorch twin on the GPU).

`max_grad_norm` is refused: DeepSpeed's FusedLamb clips only with grad_norms passed to
`step()`, which its engine never passes; use the config's gradient_clipping.
"""

from collections.abc import Iterable as _Iterable
from typing import Any as _Any

import torch as _torch

from fsdpx.lamb import Lamb as _Lamb


class FusedLamb(_Lamb):
    """DeepSpeed's FusedLamb (`get_lamb_coeffs()` included)."""

    def __init__(
        self,
        params: _Iterable[_torch.Tensor] | _Iterable[dict[str, _Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedLamb does not support the AMSGrad variant.")  # DeepSpeed's
        if max_grad_norm > 0:
            raise ValueError(
                f"FusedLamb(max_grad_norm={max_grad_norm}) is not supported: DeepSpeed's clips "
                "only with grad_norms passed to step(); clip with the config's "
                "gradient_clipping (or torch.nn.utils.clip_grad_norm_) and leave max_grad_norm 0"
            )
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            bias_correction=bias_correction,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            eps_inside_sqrt=eps_inside_sqrt,
        )


__all__ = ["FusedLamb"]
