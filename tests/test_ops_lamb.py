"""fsdpx.ops.lamb_step (the native CPU kernels against their pure-PyTorch reference),
fsdpx.lamb.Lamb against DeepSpeed's own Lamb numbers, and Lamb under sharding against one
process.

The DeepSpeed numbers come from tests/data/deepspeed_lamb_0.19.8.json, written by
scripts/gen_lamb_fixture.py with DeepSpeed's pure-torch Lamb kernel in a separate environment
(this test never imports deepspeed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdpx.lamb import Lamb
from fsdpx.ops import load_ops
from fsdpx.ops.lamb import (
    _native_cpu,
    lamb_apply_reference,
    lamb_moments_reference,
    lamb_step,
    trust_ratios,
)
from tests.dist import run_ranks
from tests.parity import STEPS, global_batches, make_model, sweep_body

FIXTURE = Path(__file__).parent / "data" / "deepspeed_lamb_0.19.8.json"


@pytest.fixture(scope="module")
def native() -> None:
    status = load_ops()
    assert status.available, f"the native CPU ops did not build or load: {status.reason}"
    assert _native_cpu()


def _tensors(n: int, seed: int, grad_dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    grad = (torch.randn(n, generator=g) * 3).to(grad_dtype)
    m = torch.randn(n, generator=g) * 0.1
    v = torch.rand(n, generator=g) * 0.01
    return [p, grad, m, v]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inside", [False, True])
def test_native_kernels_equal_the_reference(
    native: None, grad_dtype: torch.dtype, inside: bool
) -> None:
    # 70_000 elements: more than two kGrain chunks, so the chunked sums are exercised.
    sizes = [1, 17, 70_000]
    kw: dict[str, Any] = dict(eps=1e-6, weight_decay=0.05, eps_inside_sqrt=inside)
    mkw: dict[str, Any] = dict(beta1=0.9, beta2=0.99, inv_grad_scale=0.5)
    a = [_tensors(n, i, grad_dtype) for i, n in enumerate(sizes)]
    b = [[t.clone() for t in ts] for ts in a]
    lists_a = [list(x) for x in zip(*a, strict=True)]
    lists_b = [list(x) for x in zip(*b, strict=True)]
    sums_n = torch.ops.fsdpx.lamb_moments(*lists_a, **mkw, **kw)
    sums_r = lamb_moments_reference(*lists_b, **mkw, **kw)
    for i in (2, 3):  # the moments, bit for bit
        for x, y in zip(lists_a[i], lists_b[i], strict=True):
            assert torch.equal(x, y)
    torch.testing.assert_close(sums_n, sums_r, rtol=1e-12, atol=0)  # summation order only
    coeffs = trust_ratios(sums_r, 10.0, 0.01)
    torch.ops.fsdpx.lamb_apply(lists_a[0], lists_a[2], lists_a[3], coeffs, step_size=0.01, **kw)
    lamb_apply_reference(lists_b[0], lists_b[2], lists_b[3], coeffs, step_size=0.01, **kw)
    for x, y in zip(lists_a[0], lists_b[0], strict=True):
        assert torch.equal(x, y)


def test_opcheck(native: None) -> None:
    p, g, m, v = (
        list(x) for x in zip(*[_tensors(n, n, torch.bfloat16) for n in (5, 130)], strict=True)
    )
    kw: dict[str, Any] = dict(eps=1e-8, weight_decay=0.01)
    torch.library.opcheck(
        torch.ops.fsdpx.lamb_moments.default, (p, g, m, v), dict(beta1=0.9, beta2=0.999, **kw)
    )
    coeffs = torch.tensor([0.5, 2.0])
    torch.library.opcheck(
        torch.ops.fsdpx.lamb_apply.default, (p, m, v, coeffs), dict(step_size=0.01, **kw)
    )


def test_native_kernel_errors_name_the_tensor(native: None) -> None:
    p, g, m, v = _tensors(4, 0, torch.float32)
    with pytest.raises(RuntimeError, match=r"exp_avgs\[0\] must be a contiguous fp32 CPU"):
        torch.ops.fsdpx.lamb_moments(
            [p], [g], [m.double()], [v], beta1=0.9, beta2=0.9, eps=1e-8, weight_decay=0.0
        )
    with pytest.raises(RuntimeError, match="one trust ratio per parameter"):
        torch.ops.fsdpx.lamb_apply(
            [p], [m], [v], torch.ones(2), step_size=0.1, eps=1e-8, weight_decay=0.0
        )


def test_lamb_step_checks_its_inputs() -> None:
    p, g, m, v = _tensors(4, 0, torch.float32)
    with pytest.raises(ValueError, match=r"exp_avg_sqs\[0\] must have dtype torch.float32"):
        lamb_step([p], [g], [m], [v.half()], lr=0.1, step=1)
    with pytest.raises(ValueError, match="grads has 0 tensors, expected one per parameter"):
        lamb_step([p], [], [m], [v], lr=0.1, step=1)
    with pytest.raises(ValueError, match="step counts from 1"):
        lamb_step([p], [g], [m], [v], lr=0.1, step=0)


def test_lamb_refuses_bad_options() -> None:
    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="need 0 < min_coeff <= max_coeff"):
        Lamb([w], min_coeff=2.0, max_coeff=1.0)
    with pytest.raises(ValueError, match="parameters must be fp32"):
        half = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
        half.grad = torch.ones_like(half)
        Lamb([half]).step()


def _replay(case: dict[str, Any], force_torch_path: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if force_torch_path:
        monkeypatch.setattr("fsdpx.ops.lamb._native_cpu", lambda: False)
    o = case["options"]
    shapes = [tuple(s) for s in case["shapes"]]
    params = [
        torch.nn.Parameter(torch.tensor(x).reshape(s))
        for x, s in zip(case["init"], shapes, strict=True)
    ]
    opt = Lamb(
        params,
        lr=o["lr"],
        betas=tuple(o["betas"]),
        eps=o["eps"],
        weight_decay=o["weight_decay"],
        bias_correction=o["bias_correction"],
        max_coeff=o["max_coeff"],
        min_coeff=o["min_coeff"],
        eps_inside_sqrt=o["eps_inside_sqrt"],
    )
    for step, grads in enumerate(case["grads"]):
        for p, g, s in zip(params, grads, shapes, strict=True):
            p.grad = torch.tensor(g).reshape(s)
        opt.step()
        torch.testing.assert_close(
            torch.tensor(opt.get_lamb_coeffs()),
            torch.tensor(case["coeffs"][step]),
            rtol=1e-5,
            atol=0,
        )
    for name, got in (
        ("params", params),
        ("exp_avgs", [opt.state[p]["exp_avg"] for p in params]),
        ("exp_avg_sqs", [opt.state[p]["exp_avg_sq"] for p in params]),
    ):
        for i, (t, want) in enumerate(zip(got, case[name], strict=True)):
            torch.testing.assert_close(
                t.detach().flatten(), torch.tensor(want), rtol=1e-5, atol=1e-7, msg=f"{name}[{i}]"
            )


@pytest.mark.parametrize("torch_path", [False, True])
def test_lamb_matches_deepspeed(torch_path: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    data = json.loads(FIXTURE.read_text())
    assert data["deepspeed"] == "0.19.8"
    # The cases cover bias correction off, eps inside the sqrt, both clamps and ||p|| = 0.
    coeffs = [c for case in data["cases"] for row in case["coeffs"] for c in row]
    assert 1.0 in coeffs and 0.28 in [round(c, 6) for c in coeffs]
    for case in data["cases"]:
        _replay(case, torch_path, monkeypatch)


LAMB = {"type": "lamb", "lr": 1e-2, "weight_decay": 0.01, "max_coeff": 5.0, "min_coeff": 0.05}


def _reference() -> dict[str, torch.Tensor]:
    model = make_model()
    opt = Lamb(model.parameters(), lr=1e-2, weight_decay=0.01, max_coeff=5.0, min_coeff=0.05)
    for micro in global_batches(STEPS, 1):
        for x, y in micro:
            model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "stages", [(3,), pytest.param((0, 1, 2), marks=pytest.mark.slow)], ids=["zero3", "zero012"]
)
def test_lamb_sharded_equals_one_process(stages: tuple[int, ...]) -> None:
    """Two ranks (at stage 3 the trust ratio of a sharded tensor needs the norms summed over
    the shards) against Lamb on one process, same data and seed. Stage 3 in the default
    tier; stages 0-2 in the slow tier."""
    cases = {f"zero{stage}": {"zero": {"stage": stage}, "optimizer": LAMB} for stage in stages}
    results = run_ranks(sweep_body, 2, args=(cases,))
    ref = _reference()
    for name in cases:
        _, params = results[0][name]
        for key, want in ref.items():
            torch.testing.assert_close(params[key], want, rtol=1e-4, atol=1e-5, msg=f"{name} {key}")


@pytest.mark.gpu
def test_lamb_on_cuda_equals_the_cpu_kernel() -> None:
    """The torch path on the GPU against the native CPU kernel, same inputs (the trust ratio
    may differ in its last bit: the norms are summed in another order)."""
    assert torch.cuda.is_available()
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(300, 7, generator=gen), torch.randn(70_000, generator=gen)]
    grads = [[torch.randn_like(t) for t in init] for _ in range(3)]
    out = []
    for device in ("cpu", "cuda"):
        params = [torch.nn.Parameter(t.clone().to(device)) for t in init]
        opt = Lamb(params, lr=1e-2, weight_decay=0.01)
        for gs in grads:
            for p, g in zip(params, gs, strict=True):
                p.grad = g.to(device)
            opt.step()
        out.append([p.detach().cpu() for p in params])
    for a, b in zip(*out, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
