"""The DeepSpeed submodules scripts import through `fsdpx.deepspeed`: lr_schedules,
checkpointing, ops.adam, ops.lamb, and the config summary DeepSpeed users see once."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fsdpx.deepspeed as deepspeed
from fsdpx import schedulers
from fsdpx.config import SchedulerConfig
from fsdpx.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from fsdpx.deepspeed.runtime import lr_schedules


def _opt(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)


def _lrs(sched: torch.optim.lr_scheduler.LRScheduler, steps: int = 6) -> list[float]:
    out = []
    for _ in range(steps):
        sched.optimizer.step()
        sched.step()
        out.append(sched.get_last_lr()[0])
    return out


@pytest.mark.parametrize(
    ("ds_class", "kwargs", "cfg"),
    [
        (
            "WarmupLR",
            {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05, "warmup_num_steps": 4},
            {"warmup_max_lr": 0.05, "warmup_num_steps": 4},
        ),
        (
            "WarmupDecayLR",
            {
                "total_num_steps": 8,
                "warmup_max_lr": 0.05,
                "warmup_num_steps": 2,
                "warmup_type": "linear",
            },
            {
                "total_num_steps": 8,
                "warmup_max_lr": 0.05,
                "warmup_num_steps": 2,
                "warmup_type": "linear",
            },
        ),
        (
            "WarmupCosineLR",
            {"total_num_steps": 8, "warmup_num_steps": 2},
            {"total_num_steps": 8, "warmup_num_steps": 2},
        ),
        (
            "OneCycle",
            {
                "cycle_min_lr": 0.01,
                "cycle_max_lr": 0.1,
                "cycle_first_step_size": 2,
                "cycle_momentum": False,
            },
            {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 2},
        ),
    ],
)
def test_lr_schedules_take_deepspeed_arguments(ds_class: str, kwargs: dict, cfg: dict) -> None:
    ours = getattr(lr_schedules, ds_class)(_opt(), **kwargs)
    native = getattr(schedulers, ds_class)(_opt(), SchedulerConfig(type=ds_class, **cfg))
    assert _lrs(ours) == _lrs(native)


def test_one_cycle_momentum_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="pass cycle_momentum=False"):
        lr_schedules.OneCycle(_opt(), cycle_min_lr=0.0, cycle_max_lr=0.1)


def test_checkpointing_recomputes_with_the_same_gradients() -> None:
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Tanh())
    x = torch.randn(3, 4, requires_grad=True)
    torch.manual_seed(1)
    deepspeed.checkpointing.checkpoint(layer, x).sum().backward()
    grad_ckpt = x.grad.clone()
    x.grad = None
    torch.manual_seed(1)
    layer(x).sum().backward()
    torch.testing.assert_close(grad_ckpt, x.grad)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"partition_activations": True}, "partition_activations=True"),
        ({"checkpoint_in_cpu": True}, "checkpoint_in_cpu / cpu_checkpointing=True"),
        (
            {"deepspeed_config": {"activation_checkpointing": {"cpu_checkpointing": True}}},
            "cpu_checkpointing=True",
        ),
    ],
)
def test_checkpointing_configure_refuses_what_it_cannot_do(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        deepspeed.checkpointing.configure(None, **kwargs)
    deepspeed.checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=4)
    with pytest.raises(ValueError, match="mpu_"):
        deepspeed.checkpointing.configure(object())


@pytest.mark.parametrize("mode", [True, False])
def test_fused_adam_is_fsdpx_adamw(mode: bool) -> None:
    torch.manual_seed(0)
    p1 = nn.Parameter(torch.randn(5))
    p2 = nn.Parameter(p1.detach().clone())
    ours = FusedAdam([p1], lr=0.01, weight_decay=0.1, adam_w_mode=mode)
    ref = (torch.optim.AdamW if mode else torch.optim.Adam)([p2], lr=0.01, weight_decay=0.1)
    for _ in range(3):
        for p, opt in ((p1, ours), (p2, ref)):
            p.grad = torch.ones_like(p)
            opt.step()
    torch.testing.assert_close(p1, p2)
    cpu = DeepSpeedCPUAdam([nn.Parameter(torch.zeros(2))], adamw_mode=mode)
    assert cpu.param_groups[0]["decoupled_weight_decay"] is mode


@pytest.mark.parametrize("cls", [FusedAdam, DeepSpeedCPUAdam])
@pytest.mark.parametrize("mode", [True, False])
def test_adam_without_bias_correction(cls: type, mode: bool) -> None:
    """bias_correction=False: DeepSpeed's formula (multi_tensor_adam.cu / cpu_adam with both
    corrections 1), written out in float64 here."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(7))
    ref = p.detach().double().clone()
    m, v = torch.zeros_like(ref), torch.zeros_like(ref)
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.999, 1e-8, 0.1
    kw = {"adam_w_mode": mode} if cls is FusedAdam else {"adamw_mode": mode}
    opt = cls([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, bias_correction=False, **kw)
    assert opt.param_groups[0]["bias_correction"] is False
    for i in range(3):
        g = torch.randn(7) * (i + 1)
        p.grad = g.clone()
        opt.step()
        gd = g.double() if mode else g.double() + wd * ref
        m = b1 * m + (1 - b1) * gd
        v = b2 * v + (1 - b2) * gd * gd
        if mode:
            ref = ref * (1 - lr * wd)
        ref = ref - lr * m / (v.sqrt() + eps)
    torch.testing.assert_close(p.detach().double(), ref, rtol=1e-5, atol=1e-6)


def test_adam_options_not_implemented_say_so() -> None:
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam([nn.Parameter(torch.zeros(1))], amsgrad=True)
    with pytest.raises(NotImplementedError, match="fp32_optimizer_states=False"):
        DeepSpeedCPUAdam([nn.Parameter(torch.zeros(1))], fp32_optimizer_states=False)


def test_zero_init_builds_on_meta_and_initialize_materialises() -> None:
    with deepspeed.zero.Init(config_dict_or_path={"train_batch_size": 1}):
        model = nn.Linear(8, 4)
    assert model.weight.is_meta
    cfg = {
        "train_batch_size": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3},
    }
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    weight = engine.module.weight.full_tensor()
    assert not weight.is_meta and weight.abs().sum() > 0  # reset_parameters() ran
    with deepspeed.zero.Init(enabled=False):
        assert not nn.Linear(2, 2).weight.is_meta


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"module": nn.Linear(1, 1)}, "pass that model to deepspeed.initialize"),
        ({"remote_device": "cpu"}, "offload_param"),
        ({"dtype": torch.bfloat16}, "leave dtype unset"),
    ],
)
def test_zero_init_refusals(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        deepspeed.zero.Init(**kwargs)


def test_fused_lamb_is_fsdpx_lamb() -> None:
    from fsdpx.deepspeed.ops.lamb import FusedLamb
    from fsdpx.lamb import Lamb

    torch.manual_seed(0)
    p1 = nn.Parameter(torch.randn(5))
    p2 = nn.Parameter(p1.detach().clone())
    kw: dict[str, Any] = dict(lr=0.01, weight_decay=0.1, max_coeff=2.0, min_coeff=0.1)
    ours = FusedLamb([p1], bias_correction=False, eps_inside_sqrt=True, **kw)
    ref = Lamb([p2], bias_correction=False, eps_inside_sqrt=True, **kw)
    for _ in range(3):
        for p, opt in ((p1, ours), (p2, ref)):
            p.grad = torch.ones_like(p)
            opt.step()
    assert torch.equal(p1, p2)
    assert ours.get_lamb_coeffs() == ref.get_lamb_coeffs() and len(ours.get_lamb_coeffs()) == 1
    with pytest.raises(ValueError, match="clip with the config's gradient_clipping"):
        FusedLamb([nn.Parameter(torch.zeros(1))], max_grad_norm=1.0)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedLamb([nn.Parameter(torch.zeros(1))], amsgrad=True)
