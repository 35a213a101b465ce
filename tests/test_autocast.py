"""precision.autocast (DeepSpeed's torch_autocast): forward under torch.autocast(bfloat16)
with fp32 parameters, at ZeRO stages 0 and 3 on two ranks, against one process running the
same model under torch.autocast on the same data and seed (bf16 tolerances); and its config
checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fsdpx
from fsdpx.demo.gpt import shard_batch
from tests.dist import run_ranks
from tests.parity import LR, STEPS, global_batches, make_model, sweep_body

DP = 2


def _reference(autocast: bool) -> dict[str, torch.Tensor]:
    """One process: each data-parallel chunk's forward under autocast, gradients (fp32:
    the parameters are fp32) averaged over the chunks, AdamW."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run
    try:
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        for micro in global_batches(STEPS, 1):
            for x, y in micro:
                for r in range(DP):
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                        loss = model(shard_batch(x, r, DP), shard_batch(y, r, DP))
                    (loss / DP).backward()
            opt.step()
            opt.zero_grad()
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "stages", [(3,), pytest.param((0, 1, 2), marks=pytest.mark.slow)], ids=["zero3", "zero012"]
)
def test_autocast_matches_one_process_under_autocast(stages: tuple[int, ...]) -> None:
    """Stage 3 in the default tier; stages 0-2 in the slow tier."""
    cases = {
        f"zero{stage}": {
            "zero": {"stage": stage},
            "optimizer": {"lr": LR},
            "precision": {"autocast": "bf16"},
        }
        for stage in stages
    }
    results = run_ranks(sweep_body, DP, args=(cases,))
    ref = _reference(autocast=True)
    fp32 = _reference(autocast=False)
    # Autocast really ran: bf16 matmuls move the weights away from the fp32 run.
    assert max((ref[k] - fp32[k]).abs().max().item() for k in ref) > 1e-3
    for name in cases:
        _, params = results[0][name]
        for key, want in ref.items():
            torch.testing.assert_close(params[key], want, rtol=1e-2, atol=2e-3, msg=f"{name} {key}")


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"precision": {"autocast": "bf16", "param_dtype": "bf16"}}, "needs precision.param_dtype"),
        ({"precision": {"autocast": "bf16"}, "mesh": {"pp": 2}}, r"needs mesh.pp = 1 .*; got 2"),
        ({"precision": {"autocast": "fp16"}}, "precision.autocast"),
    ],
)
def test_autocast_config_errors(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fsdpx.Config.from_dict(extra)


def test_deepspeed_torch_autocast_maps() -> None:
    ds = {
        "train_batch_size": 2,
        "torch_autocast": {
            "enabled": True,
            "dtype": "bfloat16",
            "lower_precision_safe_modules": ["torch.nn.Linear"],
        },
    }
    cfg = fsdpx.Config.from_deepspeed(ds, world_size=2)
    assert (cfg.precision.autocast, cfg.precision.param_dtype, cfg.precision.reduce_dtype) == (
        "bf16",
        "fp32",
        "fp32",
    )
    with pytest.raises(ValueError, match="fsdpx's autocast runs in bfloat16 only"):
        fsdpx.Config.from_deepspeed(
            {"train_batch_size": 2, "torch_autocast": {"enabled": True, "dtype": "fp16"}},
            world_size=2,
        )
    with pytest.raises(ValueError, match="torch_autocast and bf16/fp16 are both enabled"):
        fsdpx.Config.from_deepspeed(
            {**ds, "bf16": {"enabled": True}},
            world_size=2,
        )
