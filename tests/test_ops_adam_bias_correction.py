"""`bias_correction=False` in fsdpx.ops.adam_step and everything above it (fsdpx.optim.AdamW,
OptimizerConfig; the DeepSpeed key `optimizer.params.bias_correction` is tested in
test_deepspeed_keys_cover.py).

torch has no Adam without bias correction, so the reference here is DeepSpeed's FusedAdam
formula with ``bias_correction=False`` (deepspeed/ops/csrc/adam/multi_tensor_adam.cu: both
corrections are 1), written out independently in float64::

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p * (1 - lr * weight_decay)                  (adam_w_mode; Adam adds wd * p to g)
    p = p - lr * m / (sqrt(v) + eps)

The native kernel is also checked bitwise against adam_step_reference, as for the default.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdpx.optim
from fsdpx.config import OptimizerConfig
from fsdpx.ops import adam_step, adam_step_reference, load_ops
from fsdpx.ops.adam import _native_cpu
from fsdpx.optim import build_optimizer

KW: dict[str, Any] = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


@pytest.fixture(scope="module")
def native() -> None:
    status = load_ops()
    assert status.available, f"the native CPU ops did not build or load: {status.reason}"
    assert _native_cpu()


def _case(n: int, seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(n, generator=g)],
        [torch.randn(n, generator=g) * 3],
        [torch.randn(n, generator=g) * 0.1],
        [torch.rand(n, generator=g) * 0.01],
    ]


def _deepspeed_no_bc(
    p: torch.Tensor,
    grads: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
) -> torch.Tensor:
    """DeepSpeed FusedAdam(bias_correction=False), float64, from zero moments."""
    p = p.double().clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for g in grads:
        g = g.double()
        if not adamw:
            g = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        if adamw:
            p = p * (1 - lr * weight_decay)
        p = p - lr * m / (v.sqrt() + eps)
    return p


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 3000),
    step=st.integers(1, 50_000),
    decoupled=st.booleans(),
    amsgrad=st.booleans(),
    copy=st.booleans(),
    lr=st.floats(0.0, 1.0),
)
def test_native_matches_reference_bitwise_without_bias_correction(
    native: None, n: int, step: int, decoupled: bool, amsgrad: bool, copy: bool, lr: float
) -> None:
    case = _case(n, seed=n + step)
    extra = [[t.clone() for t in case[3]] if amsgrad else [], []]
    if copy:
        extra[1] = [torch.empty(n, dtype=torch.bfloat16)]
    a = [[t.clone() for t in ts] for ts in case + extra]
    b = [[t.clone() for t in ts] for ts in case + extra]
    kw = dict(KW, lr=lr, step=step, decoupled_weight_decay=decoupled, bias_correction=False)
    torch.ops.fsdpx.adam_step(*a, **kw)
    adam_step_reference(*b, **kw)  # type: ignore[arg-type]
    for x, y in zip(a, b, strict=True):
        for s, t in zip(x, y, strict=True):
            assert torch.equal(
                s.view(torch.int16 if s.element_size() == 2 else torch.int32),
                t.view(torch.int16 if t.element_size() == 2 else torch.int32),
            )


@pytest.mark.parametrize("adamw", [True, False])
def test_reference_is_deepspeeds_formula(adamw: bool) -> None:
    """Five steps from zero moments: the fp32 reference tracks the float64 DeepSpeed formula,
    and is far from the bias-corrected step (so the switch is really applied)."""
    g = torch.Generator().manual_seed(1)
    p0 = torch.randn(500, generator=g)
    grads = [torch.randn(500, generator=g) for _ in range(5)]
    ours = {bc: p0.clone() for bc in (True, False)}
    for bc, p in ours.items():
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        for step, grad in enumerate(grads, start=1):
            adam_step_reference(
                [p], [grad], [m], [v], [], [], **KW, step=step,
                decoupled_weight_decay=adamw, bias_correction=bc,
            )  # fmt: skip
    want = _deepspeed_no_bc(p0, grads, **KW, adamw=adamw)
    torch.testing.assert_close(ours[False].double(), want, atol=1e-6, rtol=1e-5)
    assert (ours[True].double() - want).abs().max() > 1e-3


def test_opcheck_without_bias_correction(native: None) -> None:
    torch.library.opcheck(
        torch.ops.fsdpx.adam_step.default,
        tuple(_case(130, 3) + [[], []]),
        dict(KW, step=2, bias_correction=False),
    )


def test_wrapper_passes_the_switch(native: None) -> None:
    a, b = _case(64, 5), _case(64, 5)
    adam_step(*a, **KW, step=2, bias_correction=False)
    adam_step(*b, **KW, step=2)
    assert not torch.equal(a[0][0], b[0][0])


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


@pytest.mark.parametrize("adamw", [True, False])
def test_adamw_without_bias_correction_matches_deepspeed_formula(adamw: bool) -> None:
    """fsdpx.optim.AdamW(bias_correction=False), native kernel or reference (whichever this
    machine has), against the float64 formula, parameter by parameter."""
    model = _mlp()
    start = [p.detach().clone() for p in model.parameters()]
    opt = fsdpx.optim.AdamW(
        model.parameters(),
        lr=1e-2,
        weight_decay=0.1,
        decoupled_weight_decay=adamw,
        bias_correction=False,
    )
    g = torch.Generator().manual_seed(2)
    grads: list[list[torch.Tensor]] = [[] for _ in start]
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(4, 9, generator=g)).square().mean().backward()
        for i, p in enumerate(model.parameters()):
            assert p.grad is not None
            grads[i].append(p.grad.clone())
        opt.step()
    for p, p0, gs in zip(model.parameters(), start, grads, strict=True):
        want = _deepspeed_no_bc(
            p0, gs, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=adamw
        )
        torch.testing.assert_close(p.detach().double(), want, atol=1e-6, rtol=1e-5)


def test_adamw_without_bias_correction_needs_fp32() -> None:
    p = torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
    p.grad = torch.randn(8, dtype=torch.bfloat16)
    opt = fsdpx.optim.AdamW([p], bias_correction=False)
    with pytest.raises(ValueError, match=r"params\[0\] must be a contiguous tensor of dtype"):
        opt.step()


def test_config_builds_fused_adamw_without_bias_correction() -> None:
    model = _mlp()
    opt = build_optimizer(
        model.parameters(), OptimizerConfig(type="adam", lr=0.1, bias_correction=False)
    )
    assert isinstance(opt, fsdpx.optim.AdamW)
    group = opt.param_groups[0]
    assert group["bias_correction"] is False and group["decoupled_weight_decay"] is False
    assert isinstance(build_optimizer(model.parameters(), OptimizerConfig()), torch.optim.AdamW)
    with pytest.raises(ValueError, match=r"'optimizer.bias_correction' \(False\) set, but"):
        OptimizerConfig(type="sgd", bias_correction=False)


@pytest.mark.gpu
def test_cuda_without_bias_correction_matches_reference() -> None:
    from fsdpx.ops import load_cuda_ops

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    status = load_cuda_ops()
    assert status.available, status.reason
    case = _case(70_000, 9)
    on_gpu = [[t.cuda() for t in ts] for ts in case]
    kw = dict(KW, step=7, bias_correction=False)
    torch.ops.fsdpx.adam_step(*on_gpu, [], [], **kw)
    p, g, m, v = case
    adam_step_reference(p, g, m, v, [], [], **kw)
    for x, y in zip(on_gpu, case, strict=True):
        assert torch.equal(x[0].cpu().view(torch.int32), y[0].view(torch.int32))
