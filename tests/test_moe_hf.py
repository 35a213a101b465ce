"""Automatic expert parallelism for Hugging Face MoE models (fsdpx/moe/hf_experts.py):
tiny Mixtral / Qwen3-MoE / DeepSeek-V3 built from their transformers config classes.
Under mesh.ep = 2 the logits equal the unparallelised model's and 3 AdamW steps match one
process on the same per-rank batches (losses and every parameter, names unchanged)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from fsdpx.moe.hf_experts import check_fused, fused_experts
from tests import moe_hf_bodies as hb
from tests.dist import run_ranks


def _check(results: list[dict[str, Any]], kinds: list[str], dp: int) -> None:
    for kind in kinds:
        ref = hb.reference(kind, dp)
        for rank, by_kind in enumerate(results):
            out = by_kind[kind]
            where = f"{kind}, rank {rank}"
            assert out["classes"], f"{where}: no experts module was switched to expert parallelism"
            torch.testing.assert_close(out["logits"], ref["logits"][rank % dp], msg=where)
            torch.testing.assert_close(out["losses"], ref["losses"], msg=where)
            assert out["params"].keys() == ref["params"].keys(), where
            for n, p in ref["params"].items():
                torch.testing.assert_close(out["params"][n], p, msg=f"{where}: {n}")


def test_mixtral_and_qwen3_moe_ep2() -> None:
    kinds = ["mixtral", "qwen3_moe"]
    cfg = {"mesh": {"ep": 2}, "zero": {"stage": 3}}
    _check(run_ranks(hb.ep_sweep_body, 2, args=(kinds, cfg)), kinds, dp=2)


@pytest.mark.slow  # default-tier twin: test_moe_parallel's meta-built ep = 2 parity
def test_from_pretrained_under_ep2(tmp_path: Path) -> None:
    """A saved Mixtral loaded by fsdpx.hf.from_pretrained at ep = 2 (built on the meta
    device, experts split over ep while each rank reads its byte ranges): the logits of the
    model that was saved."""
    model = hb.make_model("mixtral")
    # The fused names as the model holds them: transformers' save_pretrained writes the
    # per-expert layout of the original checkpoints (experts.N.w1 ...), which fsdpx.hf's
    # loader does not convert (README, Known limits).
    model.config.save_pretrained(tmp_path)
    state = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    model.eval()
    with torch.no_grad():
        expected = [model(input_ids=ids).logits for ids in hb.batches(2)[0]]
    cfg = {"mesh": {"ep": 2}, "zero": {"stage": 3}}
    results = run_ranks(hb.from_pretrained_body, 2, args=(str(tmp_path), cfg))
    for rank, out in enumerate(results):
        assert out["classes"], f"rank {rank}: experts not switched to expert parallelism"
        torch.testing.assert_close(out["logits"], expected[rank], msg=f"rank {rank}")


@pytest.mark.slow
def test_deepseek_v3_and_ep2_times_edp2() -> None:
    """DeepSeek-V3 (shared experts, grouped routing) at ep = 2; Mixtral at ep = 2 x edp = 2."""
    _check(
        run_ranks(hb.ep_sweep_body, 2, args=(["deepseek_v3"], {"mesh": {"ep": 2}})),
        ["deepseek_v3"],
        dp=2,
    )
    _check(
        run_ranks(hb.ep_sweep_body, 4, args=(["mixtral"], {"mesh": {"ep": 2}})), ["mixtral"], dp=4
    )


def test_fused_experts_found_and_layouts_refused() -> None:
    model = hb.make_model("mixtral")
    found = fused_experts(model)
    assert [n for n, _ in found] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    name, experts = found[0]
    check_fused(name, experts, ep=2)
    with pytest.raises(ValueError, match=r"number 4, not divisible by mesh.ep \(3\)"):
        check_fused(name, experts, ep=3)
    experts.has_bias = True
    with pytest.raises(ValueError, match=r"have has_bias=True; fsdpx's expert parallelism"):
        check_fused(name, experts, ep=2)
