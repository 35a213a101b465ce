"""Automatic expert parallelism for MoE blocks with one module per expert
(fsdpx/moe/hf_per_expert.py): Mixtral's `experts.N.w1 / w2 / w3` and Qwen-MoE's
`experts.N.gate_proj / up_proj / down_proj` with a gated shared expert, built as the hub's
remote code writes them (tests/moe_per_expert_bodies.py). Under mesh.ep = 2 the logits
equal the unparallelised model's and 3 AdamW steps match one process on the same per-rank
batches, every parameter under its own name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fsdpx.moe.hf_per_expert import check_per_expert, per_expert_blocks
from tests import moe_hf_bodies as hb
from tests import moe_per_expert_bodies as pb
from tests.dist import run_ranks
from tests.test_moe_hf import _check


def test_mixtral_and_qwen_per_expert_ep2() -> None:
    pytest.importorskip("transformers")
    kinds = ["mixtral_per_expert", "qwen_per_expert"]
    results = run_ranks(
        hb.ep_sweep_body, 2, args=(kinds, {"mesh": {"ep": 2}, "zero": {"stage": 3}})
    )
    _check(results, kinds, dp=2)
    names = results[0]["mixtral_per_expert"]["params"]
    assert "model.layers.0.mlp.experts.3.w1.weight" in names  # the model's own names
    assert names["model.layers.0.mlp.experts.3.w1.weight"].shape == (pb.FFN, pb.D)


def test_per_expert_blocks_found_and_refused() -> None:
    block = pb.PerExpertBlock(qwen=False)
    model = nn.Sequential(block)
    assert [n for n, _ in per_expert_blocks(model)] == ["0"]
    check_per_expert("0", block, ep=2)
    with pytest.raises(
        ValueError, match=r"experts of '0' number 4, not divisible by mesh.ep \(3\)"
    ):
        check_per_expert("0", block, ep=3)
    block.jitter_noise = 0.1  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"0 multiplies its inputs by router jitter noise"):
        check_per_expert("0", block, ep=2)
    block.jitter_noise = 0.0  # type: ignore[assignment]
    block.experts[1].w2 = nn.Linear(pb.FFN, pb.D, bias=True)
    with pytest.raises(ValueError, match=r"0.experts.1 has parameters .*\['w2.bias'\]"):
        check_per_expert("0", block, ep=2)


def test_return_convention_probed_from_the_block() -> None:
    """transformers 4's blocks return (hidden, router_logits), transformers 5's the hidden
    states: the expert-parallel forward returns what the block's own forward returns."""
    from fsdpx.moe.hf_per_expert import _returns_tuple

    assert _returns_tuple(pb.PerExpertBlock(qwen=True, tuple_out=True))
    assert not _returns_tuple(pb.PerExpertBlock(qwen=True))


@pytest.mark.slow  # default-tier twin: test_mixtral_and_qwen_per_expert_ep2 (same layout)
def test_per_expert_checkpoint_saved_at_ep2_loads_without_ep(tmp_path: Path) -> None:
    """Per-expert names are DTensors over ep at save, plain FSDP shards at load: bitwise."""
    pytest.importorskip("transformers")
    cfg = {"zero": {"stage": 3}}
    args = ("mixtral_per_expert", {**cfg, "mesh": {"ep": 2}}, cfg, str(tmp_path))
    for rank, (saved, loaded) in enumerate(run_ranks(pb.ckpt_body, 2, args=args)):
        assert saved.keys() == loaded.keys(), f"rank {rank}"
        assert "model.layers.1.mlp.experts.2.w3.weight.exp_avg" in saved
        for key, value in saved.items():
            assert torch.equal(value, loaded[key]), f"rank {rank}: {key} differs after the load"


@pytest.mark.slow  # default-tier twin: test_mixtral_and_qwen_per_expert_ep2 (edp 1)
def test_per_expert_ep2_times_edp2() -> None:
    """4 ranks: ep 2 x expert-data-parallel 2 (the experts' rows FSDP-sharded over edp)."""
    pytest.importorskip("transformers")
    kinds = ["mixtral_per_expert"]
    _check(run_ranks(hb.ep_sweep_body, 4, args=(kinds, {"mesh": {"ep": 2}})), kinds, dp=4)
