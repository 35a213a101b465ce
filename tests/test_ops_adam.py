"""fsdpx.ops.adam_step (native kernel vs its reference, bitwise) and fsdpx.optim.AdamW (vs
torch.optim.AdamW, to fp32 rounding). The first test to need the native library builds it
into the user's cache (tens of seconds on 2 cores, once)."""

from __future__ import annotations

import copy
import io
import re
import struct
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdpx.optim
from fsdpx.ops import OpsStatus, adam_step, adam_step_reference, load_ops
from fsdpx.ops.adam import _native_cpu
from tests import ops_adam_bodies
from tests.dist import run_ranks

GRAIN = 1 << 15  # kGrain in csrc/adam.cpp: sizes around it change how threads split the work
KW: dict[str, Any] = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=3)


@pytest.fixture(scope="module")
def native() -> None:
    status = load_ops()
    assert status.available, f"the native CPU ops did not build or load: {status.reason}"
    assert _native_cpu()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if not torch.equal(_bits(x), _bits(y)):
            bad = (_bits(x) != _bits(y)).nonzero()[:5].flatten().tolist()
            raise AssertionError(
                f"{what}[{i}] differs at {bad}: {x.flatten()[bad]} vs {y.flatten()[bad]}"
            )


def _case(
    sizes: list[int],
    grad_dtypes: list[torch.dtype],
    amsgrad: bool,
    copy_dtype: torch.dtype | None,
    seed: int,
) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        "params": [torch.randn(n, generator=g) for n in sizes],
        "grads": [
            (torch.randn(n, generator=g) * 3).to(d) for n, d in zip(sizes, grad_dtypes, strict=True)
        ],
        "exp_avgs": [torch.randn(n, generator=g) * 0.1 for n in sizes],
        "exp_avg_sqs": [torch.rand(n, generator=g) * 0.01 for n in sizes],
        "max_exp_avg_sqs": [torch.rand(n, generator=g) * 0.01 for n in sizes] if amsgrad else [],
        "param_copies": [torch.empty(n, dtype=copy_dtype) for n in sizes] if copy_dtype else [],
    }


def _clone(case: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    return {k: [t.clone() for t in v] for k, v in case.items()}


def _run_both(case: dict[str, list[torch.Tensor]], **kw: Any) -> tuple[Any, Any, Any, Any]:
    a, b = _clone(case), _clone(case)
    flag_a = torch.ops.fsdpx.adam_step(*a.values(), **kw)
    flag_b = adam_step_reference(*b.values(), **kw)
    return a, b, flag_a, flag_b


_sizes = st.lists(
    st.one_of(
        st.integers(0, 70),
        st.integers(71, 5000),
        st.sampled_from([GRAIN - 1, GRAIN + 1, 2 * GRAIN + 3, 3 * GRAIN + 17]),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=60, deadline=None)
@given(
    sizes=_sizes,
    data=st.data(),
    amsgrad=st.booleans(),
    copy_dtype=st.sampled_from([None, torch.bfloat16, torch.float16]),
    lr=st.floats(0.0, 1.0),
    beta1=st.floats(0.0, 0.999),
    beta2=st.floats(0.0, 0.99999),
    eps=st.sampled_from([1e-8, 1e-6, 1e-3]),
    weight_decay=st.sampled_from([0.0, 1e-4, 0.1, 0.5]),
    step=st.integers(1, 100_000),
    decoupled=st.booleans(),
    maximize=st.booleans(),
    inv_grad_scale=st.sampled_from([1.0, 2.0**-12, 0.37, 3.0]),
    check_finite=st.booleans(),
)
def test_native_matches_reference_bitwise(
    native: None,
    sizes: list[int],
    data: st.DataObject,
    amsgrad: bool,
    copy_dtype: torch.dtype | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    decoupled: bool,
    maximize: bool,
    inv_grad_scale: float,
    check_finite: bool,
) -> None:
    grad_dtypes = [
        data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])) for _ in sizes
    ]
    case = _case(sizes, grad_dtypes, amsgrad, copy_dtype, seed=len(sizes) + step)
    a, b, flag_a, flag_b = _run_both(
        case,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        decoupled_weight_decay=decoupled,
        maximize=maximize,
        inv_grad_scale=inv_grad_scale,
        check_finite=check_finite,
    )
    assert not flag_a.item() and not flag_b.item()
    for key in a:
        _assert_bitwise(a[key], b[key], key)
    for p, c in zip(a["params"], a["param_copies"], strict=False):
        _assert_bitwise([c], [p.to(c.dtype)], "copy vs param.to()")


def test_two_dim_params_and_threads(native: None) -> None:
    """Multi-dimensional contiguous tensors are flat buffers to the kernel; one thread and
    two threads give the same bits."""
    threads = torch.get_num_threads()
    case = {
        "params": [torch.randn(257, 130)],
        "grads": [torch.randn(257, 130).bfloat16()],
        "exp_avgs": [torch.zeros(257, 130)],
        "exp_avg_sqs": [torch.zeros(257, 130)],
        "max_exp_avg_sqs": [],
        "param_copies": [torch.empty(257, 130, dtype=torch.bfloat16)],
    }
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            a, b, _, _ = _run_both(case, **KW)
            outs.append(a)
            for key in a:
                _assert_bitwise(a[key], b[key], key)
    finally:
        torch.set_num_threads(threads)
    for key in outs[0]:
        _assert_bitwise(outs[0][key], outs[1][key], f"1 vs 2 threads {key}")


@pytest.mark.parametrize("bad", ["inf", "-inf", "nan", "overflow"])
def test_non_finite_grad_skips_and_leaves_state(native: None, bad: str) -> None:
    """The bad value sits in the last tensor, after others that would otherwise be updated:
    nothing at all may change, on the native path and the reference alike."""
    case = _case(
        [100, 3 * GRAIN + 5, 40],
        [torch.float32, torch.bfloat16, torch.float16],
        True,
        torch.bfloat16,
        0,
    )
    scale = 1.0
    if bad == "overflow":  # finite grads whose unscaled value overflows fp32
        case["grads"][2][7] = 6e4
        scale = 1e36
    else:
        case["grads"][2][7] = float(bad)
    before = _clone(case)
    for fn in (torch.ops.fsdpx.adam_step, adam_step_reference):
        c = _clone(case)
        flag = fn(*c.values(), **KW, inv_grad_scale=scale, check_finite=True)
        assert flag.dtype == torch.bool and flag.item()
        for key in c:
            _assert_bitwise(c[key], before[key], f"{fn} {key}")


def test_found_inf_false_without_check(native: None) -> None:
    """check_finite=False never reads the flag pass: a NaN gradient is applied (and poisons
    exactly the elements it touches)."""
    case = _case([50], [torch.float32], False, None, 1)
    case["grads"][0][3] = float("nan")
    flag = torch.ops.fsdpx.adam_step(*case.values(), **KW)
    assert not flag.item()
    assert case["params"][0].isnan().nonzero().flatten().tolist() == [3]


def _float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_copy_out_rounds_like_torch(native: None, dtype: torch.dtype) -> None:
    """With lr=0 and zero gradients the params are unchanged, so the copy is just the conversion: ties (both
    parities), values that round up across an exponent or overflow to inf, subnormals, signed
    zeros, infinities all give the bits of `param.to(dtype)` (round to nearest even)."""
    specials = [
        0x3F808000, 0x3F818000, 0x3F80_7FFF, 0x3F80_8001, 0x3FFF_FFFF, 0x7F7F_FFFF,
        0x7F7F_7FFF, 0x0000_0001, 0x0080_0000, 0x8000_0000, 0x7F80_0000, 0xFF80_0000,
        0x3F80_1000, 0x3F80_3000, 0x477F_F000, 0x477F_E000, 0x3380_0000, 0x3300_0000,
    ]  # fmt: skip
    p = torch.tensor([_float(b) for b in specials] + torch.randn(1000).tolist())
    case = {
        "params": [p],
        "grads": [torch.zeros_like(p)],  # m stays +0, so p - 0 keeps even -0 as it is
        "exp_avgs": [torch.zeros_like(p)],
        "exp_avg_sqs": [torch.zeros_like(p)],
        "max_exp_avg_sqs": [],
        "param_copies": [torch.empty_like(p, dtype=dtype)],
    }
    kw = dict(KW, lr=0.0, weight_decay=0.0)
    a, b, _, _ = _run_both(case, **kw)
    _assert_bitwise(a["params"], [p], "params")
    _assert_bitwise(a["param_copies"], [p.to(dtype)], "copy")
    _assert_bitwise(b["param_copies"], [p.to(dtype)], "reference copy")


def _opcheck_args(
    amsgrad: bool, copy_dtype: torch.dtype | None, grad_dtype: torch.dtype
) -> tuple[Any, ...]:
    case = _case([5, 130], [grad_dtype, grad_dtype], amsgrad, copy_dtype, 3)
    return tuple(case.values())


@pytest.mark.parametrize(
    "amsgrad,copy_dtype,grad_dtype,check",
    [
        (False, None, torch.float32, False),
        (True, torch.bfloat16, torch.bfloat16, True),
        (False, torch.float16, torch.float16, True),
    ],
)
def test_opcheck(
    native: None,
    amsgrad: bool,
    copy_dtype: torch.dtype | None,
    grad_dtype: torch.dtype,
    check: bool,
) -> None:
    torch.library.opcheck(
        torch.ops.fsdpx.adam_step.default,
        _opcheck_args(amsgrad, copy_dtype, grad_dtype),
        dict(KW, check_finite=check),
    )


def test_wrapper_uses_native_and_returns_flag(native: None) -> None:
    case = _case([10, 20], [torch.float32, torch.bfloat16], False, torch.bfloat16, 4)
    a, b = _clone(case), _clone(case)
    flag = adam_step(
        a["params"],
        a["grads"],
        a["exp_avgs"],
        a["exp_avg_sqs"],
        param_copies=a["param_copies"],
        **KW,
    )
    adam_step_reference(*b.values(), **KW)
    assert flag.shape == () and not flag.item()
    for key in a:
        _assert_bitwise(a[key], b[key], key)


def _wrapper_call(**over: Any) -> None:
    p = [torch.zeros(4), torch.zeros(4)]
    args: dict[str, Any] = dict(
        params=p, grads=[torch.zeros(4), torch.zeros(4)], exp_avgs=[torch.zeros(4)] * 2,
        exp_avg_sqs=[torch.zeros(4)] * 2, lr=1e-3, step=1,
    )  # fmt: skip
    args.update(over)
    adam_step(**args)


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(grads=[torch.zeros(4)]), r"grads has 1 tensors, expected one per parameter \(2\)"),
        (
            dict(param_copies=[torch.zeros(4, dtype=torch.bfloat16)]),
            "param_copies has 1 tensors, expected none or 2",
        ),
        (dict(step=0), "step counts from 1"),
        (
            dict(params=[torch.zeros(4, dtype=torch.float64)] * 2),
            r"params\[0\] must be a contiguous tensor of dtype torch.float32",
        ),
        (
            dict(grads=[torch.zeros(4, dtype=torch.int32)] * 2),
            r"grads\[0\] must be .* torch.float32 or torch.bfloat16 or torch.float16",
        ),
        (dict(grads=[torch.zeros(8)[::2]] * 2), "contiguous=False"),
        (
            dict(exp_avgs=[torch.zeros(5)] * 2),
            r"exp_avgs\[0\] must be .*shape \(4,\).*got torch.float32, shape \(5,\)",
        ),
        (
            dict(param_copies=[torch.zeros(4)] * 2),
            r"param_copies\[0\] must be .* torch.bfloat16 or torch.float16",
        ),
        (
            dict(params=[torch.zeros(4), torch.zeros(4, device="meta")]),
            "every tensor must be on one device",
        ),
    ],
)
def test_wrapper_errors(over: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _wrapper_call(**over)


# ---- fsdpx.optim.AdamW --------------------------------------------------------------------


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(37, 64), torch.nn.GELU(), torch.nn.Linear(64, 5))


def _train(
    model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, skip_bias_every: int = 0
) -> None:
    g = torch.Generator().manual_seed(7)
    for i in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 37, generator=g)).square().mean().backward()
        if skip_bias_every and i % skip_bias_every == 1:
            model[2].bias.grad = None  # type: ignore[index]  # this param's step falls behind
        opt.step()


@pytest.mark.parametrize(
    "kw,torch_cls",
    [
        (dict(lr=1e-2, weight_decay=0.1), torch.optim.AdamW),
        (dict(lr=1e-2, weight_decay=0.0, amsgrad=True, maximize=True), torch.optim.AdamW),
        (
            dict(
                lr=3e-3,
                betas=(0.8, 0.95),
                eps=1e-6,
                weight_decay=0.05,
                decoupled_weight_decay=False,
            ),
            torch.optim.Adam,
        ),
    ],
)
def test_adamw_matches_torch(
    native: None, kw: dict[str, Any], torch_cls: type[torch.optim.Optimizer]
) -> None:
    ours_model, torch_model = _mlp(), _mlp()
    torch_kw = {k: v for k, v in kw.items() if k != "decoupled_weight_decay"}
    ours = fsdpx.optim.AdamW(ours_model.parameters(), **kw)
    ref = torch_cls(torch_model.parameters(), **torch_kw)
    _train(ours_model, ours, 6, skip_bias_every=3)
    _train(torch_model, ref, 6, skip_bias_every=3)
    for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    for p_ours, p_ref in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
        s_ours, s_ref = ours.state[p_ours], ref.state[p_ref]
        assert set(s_ours) == set(s_ref)
        for key in s_ref:
            torch.testing.assert_close(s_ours[key], s_ref[key], atol=1e-6, rtol=1e-5)


def _saved(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Through bytes, as a checkpoint does (loading shares the tensors otherwise)."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf)  # type: ignore[no-any-return]


def test_adamw_state_dict_round_trips_with_torch(native: None) -> None:
    """Our state dict loads into torch.optim.AdamW and back; both then keep training alike."""
    ours_model = _mlp()
    ours = fsdpx.optim.AdamW(ours_model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(ours_model, ours, 3)
    torch_model = copy.deepcopy(ours_model)
    ref = torch.optim.AdamW(torch_model.parameters(), lr=1e-2, weight_decay=0.1)
    ref.load_state_dict(_saved(ours.state_dict()))
    assert ref.state[next(iter(torch_model.parameters()))]["step"].item() == 3.0
    back = fsdpx.optim.AdamW(ours_model.parameters())
    back.load_state_dict(
        _saved(ref.state_dict())
    )  # torch's groups carry foreach/fused/...: kept, ignored
    _train(ours_model, back, 3)
    _train(torch_model, ref, 3)
    for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_adamw_routes_unfit_params_to_torch(native: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-contiguous parameter goes through torch's implementation; without the native
    library every parameter does (adam_step is never called)."""
    ours_model, torch_model = _mlp(), _mlp()
    for m in (ours_model, torch_model):
        m[0].weight = torch.nn.Parameter(m[0].weight.detach().t().contiguous().t())  # type: ignore[index]
    assert not ours_model[0].weight.is_contiguous()  # type: ignore[index]
    ours = fsdpx.optim.AdamW(ours_model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(torch_model.parameters(), lr=1e-2)
    _train(ours_model, ours, 3)
    _train(torch_model, ref, 3)
    for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
        torch.testing.assert_close(a, b)

    def no_native(*a: Any, **k: Any) -> None:
        raise AssertionError("adam_step called without the native library")

    monkeypatch.setattr(fsdpx.optim, "load_ops", lambda: OpsStatus(False, "test", None, None))
    monkeypatch.setattr(fsdpx.optim, "adam_step", no_native)
    _train(ours_model, ours, 2)
    _train(torch_model, ref, 2)
    for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(lr=-1.0), "lr must be >= 0, got -1.0"),
        (dict(betas=(0.9, 1.0)), r"betas must each be in \[0, 1\), got \(0.9, 1.0\)"),
        (dict(eps=-1e-8), "eps must be >= 0"),
        (dict(weight_decay=-0.1), "weight_decay must be >= 0"),
    ],
)
def test_adamw_rejects_bad_hyperparameters(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fsdpx.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], **kw)


def test_adamw_rejects_sparse_grads() -> None:
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.zeros(4).to_sparse()
    with pytest.raises(ValueError, match="sparse gradients are not supported"):
        fsdpx.optim.AdamW([p]).step()


def test_adamw_on_fsdp2_dtensor_shards(native: None) -> None:
    """2 gloo ranks, FSDP2-sharded params (DTensor Shard(0), uneven shards): every parameter
    takes the native kernel on its local shard, and the gathered result matches a single
    process running torch.optim.AdamW on the whole batch."""
    results = run_ranks(ops_adam_bodies.fsdp_adamw_body, world_size=2)
    ref = ops_adam_bodies.reference_params()
    for r in results:
        assert r["ops"] and r["native"] and all(r["native"]), r["native"]
        wrong_placement, not_dtensor = r["errors"]
        assert re.search(
            r"grads\[0\] must be sharded like params\[0\].*Replicate.*Shard\(dim=0\).*Redistribute",
            wrong_placement,
        ), wrong_placement
        assert "params[0] and grads[0] must both be DTensors or both plain tensors" in not_dtensor
        for name, t in ref.items():
            torch.testing.assert_close(r["params"][name], t, msg=f"parameter {name} differs")


# ---- CUDA ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("copy_dtype", [None, torch.bfloat16, torch.float16])
def test_cuda_matches_cpu_reference(copy_dtype: torch.dtype | None) -> None:
    """More tensors than one launch holds (24) and one tensor longer than one launch's blocks
    (320 x 65536 elements), mixed gradient dtypes, amsgrad, check_finite: bitwise equal to the
    reference on CPU."""
    from fsdpx.ops import load_cuda_ops

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    status = load_cuda_ops()
    assert status.available, status.reason
    sizes = [1, 7, 1000, 65537, 320 * 65536 + 5] + [31 * i + 3 for i in range(30)]
    dtypes = [(torch.float32, torch.bfloat16, torch.float16)[i % 3] for i in range(len(sizes))]
    case = _case(sizes, dtypes, True, copy_dtype, 5)
    on_gpu = {k: [t.cuda() for t in v] for k, v in case.items()}
    kw = dict(KW, maximize=True, inv_grad_scale=0.5, check_finite=True)
    flag = torch.ops.fsdpx.adam_step(*on_gpu.values(), **kw)
    ref = adam_step_reference(*case.values(), **kw)
    assert flag.item() == ref.item() is False
    for key in case:
        _assert_bitwise([t.cpu() for t in on_gpu[key]], case[key], f"cuda {key}")
    on_gpu["grads"][-1][3] = float("inf")
    before = {k: [t.clone() for t in v] for k, v in on_gpu.items()}
    assert torch.ops.fsdpx.adam_step(*on_gpu.values(), **kw).item()
    for key in case:
        _assert_bitwise(on_gpu[key], before[key], f"cuda skipped {key}")
