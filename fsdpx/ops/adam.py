"""`adam_step`: fused Adam/AdamW over lists of fp32 params and moments, in one memory pass.

One call updates every tensor in place and can, in the same pass: unscale the gradients
(`inv_grad_scale`), read them in bf16/fp16, and write a bf16/fp16 copy of the new params
into `param_copies` (round to nearest even, the bits of `param.to(torch.bfloat16)`). With
`check_finite=True` it first reads every gradient; if any `grad * inv_grad_scale` is inf or
NaN it writes nothing and returns True. Native kernels: fsdpx/ops/csrc/adam.cpp (CPU) and
csrc/cuda/adam.cu (CUDA); without them the pure-PyTorch reference below runs, bitwise equal.

[Note: the Adam formula order]
Scalars are computed in double (Python floats) and rounded to fp32 once each:
grad_scale = inv_grad_scale (negated for maximize), decay = 1 - lr * weight_decay (AdamW;
1 for Adam), step_size = lr / (1 - beta1**step), inv_bc2_sqrt = 1 / sqrt(1 - beta2**step),
and 1 - beta1, 1 - beta2. With bias_correction=False (DeepSpeed FusedAdam's
``bias_correction=False``; torch has no such option) both corrections are 1: step_size = lr
and inv_bc2_sqrt = 1, so step 7 is exactly sqrt(v_hat) + eps. Then, per element, each operation rounded to
fp32 (no FMA):

    1  g = float(grad) * grad_scale
    2  g = g + p * weight_decay                        (Adam only: L2, when weight_decay != 0)
    3  p = p * decay
    4  m = m * beta1 + g * (1 - beta1)
    5  v = v * beta2 + (g * (1 - beta2)) * g
    6  vmax = maximum(vmax, v); v_hat = vmax          (amsgrad; else v_hat = v)
    7  denom = sqrt(v_hat) * inv_bc2_sqrt + eps
    8  p = p - (m * step_size) / denom
    9  copy = bf16/fp16(p)                             (round to nearest even)

Step 8 gives the bits of torch.optim.AdamW's `p.addcdiv_(m, denom, value=-step_size)`; torch
differs in step 4 (`m.lerp_(g, 1 - beta1)`), in step 7 (it divides by sqrt(1 - beta2**step),
a second division per element; multiplying by the reciprocal, as DeepSpeed does, took 8-20% off
the CPU time of a one-thread 50M-element step here) and in its sqrt (not correctly
rounded on CPU, see `_sqrt`). Results agree with torch to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from fsdpx.ops._loader import load_cuda_ops, load_ops

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
COPY_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class _Scalars:
    """The per-step scalars (Python floats: torch rounds each to fp32 when it meets an fp32
    tensor, exactly as adam_common.h's make_scalars does)."""

    grad_scale: float
    use_l2: bool
    weight_decay: float
    decay: float
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    step_size: float
    inv_bc2_sqrt: float
    eps: float


def _scalars(
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    decoupled_weight_decay: bool,
    maximize: bool,
    inv_grad_scale: float,
    bias_correction: bool = True,
) -> _Scalars:
    bc1 = 1.0 - math.pow(beta1, step) if bias_correction else 1.0
    bc2 = 1.0 - math.pow(beta2, step) if bias_correction else 1.0
    return _Scalars(
        # Negating before or after the rounding to fp32 gives the same bits (RNE is symmetric).
        grad_scale=-inv_grad_scale if maximize else inv_grad_scale,
        use_l2=not decoupled_weight_decay and weight_decay != 0.0,
        weight_decay=weight_decay,
        decay=1.0 - lr * weight_decay if decoupled_weight_decay else 1.0,
        beta1=beta1,
        one_minus_beta1=1.0 - beta1,
        beta2=beta2,
        one_minus_beta2=1.0 - beta2,
        step_size=lr / bc1,
        inv_bc2_sqrt=1.0 / math.sqrt(bc2),
        eps=eps,
    )


def adam_step_reference(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    max_exp_avg_sqs: Sequence[torch.Tensor],
    param_copies: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    decoupled_weight_decay: bool = True,
    maximize: bool = False,
    inv_grad_scale: float = 1.0,
    check_finite: bool = False,
    bias_correction: bool = True,
) -> torch.Tensor:
    """The pure-PyTorch definition of `adam_step` (same arguments as the op; plain local
    tensors on any device). Follows the order in [Note: the Adam formula order] line by line.

    Returns:
        A 0-dim bool tensor: True when check_finite found a non-finite gradient (nothing
        was written).
    """
    s = _scalars(
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        decoupled_weight_decay=decoupled_weight_decay,
        maximize=maximize,
        inv_grad_scale=inv_grad_scale,
        bias_correction=bias_correction,
    )
    device = params[0].device if params else torch.device("cpu")
    if check_finite:
        for grad in grads:
            if not bool(torch.isfinite(grad.float() * s.grad_scale).all()):
                return torch.ones((), dtype=torch.bool, device=device)
    for i, p in enumerate(params):
        m, v = exp_avgs[i], exp_avg_sqs[i]
        g = grad_f32 = grads[i].float() * s.grad_scale  # 1
        if s.use_l2:
            g = grad_f32 + p * s.weight_decay  # 2
        p.mul_(s.decay)  # 3
        m.mul_(s.beta1).add_(g * s.one_minus_beta1)  # 4
        v.mul_(s.beta2).add_((g * s.one_minus_beta2) * g)  # 5
        v_hat = v
        if max_exp_avg_sqs:
            torch.maximum(max_exp_avg_sqs[i], v, out=max_exp_avg_sqs[i])  # 6
            v_hat = max_exp_avg_sqs[i]
        denom = _sqrt(v_hat).mul_(s.inv_bc2_sqrt).add_(s.eps)  # 7
        p.sub_((m * s.step_size).div_(denom))  # 8
        if param_copies:
            param_copies[i].copy_(p)  # 9
    return torch.zeros((), dtype=torch.bool, device=device)


def _sqrt(t: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root. torch's own CPU `sqrt` is not: in torch 2.13
    about 16% of fp32 results are 1 ulp off (its vectorised math library), while the kernels
    use the IEEE instruction. Through fp64 the result is exact: a float's square root is never
    within an fp64 rounding error of a halfway point between two floats."""
    return t.double().sqrt().float()


@functools.cache
def _native_cpu() -> bool:
    """Whether the CPU kernel is registered (loading the library once, then registering the
    fake implementation, which torch accepts only once the op exists)."""
    if not load_ops().available:
        return False
    torch.library.register_fake("fsdpx::adam_step")(_adam_step_fake)
    return True


def _adam_step_fake(
    params: Sequence[torch.Tensor], *args: object, **kwargs: object
) -> torch.Tensor:
    device = params[0].device if params else torch.device("cpu")
    return torch.empty((), dtype=torch.bool, device=device)


def _local(
    tensors: Sequence[torch.Tensor] | None, name: str, params: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """The local shards of `tensors`, checking each is laid out like its parameter."""
    out: list[torch.Tensor] = []
    for i, t in enumerate(tensors or ()):
        p = params[i]
        if isinstance(p, DTensor) != isinstance(t, DTensor):
            raise ValueError(
                f"adam_step: params[{i}] and {name}[{i}] must both be DTensors or both plain "
                f"tensors; got {type(p).__name__} and {type(t).__name__}"
            )
        if isinstance(t, DTensor) and isinstance(p, DTensor):
            if t.device_mesh != p.device_mesh or t.placements != p.placements:
                raise ValueError(
                    f"adam_step: {name}[{i}] must be sharded like params[{i}] (an elementwise "
                    f"update); got placements {t.placements} on {t.device_mesh} vs "
                    f"{p.placements} on {p.device_mesh}. Redistribute it first (a Partial "
                    "gradient needs its reduction)"
                )
            t = t.to_local()
        out.append(t)
    return out


def _validate(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: dict[str, list[torch.Tensor]],
    copies: list[torch.Tensor],
    step: int,
) -> None:
    n = len(params)
    for name, ts in {"grads": grads, **states}.items():
        if len(ts) != n and not (name == "max_exp_avg_sqs" and not ts):
            raise ValueError(
                f"adam_step: {name} has {len(ts)} tensors, expected one per parameter ({n})"
            )
    if copies and len(copies) != n:
        raise ValueError(f"adam_step: param_copies has {len(copies)} tensors, expected none or {n}")
    if step < 1:
        raise ValueError(f"adam_step: step counts from 1 (bias correction); got {step}")
    for i, p in enumerate(params):
        if p.device != params[0].device:
            raise ValueError(
                f"adam_step: every tensor must be on one device; params[0] is on "
                f"{params[0].device}, params[{i}] on {p.device}. Call it once per device"
            )
        for name, t, dtypes in (
            ("params", p, (torch.float32,)),
            ("grads", grads[i], GRAD_DTYPES),
            *((k, ts[i], (torch.float32,)) for k, ts in states.items() if ts),
            *((("param_copies", copies[i], COPY_DTYPES),) if copies else ()),
        ):
            if (
                t.dtype not in dtypes
                or t.shape != p.shape
                or t.device != p.device
                or not t.is_contiguous()
            ):
                raise ValueError(
                    f"adam_step: {name}[{i}] must be a contiguous tensor of dtype "
                    f"{' or '.join(str(d) for d in dtypes)} with shape {tuple(p.shape)} on "
                    f"{p.device} (like params[{i}]); got {t.dtype}, shape {tuple(t.shape)}, "
                    f"{t.device}, contiguous={t.is_contiguous()}"
                )


def adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    lr: float,
    step: int,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled_weight_decay: bool = True,
    maximize: bool = False,
    max_exp_avg_sqs: Sequence[torch.Tensor] | None = None,
    param_copies: Sequence[torch.Tensor] | None = None,
    inv_grad_scale: float = 1.0,
    check_finite: bool = False,
    bias_correction: bool = True,
) -> torch.Tensor:
    """One fused Adam (or AdamW) step over every tensor, in place; see the module docstring.

    Args:
        params, grads, exp_avgs, exp_avg_sqs: one entry per parameter: fp32 params and
            moments, fp32/bf16/fp16 grads, all contiguous, same shape and device. DTensors
            (all sharded alike) are updated on their local shards.
        lr, step: learning rate and the step number (1 for the first step).
        beta1, beta2, eps, weight_decay, maximize: as in torch.optim.AdamW.
        decoupled_weight_decay: True for AdamW, False for Adam's L2 penalty.
        max_exp_avg_sqs: the amsgrad state (None: no amsgrad).
        param_copies: bf16/fp16 tensors that receive the updated params (None: no copy).
        inv_grad_scale: the gradients are multiplied by it first (1 / loss scale).
        check_finite: first check every unscaled gradient; on inf/NaN write nothing.
        bias_correction: False drops Adam's bias correction (DeepSpeed's
            ``bias_correction: false``): step_size = lr, inv_bc2_sqrt = 1.

    Returns:
        A 0-dim bool tensor on the params' device: True when check_finite found a
        non-finite gradient and the step was skipped.

    Example::

        skipped = adam_step([p], [p.grad], [m], [v], lr=1e-3, step=1, weight_decay=0.01,
                            param_copies=[p_bf16], check_finite=True)
    """
    local_params = _local(params, "params", params)
    grads_l = _local(grads, "grads", params)
    states = {
        "exp_avgs": _local(exp_avgs, "exp_avgs", params),
        "exp_avg_sqs": _local(exp_avg_sqs, "exp_avg_sqs", params),
        "max_exp_avg_sqs": _local(max_exp_avg_sqs, "max_exp_avg_sqs", params),
    }
    copies = _local(param_copies, "param_copies", params)
    _validate(local_params, grads_l, states, copies, step)
    kwargs = dict(
        lr=float(lr),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(eps),
        weight_decay=float(weight_decay),
        step=int(step),
        decoupled_weight_decay=decoupled_weight_decay,
        maximize=maximize,
        inv_grad_scale=float(inv_grad_scale),
        check_finite=check_finite,
        bias_correction=bias_correction,
    )
    args = (local_params, grads_l, states["exp_avgs"], states["exp_avg_sqs"])
    extra = (states["max_exp_avg_sqs"], copies)
    device = local_params[0].device if local_params else torch.device("cpu")
    native = (device.type == "cpu" and _native_cpu()) or (
        device.type == "cuda" and _native_cpu() and load_cuda_ops().available
    )
    if native:
        return torch.ops.fsdpx.adam_step(*args, *extra, **kwargs)  # type: ignore[no-any-return]
    return adam_step_reference(*args, *extra, **kwargs)  # type: ignore[arg-type]
