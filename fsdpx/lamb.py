"""`Lamb`: DeepSpeed's Lamb optimizer (`"optimizer": {"type": "Lamb"}`, FusedLamb).

Adam moments, an update u = m / (sqrt(v) + eps) + weight_decay * p, and a per-tensor step
lr * coeff with the trust ratio coeff = clamp(||p|| / ||u||, min_coeff, max_coeff) (1 when
either norm is 0); bias correction folds into the step size, as DeepSpeed's kernel does. The
step is `fsdpx.ops.lamb_step` (formula and pass structure there): the fused native kernel for
CPU fp32 tensors, its pure-PyTorch twin on the GPU or without the native library. Sharded
(DTensor) parameters get the trust ratio of the whole tensor, so every ZeRO stage and layout
trains what one process would.

The state has the layout of DeepSpeed's FusedLamb (`step`, `exp_avg`, `exp_avg_sq`; `step`
as a 0-dim fp32 tensor here, like fsdpx's AdamW), and `get_lamb_coeffs()` returns the last
step's trust ratios as DeepSpeed's does.

Example::

    opt = Lamb(model.parameters(), lr=1e-3, weight_decay=0.01)
    loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from fsdpx.ops.lamb import lamb_step


class Lamb(torch.optim.Optimizer):
    """DeepSpeed's Lamb (see the module docstring).

    Args:
        params: parameters or parameter groups, as for any torch optimizer; fp32.
        lr, betas, eps, weight_decay, bias_correction: as in DeepSpeed's FusedLamb.
        max_coeff, min_coeff: the trust ratio's clamp (DeepSpeed's defaults 10 and 0.01).
        eps_inside_sqrt: add eps under the square root (DeepSpeed's eps_inside_sqrt).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        bias_correction: bool = True,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        eps_inside_sqrt: bool = False,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Lamb: lr must be >= 0, got {lr}")
        if not eps >= 0.0:
            raise ValueError(f"Lamb: eps must be >= 0, got {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lamb: betas must each be in [0, 1), got {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Lamb: weight_decay must be >= 0, got {weight_decay}")
        if not 0.0 < min_coeff <= max_coeff:
            raise ValueError(
                f"Lamb: need 0 < min_coeff <= max_coeff (the trust ratio's clamp); got "
                f"min_coeff={min_coeff}, max_coeff={max_coeff}"
            )
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            eps_inside_sqrt=eps_inside_sqrt,
        )
        super().__init__(params, defaults)
        self.lamb_coeffs: list[torch.Tensor] = []

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios of the last step, one per stepped parameter (DeepSpeed's)."""
        return [float(c) for c in self.lamb_coeffs]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step over every parameter that has a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (optional).
        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        for group in self.param_groups:
            # One lamb_step per (device, step number): normally one call per group.
            batches: dict[tuple[torch.device, int], list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("Lamb: sparse gradients are not supported")
                if p.dtype != torch.float32:
                    raise ValueError(
                        f"Lamb: parameters must be fp32 (the master weights); got {p.dtype}. "
                        "Keep fp32 parameters and train in bf16 with mixed precision"
                    )
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                batches.setdefault((p.device, int(state["step"].item())), []).append(p)
            beta1, beta2 = group["betas"]
            for (_, step), params in batches.items():
                coeffs = lamb_step(
                    params,
                    [p.grad for p in params],  # type: ignore[misc]
                    [self.state[p]["exp_avg"] for p in params],
                    [self.state[p]["exp_avg_sq"] for p in params],
                    lr=float(group["lr"]),
                    step=step,
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    max_coeff=group["max_coeff"],
                    min_coeff=group["min_coeff"],
                    bias_correction=group["bias_correction"],
                    eps_inside_sqrt=group["eps_inside_sqrt"],
                )
                self.lamb_coeffs.extend(coeffs.unbind())
        return loss
