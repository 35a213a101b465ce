"""Loss scalers against an independent reference of DeepSpeed's rules, plus the dtype policy
and the single-process gradient passes of fsdpx.precision."""

from __future__ import annotations

import math
from pathlib import Path

import msgpack
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdpx.config import Config, DType, LossScaleConfig, PrecisionConfig
from fsdpx.precision import (
    DynamicLossScaler,
    NoLossScaler,
    StaticLossScaler,
    build_loss_scaler,
    grads_have_overflow,
    mp_policy,
    torch_dtype,
    unscale_grads_,
)

configs = st.builds(
    LossScaleConfig,
    initial_scale_power=st.integers(0, 24),
    window=st.integers(1, 5),
    hysteresis=st.integers(1, 4),
    consecutive_hysteresis=st.booleans(),
    min_scale=st.sampled_from([1.0, 0.25, 2.0**4]),
)


class Reference:
    """The rules in words, counted as a run of clean steps rather than iteration numbers."""

    def __init__(self, cfg: LossScaleConfig) -> None:
        self.cfg = cfg
        self.scale = 2.0**cfg.initial_scale_power
        self.budget = cfg.hysteresis
        self.clean_run = 0
        self.halved = False

    def step(self, overflow: bool) -> bool:
        if overflow:
            self.clean_run = 0
            if self.budget == 1:
                self.scale = max(self.scale / 2, self.cfg.min_scale)
                self.halved = True
            else:
                self.budget -= 1
            return True
        self.clean_run += 1
        if self.cfg.consecutive_hysteresis:
            self.budget = self.cfg.hysteresis
        if self.clean_run % self.cfg.window == 0:
            self.budget = self.cfg.hysteresis
            self.scale *= 2
        return False


class DynamicScalerMachine(RuleBasedStateMachine):
    @initialize(cfg=configs)
    def start(self, cfg: LossScaleConfig) -> None:
        self.cfg = cfg
        self.scaler = DynamicLossScaler(cfg)
        self.ref = Reference(cfg)

    @rule(overflow=st.booleans())
    def step(self, overflow: bool) -> None:
        skip = self.scaler.update(overflow)
        assert skip == self.ref.step(overflow)
        assert self.scaler.scale == self.ref.scale

    @rule()
    def checkpoint_and_resume(self) -> None:
        blob = msgpack.packb(self.scaler.state_dict())
        self.scaler = DynamicLossScaler(self.cfg)
        self.scaler.load_state_dict(msgpack.unpackb(blob))

    @invariant()
    def scale_respects_min(self) -> None:
        # The initial scale is not clamped (as in DeepSpeed); a reduction lands on min_scale.
        floor = self.cfg.min_scale if self.ref.halved else min(self.cfg.min_scale, 1.0)
        assert self.scaler.scale >= floor
        assert self.scaler.dynamic


TestDynamicScalerMachine = DynamicScalerMachine.TestCase
TestDynamicScalerMachine.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None
)


def _trace(cfg: LossScaleConfig, steps: list[bool]) -> tuple[list[float], list[bool]]:
    scaler = DynamicLossScaler(cfg)
    scales, skips = [], []
    for overflow in steps:
        skips.append(scaler.update(overflow))
        scales.append(scaler.scale)
    return scales, skips


def test_dynamic_trace_matches_deepspeed_by_hand() -> None:
    # Worked through DeepSpeed's update_scale by hand, step by step.
    o, c = True, False
    steps = [c, c, o, o, c, c, o, c, o]
    cfg = LossScaleConfig(initial_scale_power=4, window=2, hysteresis=2)
    scales, skips = _trace(cfg, steps)
    assert scales == [16, 32, 32, 16, 16, 32, 32, 32, 16]
    assert skips == steps
    # A clean step between overflows refills the budget, so the last overflow only spends it.
    consecutive = LossScaleConfig(
        initial_scale_power=4, window=2, hysteresis=2, consecutive_hysteresis=True
    )
    assert _trace(consecutive, steps)[0] == [16, 32, 32, 16, 16, 32, 32, 32, 32]


def test_dynamic_stops_at_min_scale_without_raising() -> None:
    cfg = LossScaleConfig(initial_scale_power=0, hysteresis=1, min_scale=0.25)
    assert _trace(cfg, [True] * 4)[0] == [0.5, 0.25, 0.25, 0.25]


@settings(max_examples=50, deadline=None)
@given(
    cfg=configs,
    before=st.lists(st.booleans(), max_size=30),
    after=st.lists(st.booleans(), max_size=30),
)
def test_state_dict_round_trip(cfg: LossScaleConfig, before: list[bool], after: list[bool]) -> None:
    a = DynamicLossScaler(cfg)
    for overflow in before:
        a.update(overflow)
    state = a.state_dict()
    assert all(type(v) in (int, float, bool) for v in state.values())
    b = DynamicLossScaler(cfg)
    b.load_state_dict(msgpack.unpackb(msgpack.packb(state)))
    assert b.state_dict() == state
    for overflow in after:
        assert a.update(overflow) == b.update(overflow)
        assert a.scale == b.scale
    assert a.state_dict() == b.state_dict()


def test_load_state_dict_rejects_other_scaler_kind() -> None:
    with pytest.raises(ValueError, match=r"expected keys \['cur_hysteresis'.*got \['cur_scale'\]"):
        DynamicLossScaler(LossScaleConfig()).load_state_dict({"cur_scale": 8.0})
    with pytest.raises(ValueError, match="expected keys"):
        NoLossScaler().load_state_dict({"cur_scale": 8.0})


def test_static_and_no_scalers() -> None:
    static = StaticLossScaler(128.0)
    assert (static.scale, static.dynamic) == (128.0, False)
    assert static.update(True) is True  # DeepSpeed skips an overflowing step here too
    assert static.update(False) is False
    assert static.scale == 128.0
    other = StaticLossScaler(1.0)
    other.load_state_dict(static.state_dict())
    assert other.scale == 128.0

    none = NoLossScaler()
    assert (none.scale, none.dynamic) == (1.0, False)
    assert none.update(True) is False
    assert none.state_dict() == {}
    none.load_state_dict({})


def test_build_loss_scaler() -> None:
    fp16 = PrecisionConfig(param_dtype="fp16", reduce_dtype="fp32")
    assert type(build_loss_scaler(Config())) is NoLossScaler
    static = LossScaleConfig(static_scale=128.0)
    assert (
        type(build_loss_scaler(Config(precision=PrecisionConfig("bf16"), fp16=static)))
        is NoLossScaler
    )
    dynamic = build_loss_scaler(Config(precision=fp16))
    assert type(dynamic) is DynamicLossScaler and dynamic.scale == 2.0**16
    scaler = build_loss_scaler(Config(precision=fp16, fp16=static))
    assert type(scaler) is StaticLossScaler and scaler.scale == 128.0


@pytest.mark.parametrize(
    ("param", "reduce", "expected"),
    [
        ("fp32", "fp32", MixedPrecisionPolicy()),
        ("bf16", "fp32", MixedPrecisionPolicy(torch.bfloat16, torch.float32)),
        ("bf16", "bf16", MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16)),
        ("fp16", "fp32", MixedPrecisionPolicy(torch.float16, torch.float32)),
        ("fp32", "bf16", MixedPrecisionPolicy(torch.float32, torch.bfloat16)),
    ],
)
def test_mp_policy(param: DType, reduce: DType, expected: MixedPrecisionPolicy) -> None:
    policy = mp_policy(PrecisionConfig(param, reduce))
    assert policy == expected
    assert policy.cast_forward_inputs and policy.output_dtype is None


def test_torch_dtype() -> None:
    assert torch_dtype("fp16") is torch.float16
    with pytest.raises(ValueError, match="unknown dtype name 'fp8'; expected one of 'fp32'"):
        torch_dtype("fp8")


def _params(*grads: torch.Tensor | None) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(3) if g is None else torch.zeros_like(g))
        p.grad = g
        params.append(p)
    return params


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_grads_have_overflow(bad: float, dtype: torch.dtype) -> None:
    clean = [torch.ones(4, dtype=dtype), None, torch.full((2, 2), 3e38).to(dtype)]
    if dtype is torch.float16:
        clean[2] = torch.full((2, 2), 65504.0, dtype=dtype)  # the largest finite fp16
    assert not grads_have_overflow(_params(*clean))
    poisoned = torch.ones(5, dtype=dtype)
    poisoned[3] = bad
    assert grads_have_overflow(_params(*clean, poisoned))
    assert not grads_have_overflow(_params(None, None))
    assert not grads_have_overflow([])


def test_unscale_grads() -> None:
    g32, g16 = torch.full((3,), 4.0), torch.full((2, 2), 8.0, dtype=torch.float16)
    params = _params(g32, None, g16)
    unscale_grads_(params, 0.25)
    assert params[0].grad is g32 and params[2].grad is g16  # in place
    torch.testing.assert_close(g32, torch.full((3,), 1.0))
    torch.testing.assert_close(g16, torch.full((2, 2), 2.0, dtype=torch.float16))
    unscale_grads_(params, 1.0)
    torch.testing.assert_close(g32, torch.full((3,), 1.0))


def test_dtensor_grads_in_a_one_rank_group(tmp_path: Path) -> None:
    # world size 1: exercises the DTensor branch without a collective.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh("cpu", (1,))
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.full((4,), 2.0), mesh, [Shard(0)])
        assert not grads_have_overflow([p])
        unscale_grads_([p], 0.5)
        torch.testing.assert_close(p.grad.to_local(), torch.ones(4))
        p.grad.to_local()[1] = math.nan
        assert grads_have_overflow([p])
    finally:
        dist.destroy_process_group()
