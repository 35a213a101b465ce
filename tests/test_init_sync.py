"""Rank 0's initial weights on every rank ([Note: rank 0's initial weights] in
fsdpx/init_sync.py): ranks that build the model with different seeds start from, and
train, the single-process model built with rank 0's seed, in every layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fsdpx
from fsdpx.demo.gpt import GPT, shard_batch
from fsdpx.init_sync import broadcast_initial_state_
from fsdpx.parallel_dims import ParallelDims
from tests import tp_bodies as tb
from tests.dist import run_ranks

STEPS = 2
WORLD = 4


def buffered_gpt(seed: int) -> GPT:
    """tb.make_model(seed) plus a random float buffer and a random bool buffer in the first
    and last blocks (kept by the pipeline stages that hold those blocks)."""
    model = tb.make_model(seed)
    for block in (model.blocks[0], model.blocks[-1]):
        block.register_buffer("noise", torch.randn(8))
        block.register_buffer("mask", torch.rand(8) > 0.5, persistent=False)
    return model


def _seed(rank: int) -> int:
    return 0 if rank == 0 else 1000 + rank  # rank 0 builds the reference's model


def _named_state(module: nn.Module) -> dict[str, torch.Tensor]:
    items = [*module.named_parameters(), *module.named_buffers()]
    return {n: tb._full(t) for n, t in items}


def layout_run(rank: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """Shard a model built with this rank's own seed; return the full values of what this
    rank holds right after shard, then the losses and parameters after STEPS steps."""
    cfg = fsdpx.Config.from_dict(cfg_dict)
    engine = fsdpx.shard(buffered_gpt(_seed(rank)), cfg, loss_fn=tb.lm_loss)
    initial = _named_state(engine.module)
    dp_mesh = ParallelDims.dp_mesh(engine.mesh)
    dp_rank, dp = dp_mesh.get_local_rank(), dp_mesh.size()
    losses = []
    for micro in tb.global_batches(STEPS, cfg.gradient_accumulation_steps):
        data = iter([(shard_batch(x, dp_rank, dp), shard_batch(y, dp_rank, dp)) for x, y in micro])
        losses.append(float(engine.train_batch(data)))
    params = {n: tb._full(p) for n, p in engine.module.named_parameters()}
    return {"initial": initial, "losses": losses, "params": params}


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 4)
        self.b.weight = nn.Parameter(self.a.weight.t())  # non-contiguous
        self.tied = self.a  # the same module twice: its tensors are sent once
        self.register_buffer("flags", torch.rand(5) > 0.5)


def function_checks(rank: int) -> dict[str, Any]:
    """broadcast_initial_state_ on its own: values, bytes, meta, mismatch."""
    torch.manual_seed(_seed(rank))
    model = Tied()
    got = broadcast_initial_state_(model)
    state = {n: t.clone() for n, t in model.state_dict().items()}
    # 24 + 6 weight/bias of a, 24 + 4 of b, in fp32; 5 bools.
    assert got == (24 + 6 + 24 + 4) * 4 + 5, got
    with torch.device("meta"):
        meta = Tied()
    meta_bytes = broadcast_initial_state_(meta)
    part = Tied().to("meta")
    part.register_buffer("table", torch.randn(3))
    broadcast_initial_state_(part)
    assert part.a.weight.is_meta
    other = nn.Linear(4, 6 if rank == 0 else 7)
    with pytest.raises(
        ValueError,
        match=r"the ranks built different models \(parameter/buffer names, shapes or dtypes "
        r"differ; rank \d has 2 tensors\): .* build the model with the same code and "
        "arguments on all ranks",
    ):
        broadcast_initial_state_(other)
    return {"state": state, "meta_bytes": meta_bytes, "table": part.table}


def body(rank: int, world_size: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out = {name: layout_run(rank, cfg) for name, cfg in cases.items()}
    out["function"] = function_checks(rank)
    return out


def _cfg(stage: int = 3, gas: int = 2, **sections: Any) -> dict[str, Any]:
    return tb.base_cfg(gas, zero={"stage": stage}, **sections)


# (config, data-parallel size) per layout on WORLD ranks.
CASES: dict[str, tuple[dict[str, Any], int]] = {
    **{f"stage{s}": (_cfg(s), 4) for s in (0, 1, 2, 3)},
    "hsdp2x2": (_cfg(3, mesh={"dp_replicate": 2, "dp_shard": 2}), 4),
    "dp2_tp2": (_cfg(3, mesh={"tp": 2}), 2),
    "dp2_pp2": (_cfg(1, mesh={"pp": 2}, pipeline={"schedule": "1F1B"}), 2),
    "tp2_pp2": (_cfg(1, mesh={"pp": 2, "tp": 2}, pipeline={"schedule": "1F1B"}), 1),
}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    # One spawn for every case (STYLE.md habit 8).
    return run_ranks(body, WORLD, ({n: c for n, (c, _) in CASES.items()},), timeout_s=600)


def test_every_layout_starts_from_and_trains_rank0s_model(results: list[dict[str, Any]]) -> None:
    expected = _named_state(buffered_gpt(0))
    for name, (cfg, dp) in CASES.items():
        ref = tb.reference(cfg, dp=dp, steps=STEPS)
        seen: set[str] = set()
        for rank, per_rank in enumerate(results):
            got, msg = per_rank[name], f"{name} rank {rank}"
            for key, value in got["initial"].items():
                seen.add(key)
                tb.close(value, expected[key], f"{msg} initial {key}")
            tb.close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), f"{msg} losses")
            for key, value in got["params"].items():
                tb.close(value, ref["params"][key], f"{msg} param {key}")
        assert seen == set(expected), f"{name}: held by no rank: {set(expected) - seen}"


def test_without_the_sync_ranks_would_differ() -> None:
    # Guards the test above against passing vacuously: the per-rank seeds do build
    # different models.
    a, b = _named_state(buffered_gpt(_seed(0))), _named_state(buffered_gpt(_seed(1)))
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_function_values_bytes_meta_and_mismatch(results: list[dict[str, Any]]) -> None:
    torch.manual_seed(0)
    ref = Tied()
    for rank, per_rank in enumerate(results):
        got = per_rank["function"]
        for key, value in ref.state_dict().items():
            tb.close(got["state"][key], value, f"rank {rank} {key}")
        assert got["meta_bytes"] == 0
        real = results[0]["function"]["table"]
        tb.close(got["table"], real, f"rank {rank} real buffer of a meta model")
