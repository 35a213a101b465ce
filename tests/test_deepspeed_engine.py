"""`import fsdpx.deepspeed as deepspeed`: initialize with DeepSpeed's arguments and return
value, the DeepSpeedEngine API, and parity with a single-process reference."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fsdpx.deepspeed as deepspeed
from tests import ds_engine_bodies as bodies
from tests.dist import run_ranks


@pytest.fixture(scope="module")
def trained() -> list[dict[str, Any]]:
    cases = [("config_groups", 2), ("config_groups", 3), ("instance", 1), ("callable", 0)]
    return run_ranks(bodies.train_body, 2, (cases,))


@pytest.mark.parametrize("key", ["config_groups/2", "config_groups/3", "instance/1", "callable/0"])
def test_deepspeed_script_matches_single_process(trained: list[dict[str, Any]], key: str) -> None:
    case = key.split("/")[0]
    ref_losses, ref_params = bodies.reference(case)
    for rank_out in trained:
        out = rank_out[key]
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref_losses))
        assert out["params"].keys() == ref_params.keys()
        for name, value in ref_params.items():
            torch.testing.assert_close(out["params"][name], value, msg=name)


def test_backward_returns_the_loss_divided_by_accumulation(trained: list[dict[str, Any]]) -> None:
    out = trained[0]["config_groups/2"]
    assert max(abs(d) for d in out["backward_returns"]) < 1e-6
    assert out["applied"] is True  # the last step() was a boundary


def test_resume_and_fresh_start(tmp_path: Path) -> None:
    results = run_ranks(bodies.resume_body, 2, (str(tmp_path),))
    for out in results:
        assert out["fresh"] == (None, None)
        torch.testing.assert_close(out["resumed"], out["full"], rtol=0, atol=0)
        assert out["client_state"] == {"epoch": 3}
        assert Path(out["path"]).parent == tmp_path / "ckpt"
        assert out["samples"] == (2 * 8, 5 * 8)  # train_batch_size 8 per optimizer step
        assert out["steps"] == 5


def test_no_optimizer_anywhere_is_an_error() -> None:
    model = bodies.make_model()
    with pytest.raises(ValueError, match='no "optimizer" section and initialize\\(\\) got no'):
        deepspeed.initialize(model=model, config=bodies.ds_config(2, with_optimizer=False))


def test_optimizer_with_state_is_refused() -> None:
    model = bodies.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).backward()
    opt.step()
    with pytest.raises(ValueError, match="already holds state"):
        deepspeed.initialize(
            model=model, optimizer=opt, config=bodies.ds_config(1, with_optimizer=False)
        )


def test_foreign_tensor_in_model_parameters() -> None:
    model = bodies.make_model()
    with pytest.raises(ValueError, match="is not a parameter of the model"):
        deepspeed.initialize(
            model=model,
            model_parameters=[nn.Parameter(torch.zeros(3))],
            config=bodies.ds_config(1),
        )


def test_scheduler_over_another_optimizer() -> None:
    model = bodies.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    other = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(other, lambda s: 1.0)
    with pytest.raises(ValueError, match="wraps an optimizer other than optimizer="):
        deepspeed.initialize(
            model=model,
            optimizer=opt,
            lr_scheduler=sched,
            config=bodies.ds_config(1, with_optimizer=False),
        )


def test_config_from_args_and_twice(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(
        '{"train_micro_batch_size_per_gpu": 2, // comment\n "optimizer": {"type": "Adam", "params": {"lr": 0.001}},}'
    )
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path), "--local_rank", "0"])
    assert args.deepspeed and args.local_rank == 0
    engine, optimizer, loader, sched = deepspeed.initialize(args=args, model=bodies.make_model())
    assert loader is None and sched is None and isinstance(optimizer, torch.optim.Adam)
    assert engine.train_micro_batch_size_per_gpu() == 2 and engine.train_batch_size() == 2
    with pytest.raises(ValueError, match="DeepSpeed config given twice"):
        deepspeed.initialize(args=args, model=bodies.make_model(), config={"train_batch_size": 2})


class _WithConfig(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = {"hidden": 8}  # what a Hugging Face model's .config is read for
        self.vocab_size = 11
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def custom(self) -> str:
        return "model method"

    def save_pretrained(self, d: str) -> None:
        raise AssertionError("must not be reached through the engine")


def test_engine_api_as_deepspeed_has_it(caplog: pytest.LogCaptureFixture) -> None:
    model = _WithConfig()
    data = torch.utils.data.TensorDataset(torch.randn(10, 4))
    cfg = {
        "train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 1,
        "wall_clock_breakdown": True,
    }
    engine, opt, loader, _ = deepspeed.initialize(model=model, config=cfg, training_data=data)
    assert isinstance(engine, nn.Module) and isinstance(engine, deepspeed.DeepSpeedEngine)
    # accessors are methods, as in DeepSpeed
    assert engine.train_micro_batch_size_per_gpu() == 2
    assert engine.gradient_accumulation_steps() == 2 and engine.train_batch_size() == 4
    assert engine.zero_optimization_stage() == 1 and engine.zero_optimization()
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.loss_scale() == 1.0 and engine.gradient_clipping() == 0.0
    assert engine.get_mom() == [0.9] and engine.get_lr() == [0.1]
    assert (engine.global_rank, engine.world_size, engine.dp_world_size, engine.local_rank) == (
        0,
        1,
        1,
        0,
    )
    # fall-through to the model, and the model's config
    assert engine.vocab_size == 11 and engine.custom() == "model method"
    assert engine.config == {"hidden": 8} and engine.ds_config["train_batch_size"] == 4
    with pytest.raises(AttributeError, match="save_16bit_model"):
        engine.save_pretrained("x")
    assert [n for n, _ in engine.named_parameters()] == ["module.lin.weight", "module.lin.bias"]
    assert set(engine.state_dict()) == {"module.lin.weight", "module.lin.bias"}
    assert engine.training
    engine.eval()
    assert not engine.training and not model.training
    engine.train()
    # the loader: micro-batches of 2 from this rank's share, last partial batch kept
    assert [len(b[0]) for b in loader] == [2, 2, 2, 2, 2]
    caplog.set_level(logging.INFO, logger="fsdpx.deepspeed")
    applied = []
    for (x,) in loader:
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        applied.append(engine.was_step_applied())
    assert applied == [False, True, False, True, False]
    assert engine.global_steps == 2 and engine.global_samples == 8
    lines = [r.getMessage() for r in caplog.records if r.name == "fsdpx.deepspeed"]
    assert any(line.startswith("step=1, skipped=0, lr=[0.1], mom=[0.9], loss=") for line in lines)
    assert any(line.startswith("time (ms) | forward: ") for line in lines)
    engine.zero_grad()
    assert all(p.grad is None for p in engine.parameters())


def test_boundary_override_and_batch_size_change() -> None:
    model = nn.Linear(4, 1)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 0},
    }
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    engine.set_gradient_accumulation_boundary(False)
    for _ in range(2):
        engine.backward(engine(torch.ones(1, 4)).sum())
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(engine(torch.ones(1, 4)).sum())
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 1
    engine.set_gradient_accumulation_boundary(False)
    with pytest.raises(
        ValueError, match="must be divisible by micro-batch x data-parallel size = 1"
    ):
        engine.set_train_batch_size(0.5)  # type: ignore[arg-type]
    engine.set_train_batch_size(2)
    assert engine.gradient_accumulation_steps() == 2 and engine.train_batch_size() == 2


def test_no_sync_keeps_gradients_local_and_refuses_stage_2() -> None:
    cfg = {
        "train_batch_size": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = deepspeed.initialize(model=nn.Linear(2, 1), config=cfg)
    with (
        pytest.raises(
            RuntimeError, match="incompatible with the gradient partitioning of ZeRO stage 2"
        ),
        engine.no_sync(),
    ):
        pass
    cfg["zero_optimization"] = {"stage": 0}
    engine, *_ = deepspeed.initialize(model=nn.Linear(2, 1), config=cfg)
    with engine.no_sync():
        engine.backward(engine(torch.ones(1, 2)).sum())
        with pytest.raises(RuntimeError, match="inside no_sync"):
            engine.step()
    engine.backward(engine(torch.ones(1, 2)).sum())
    engine.step()
    assert engine.was_step_applied()


def test_save_16bit_model_bin_loads_into_the_plain_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = {
        "train_batch_size": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "zero_optimization": {"stage": 3},
    }
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    assert engine.save_16bit_model(str(tmp_path)) is True
    loaded = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert loaded.keys() == plain.keys()
    for k, v in plain.items():
        torch.testing.assert_close(loaded[k], v)
    with pytest.raises(ValueError, match="expected a .bin/.pt/.pth"):
        engine.save_16bit_model(str(tmp_path), "weights.npz")


def test_module_level_names() -> None:
    names = set(dir(deepspeed))
    assert {
        "initialize",
        "add_config_arguments",
        "init_distributed",
        "comm",
        "get_accelerator",
        "utils",
        "runtime",
        "DeepSpeedEngine",
    } <= names
    acc = deepspeed.get_accelerator()
    assert acc.device_name() in ("cpu", "cuda") and acc.communication_backend_name() in (
        "gloo",
        "nccl",
    )
    from fsdpx.deepspeed.runtime.utils import set_random_seed
    from fsdpx.deepspeed.utils import RepeatingLoader

    set_random_seed(3)
    a = torch.rand(1)
    set_random_seed(3)
    assert torch.equal(a, torch.rand(1))
    assert list(zip(range(5), RepeatingLoader([1, 2]), strict=False)) == [
        (0, 1),
        (1, 2),
        (2, 1),
        (3, 2),
        (4, 1),
    ]
    with pytest.raises(AttributeError, match="has no attribute 'zero_stub'"):
        deepspeed.zero_stub  # noqa: B018
