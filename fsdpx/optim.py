"""Building the optimizer named in the config."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as torch_adam
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from fsdpx.config import OptimizerConfig
from fsdpx.ops import adam_step, load_ops


def build_optimizer(
    params: Iterable[torch.nn.Parameter],
    cfg: OptimizerConfig,
    *,
    dp_group: dist.ProcessGroup | None = None,
) -> torch.optim.Optimizer:
    """The optimizer `cfg.type` over `params`, with torch's fastest implementation for the
    parameters' device (fused on CUDA, foreach on CPU where fused is not available).
    `dp_group` is the data-parallel group onebit_adam exchanges over (default: the world).

    Example::

        opt = build_optimizer(model.parameters(), OptimizerConfig(type="adamw", lr=3e-4))
    """
    params = list(params)
    if cfg.type == "adamw":
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    if cfg.type == "adam":
        return torch.optim.Adam(
            params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    if cfg.type == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    if cfg.type == "onebit_adam":
        from fsdpx.onebit_adam import OneBitAdam

        return OneBitAdam(
            params,
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            freeze_step=cfg.freeze_step,
            bias_correction=cfg.bias_correction,
            group=dp_group,
        )
    raise AssertionError(f"unhandled optimizer type {cfg.type!r}")  # config validated it


def adamw_defaults(
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled_weight_decay: bool,
) -> dict[str, Any]:
    """Checked hyperparameters of an AdamW param group (shared by AdamW and
    fsdpx.offload.OffloadedAdamW, whose state dicts have the same layout).

    Example::

        super().__init__(params, adamw_defaults(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, ...))
    """
    if not lr >= 0.0:
        raise ValueError(f"AdamW: lr must be >= 0, got {lr}")
    if not eps >= 0.0:
        raise ValueError(f"AdamW: eps must be >= 0, got {eps}")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"AdamW: betas must each be in [0, 1), got {betas}")
    if not weight_decay >= 0.0:
        raise ValueError(f"AdamW: weight_decay must be >= 0, got {weight_decay}")
    return dict(
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
        decoupled_weight_decay=decoupled_weight_decay,
    )


class AdamW(torch.optim.Optimizer):
    """AdamW (or Adam with `decoupled_weight_decay=False`) whose CPU fp32 parameters, plain or
    sharded DTensors (updated on their local shards), are stepped by the fused native
    `fsdpx.ops.adam_step`: one memory pass, OpenMP-parallel. Every other parameter (GPU,
    16-bit, non-contiguous, a gradient sharded unlike its parameter), and every CPU parameter
    when the native library is unavailable, goes through torch's own fused Adam.

    The state has torch.optim.AdamW's layout (`step` as a 0-dim fp32 tensor on the parameter's
    device, `exp_avg`, `exp_avg_sq`, and `max_exp_avg_sq` with amsgrad), so state dicts load
    both ways. Results agree with torch.optim.AdamW to fp32 rounding (the formula order is in
    fsdpx/ops/adam.py), not bit for bit.

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr, betas, eps, weight_decay, amsgrad, maximize: as in torch.optim.AdamW.
        decoupled_weight_decay: True (AdamW); False gives Adam's L2 penalty.

    Example::

        opt = AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool = True,
    ) -> None:
        defaults = adamw_defaults(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # A state dict saved by torch.optim.AdamW/Adam holds more keys (foreach, fused, ...),
        # which are kept and ignored; these ones must exist.
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("decoupled_weight_decay", True)

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
        native = load_ops().available
        for group in self.param_groups:
            fused: _Lists = _Lists()
            torch_side: _Lists = _Lists()
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(
                        "AdamW: sparse gradients are not supported; use torch.optim.SparseAdam"
                    )
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group["amsgrad"]:
                        state["max_exp_avg_sq"] = torch.zeros_like(
                            p, memory_format=torch.preserve_format
                        )
                on_native = native and _native_fits(p, p.grad, state, group["amsgrad"])
                (fused if on_native else torch_side).add(p, state, group["amsgrad"])
            if fused.params:
                self._native_step(group, fused)
            if torch_side.params:
                self._torch_step(group, torch_side)
        return loss

    def _native_step(self, group: dict[str, Any], lists: _Lists) -> None:
        beta1, beta2 = group["betas"]
        # Normally every parameter is at the same step; one call per distinct step otherwise
        # (e.g. a parameter that had no gradient for a while).
        by_step: dict[int, list[int]] = {}
        for i, step_t in enumerate(lists.steps):
            step_t += 1
            by_step.setdefault(int(step_t.item()), []).append(i)
        for step, idx in by_step.items():
            adam_step(
                [lists.params[i] for i in idx],
                [lists.grads[i] for i in idx],
                [lists.exp_avgs[i] for i in idx],
                [lists.exp_avg_sqs[i] for i in idx],
                max_exp_avg_sqs=[lists.max_exp_avg_sqs[i] for i in idx]
                if group["amsgrad"]
                else None,
                lr=float(group["lr"]),
                step=step,
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                decoupled_weight_decay=group["decoupled_weight_decay"],
                maximize=group["maximize"],
            )

    def _torch_step(self, group: dict[str, Any], lists: _Lists) -> None:
        beta1, beta2 = group["betas"]
        devices = {p.device.type for p in lists.params}
        supported = set(_get_fused_kernels_supported_devices())
        fused = devices <= supported and all(
            p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in lists.params
        )
        for step_t, p in zip(lists.steps, lists.params, strict=True):
            if fused and step_t.device != p.device:  # fused wants the step on the param's device
                step_t.data = step_t.data.to(p.device)
        torch_adam(
            lists.params,
            lists.grads,
            lists.exp_avgs,
            lists.exp_avg_sqs,
            lists.max_exp_avg_sqs,
            lists.steps,
            fused=fused or None,
            foreach=None if fused else False,
            decoupled_weight_decay=group["decoupled_weight_decay"],
            amsgrad=group["amsgrad"],
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
        )


class _Lists:
    """The per-parameter tensors of one step, in parameter order."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.exp_avgs: list[torch.Tensor] = []
        self.exp_avg_sqs: list[torch.Tensor] = []
        self.max_exp_avg_sqs: list[torch.Tensor] = []
        self.steps: list[torch.Tensor] = []

    def add(self, p: torch.Tensor, state: dict[str, Any], amsgrad: bool) -> None:
        assert p.grad is not None
        self.params.append(p)
        self.grads.append(p.grad)
        self.exp_avgs.append(state["exp_avg"])
        self.exp_avg_sqs.append(state["exp_avg_sq"])
        if amsgrad:
            self.max_exp_avg_sqs.append(state["max_exp_avg_sq"])
        self.steps.append(state["step"])


def _native_fits(p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], amsgrad: bool) -> bool:
    """Whether adam_step can update `p` in place: fp32 on CPU, contiguous local tensors, and a
    gradient and state laid out like the parameter (the same DTensor placements)."""
    tensors = [p, grad, state["exp_avg"], state["exp_avg_sq"]]
    if amsgrad:
        tensors.append(state["max_exp_avg_sq"])
    if isinstance(p, DTensor):
        if not all(
            isinstance(t, DTensor)
            and t.device_mesh == p.device_mesh
            and t.placements == p.placements
            for t in tensors
        ):
            return False
        tensors = [t.to_local() for t in tensors]  # type: ignore[attr-defined]
    elif any(isinstance(t, DTensor) for t in tensors):
        return False
    local_p, local_g = tensors[0], tensors[1]
    return (
        local_p.device.type == "cpu"
        and local_p.dtype == torch.float32
        and local_g.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and all(t.is_contiguous() and t.shape == local_p.shape for t in tensors)
        and all(t.dtype == torch.float32 for t in tensors[2:])
    )
