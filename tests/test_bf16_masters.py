"""precision.master_dtype bf16 (DeepSpeed's bf16_master_weights_and_grads with
bf16_optimizer_states): bf16 sharded parameters, gradients and Adam moments, at ZeRO stages
1 and 3 on two ranks, against one process training a bf16 copy of the model with the same
data and seed (bf16 tolerances); and the config checks and DeepSpeed mapping."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fsdpx
from fsdpx.demo.gpt import shard_batch
from tests.dist import run_ranks
from tests.parity import LR, STEPS, global_batches, make_model, sweep_body

DP = 2
PRECISION = {"param_dtype": "bf16", "reduce_dtype": "fp32", "master_dtype": "bf16"}


def _reference() -> dict[str, torch.Tensor]:
    """One process, bf16 parameters: each data-parallel chunk's bf16 gradients averaged in
    fp32 (the reduce dtype) and rounded to bf16, torch's AdamW (bf16 moments)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run
    try:
        model = make_model().to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        for micro in global_batches(STEPS, 1):
            for x, y in micro:
                grads = {
                    n: torch.zeros_like(p, dtype=torch.float32) for n, p in model.named_parameters()
                }
                for r in range(DP):
                    model.zero_grad()
                    model(shard_batch(x, r, DP), shard_batch(y, r, DP)).backward()
                    for n, p in model.named_parameters():
                        grads[n] += p.grad.float() / DP
                for n, p in model.named_parameters():
                    p.grad = grads[n].to(torch.bfloat16)
            opt.step()
            opt.zero_grad()
        for state in opt.state.values():
            assert state["exp_avg"].dtype == torch.bfloat16  # bf16 optimizer states
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def _body(rank: int, world: int, cases: dict[str, Any]) -> dict[str, Any]:
    out = sweep_body(rank, world, cases)
    stage = next(iter(cases.values()))
    engine = fsdpx.shard(make_model(), fsdpx.Config.from_dict(stage))
    p = next(engine.module.parameters())
    x = torch.randint(0, 64, (2, 16))
    engine.backward(engine(x, x))
    engine.step()
    state = engine.optimizer.state[p]
    out["dtypes"] = (p.dtype, p.grad, state["exp_avg"].dtype, state["exp_avg_sq"].dtype)
    return out


@pytest.mark.parametrize(
    "stages", [(3,), pytest.param((1, 2), marks=pytest.mark.slow)], ids=["zero3", "zero12"]
)
def test_bf16_masters_match_one_process(stages: tuple[int, ...]) -> None:
    """Stage 3 in the default tier; stages 1-2 in the slow tier."""
    cases = {
        f"zero{stage}": {"zero": {"stage": stage}, "optimizer": {"lr": LR}, "precision": PRECISION}
        for stage in stages
    }
    results = run_ranks(_body, DP, args=(cases,))
    ref = _reference()
    fp32 = make_model()  # the untrained fp32 model: training moved the bf16 weights
    for name in cases:
        _, params = results[0][name]
        for key, want in ref.items():
            assert params[key].dtype == torch.bfloat16
            torch.testing.assert_close(
                params[key], want, rtol=1.6e-2, atol=1e-2, msg=f"{name} {key}"
            )
    assert (
        max((ref[k].float() - p.detach()).abs().max().item() for k, p in fp32.named_parameters())
        > 1e-2
    )
    p_dtype, grad, m_dtype, v_dtype = results[0]["dtypes"]
    assert (p_dtype, m_dtype, v_dtype) == (torch.bfloat16,) * 3 and grad is None


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"zero": {"stage": 0}}, r"needs zero.stage = 1, 2 or 3; got 0"),
        ({"precision": {**PRECISION, "param_dtype": "fp32"}}, "needs precision.param_dtype"),
        ({"optimizer": {"type": "lamb"}}, "needs optimizer.type = 'adamw', 'adam' or 'sgd'"),
        ({"zero": {"offload_optimizer": {"device": "cpu"}}}, "offload keeps fp32 masters"),
    ],
)
def test_bf16_masters_config_errors(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fsdpx.Config.from_dict({"precision": PRECISION, **extra})


def test_deepspeed_bf16_master_keys_map() -> None:
    ds: dict[str, Any] = {
        "train_batch_size": 2,
        "zero_optimization": {"stage": 2},
        "bf16": {
            "enabled": True,
            "bf16_master_weights_and_grads": True,
            "bf16_optimizer_states": True,
        },
    }
    p = fsdpx.Config.from_deepspeed(ds, world_size=2).precision
    assert (p.master_dtype, p.param_dtype) == ("bf16", "bf16")
    only_master = {**ds, "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}
    with pytest.raises(ValueError, match="set bf16_optimizer_states true too"):
        fsdpx.Config.from_deepspeed(only_master, world_size=2)
    only_states = {**ds, "bf16": {"enabled": True, "bf16_optimizer_states": True}}
    with pytest.raises(ValueError, match="requires bf16_master_weights_and_grads"):
        fsdpx.Config.from_deepspeed(only_states, world_size=2)
    with pytest.raises(ValueError, match=r"needs zero.stage = 1, 2 or 3; got 0"):
        fsdpx.Config.from_deepspeed({**ds, "zero_optimization": {"stage": 0}}, world_size=2)
