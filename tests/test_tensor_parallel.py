"""Tensor (and sequence) parallelism: parity of dp2 x tp2 (automatic plan, a user plan,
+ SP, + SP and loss parallel) with a single process, the automatic plan on GPT-2-style and
Llama-style models, and every plan error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdpx.config import Config, TensorParallelConfig
from fsdpx.demo.gpt import GPT, GPTConfig
from fsdpx.tensor_parallel import build_plan, check_plan
from fsdpx.tp_plans import auto_plan, user_plan
from tests import tp_bodies as tb
from tests.dist import run_ranks

CASES = {
    "dp2_tp2": tb.base_cfg(2, mesh={"tp": 2}),
    "dp2_tp2_sp": tb.base_cfg(2, mesh={"tp": 2}, tensor_parallel={"sequence_parallel": True}),
    "dp2_tp2_user_plan": tb.base_cfg(
        2,
        mesh={"tp": 2},
        tensor_parallel={
            "plan": {"blocks.*.mlp.up_proj": "colwise", "blocks.*.mlp.down_proj": "rowwise"}
        },
    ),
    "dp2_tp2_sp_loss_parallel": tb.base_cfg(
        2, mesh={"tp": 2}, tensor_parallel={"sequence_parallel": True, "loss_parallel": True}
    ),
}


def test_dp2_tp2_plans_sp_and_loss_parallel_match_single_process() -> None:
    results = run_ranks(tb.sweep_body, 4, (CASES,))
    for name, cfg in CASES.items():
        tb.check_against_reference(results, tb.reference(cfg, dp=2), name)


def test_auto_plan_on_gpt2_and_llama_style_models_keeps_the_forward() -> None:
    diffs = run_ranks(tb.hf_style_forward_body, 2)
    print("max abs logit diff vs unparallelised:", diffs[0])


def _gpt(**kw: int) -> GPT:
    cfg = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, bias=False)
    cfg.update(kw)
    with torch.device("meta"):
        return GPT(GPTConfig(**cfg))  # type: ignore[arg-type]


def _blocks(prefix: str, n: int) -> list[str]:
    return [f"{prefix}.{i}" for i in range(n)]


def test_auto_plan_of_the_example_gpt() -> None:
    plan = auto_plan(_gpt(), _blocks("blocks", 2), sequence_parallel=True)
    assert plan.styles["blocks.1.attn.q_proj"] == "colwise"
    assert plan.styles["blocks.1.attn.o_proj"] == "rowwise"
    assert plan.styles["blocks.0.mlp.up_proj"] == "colwise"
    assert plan.styles["blocks.0.mlp.down_proj"] == "rowwise"
    assert plan.styles["blocks.0.ln_2"] == "sequence_parallel"
    assert "lm_head" not in plan.styles and "wte" not in plan.styles
    assert plan.head_owners == ["blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"]


def test_auto_plan_of_gpt2_layout_splits_conv1d_mlp_and_keeps_fused_attention() -> None:
    plan = auto_plan(tb.GPT2LMHeadModel(), _blocks("transformer.h", 2), sequence_parallel=False)
    assert plan.styles["transformer.h.0.mlp.c_fc"] == "colwise"
    assert plan.styles["transformer.h.0.mlp.c_proj"] == "rowwise"
    # c_attn is a fused q/k/v: its c_proj partner stays replicated too.
    assert "transformer.h.0.attn.c_attn" not in plan.styles
    assert "transformer.h.0.attn.c_proj" not in plan.styles


def test_auto_plan_of_llama_layout() -> None:
    plan = auto_plan(tb.LlamaForCausalLM(), _blocks("model.layers", 2), sequence_parallel=True)
    for leaf in ("q_proj", "k_proj", "v_proj"):
        assert plan.styles[f"model.layers.1.self_attn.{leaf}"] == "colwise"
    assert plan.styles["model.layers.1.self_attn.o_proj"] == "rowwise"
    assert plan.styles["model.layers.1.mlp.gate_proj"] == "colwise"
    assert plan.styles["model.layers.1.mlp.down_proj"] == "rowwise"
    assert plan.styles["model.layers.1.input_layernorm"] == "sequence_parallel"


def test_user_plan_globs_and_unknown_pattern() -> None:
    plan = user_plan(
        _gpt(), {"blocks.*.mlp.up_proj": "colwise", "blocks.*.mlp.down_proj": "rowwise"}
    )
    assert plan.styles == {
        "blocks.0.mlp.up_proj": "colwise",
        "blocks.1.mlp.up_proj": "colwise",
        "blocks.0.mlp.down_proj": "rowwise",
        "blocks.1.mlp.down_proj": "rowwise",
    }
    with pytest.raises(ValueError, match=r"pattern 'layers\.\*\.fc' matches no module of GPT"):
        user_plan(_gpt(), {"layers.*.fc": "colwise"})


def test_heads_not_divisible_by_tp_names_both_numbers() -> None:
    model = _gpt(n_head=3, n_embd=24)  # q_proj has 24 outputs (divisible by 2), 3 heads
    plan = build_plan(model, TensorParallelConfig(), _blocks("blocks", 2))
    with pytest.raises(
        ValueError,
        match=r"^tensor_parallel: blocks\.0\.attn\.n_head = 3 attention heads are not "
        r"divisible by mesh\.tp = 2; choose a tp that divides the head count$",
    ):
        check_plan(model, plan, 2)


def test_tp_not_dividing_hidden_size_names_module_size_and_tp() -> None:
    model = _gpt(n_head=2, n_embd=30)
    plan = build_plan(model, TensorParallelConfig(), _blocks("blocks", 2))
    with pytest.raises(
        ValueError,
        match=r"^tensor_parallel: mesh\.tp = 4 does not divide the 30 output features of "
        r"blocks\.0\.attn\.q_proj \(colwise\); choose a tp that divides the hidden sizes$",
    ):
        check_plan(model, plan, 4)


def test_user_plan_on_a_non_linear_module_is_refused() -> None:
    model = _gpt()
    plan = build_plan(
        model, TensorParallelConfig(plan={"blocks.*.ln_1": "colwise"}), _blocks("blocks", 2)
    )
    with pytest.raises(
        ValueError, match=r"blocks\.0\.ln_1 is a LayerNorm; colwise splits nn\.Linear"
    ):
        check_plan(model, plan, 2)


def test_loss_parallel_splits_the_head_and_needs_one() -> None:
    cfg = TensorParallelConfig(loss_parallel=True)
    plan = build_plan(_gpt(), cfg, _blocks("blocks", 2))
    assert plan.styles["lm_head"] == "colwise_logits"
    model = nn.Sequential()
    model.add_module("layers", nn.ModuleList([tb.LlamaDecoderLayer(8, 2, 2) for _ in range(2)]))
    with pytest.raises(
        ValueError,
        match=r"^tensor_parallel\.loss_parallel needs the output projection: an nn\.Linear named "
        r"one of lm_head, output, head, embed_out outside the blocks; none in Sequential$",
    ):
        build_plan(model, cfg, _blocks("layers", 2))


def test_model_without_known_projections_is_refused() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with pytest.raises(
        ValueError, match=r"found no projection to split in Sequential.*tensor_parallel\.plan"
    ):
        build_plan(model, TensorParallelConfig(), ["0", "1"])


def test_config_rejects_unknown_style() -> None:
    with pytest.raises(
        ValueError,
        match=r"config key 'tensor_parallel\.plan\['a\.b'\]' must be one of 'colwise', "
        r"'rowwise', 'sequence_parallel'; got 'columnwise'",
    ):
        Config.from_dict({"tensor_parallel": {"plan": {"a.b": "columnwise"}}})
