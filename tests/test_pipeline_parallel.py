"""Pipeline parallelism: dp2 x pp2 with every torch schedule equals a single process; the
zero-bubble regression that per-block resharding would cause; stage splitting and every
layout error."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from fsdpx.config import PIPELINE_SCHEDULES, Config, PipelineConfig
from fsdpx.demo.gpt import GPT, GPTConfig
from fsdpx.pipeline_parallel import check_schedule
from fsdpx.pipeline_split import merged_view, model_units, plan_stages, prune_to_stage, stage_ids
from tests import pp_bodies as pb
from tests import tp_bodies as tb
from tests.dist import run_ranks

SINGLE = ("GPipe", "1F1B")


def _pp_cfg(schedule: str, gas: int = 4) -> dict[str, Any]:
    spr = 1 if schedule in SINGLE else 2
    return tb.base_cfg(gas, mesh={"pp": 2}, pipeline={"schedule": schedule, "stages_per_rank": spr})


SCHEDULE_CASES = {s: _pp_cfg(s) for s in PIPELINE_SCHEDULES}
# ZeRO-1 over a replicate axis (DDP-like data axis) under the pipeline.
SCHEDULE_CASES["1F1B_zero1_replicate2"] = tb.base_cfg(
    4, mesh={"pp": 2, "dp_replicate": 2}, zero={"stage": 1}, pipeline={"schedule": "1F1B"}
)


def test_dp2_pp2_every_schedule_matches_single_process() -> None:
    # ZeRO-3 (the default) over dp2 (and ZeRO-1 over a replicate axis); 4 micro-batches;
    # 2 or 4 stages of the 4-block GPT.
    results = run_ranks(tb.sweep_body, 4, (SCHEDULE_CASES,))
    for name, cfg in SCHEDULE_CASES.items():
        tb.check_against_reference(results, tb.reference(cfg, dp=2), name)


def test_zero_bubble_with_per_block_resharding_breaks_and_the_forced_setting_fixes_it() -> None:
    cfg = _pp_cfg("ZBVZeroBubble")
    results = run_ranks(pb.regression_body, 4, (cfg,))
    ref = tb.reference(cfg, dp=2, steps=1)["raw_grads"]
    for per_rank in results:
        for name, grad in per_rank[False].items():  # fsdpx's setting: exact
            assert grad is not None, name
            tb.close(grad, ref[name], name)
    # reshard_after_forward=True per block (ZeRO-3's setting): gradients of the last
    # stage's blocks are silently dropped (None) or wrong.
    broken = [
        name
        for per_rank in results
        for name, grad in per_rank[True].items()
        if grad is None or not torch.allclose(grad, ref[name], rtol=1.3e-6, atol=1e-5)
    ]
    assert len(broken) >= 10, broken
    # fp16 loss scaling through the schedule: no overflow (the scale is applied per
    # micro-batch as loss * scale / micro-batches, as without a pipeline), losses near fp32.
    fp16 = results[0]["fp16"]
    assert (fp16["skipped"], fp16["scale"]) == (0, 2.0**16), fp16
    fp32 = tb.reference(cfg, dp=2)["losses"]
    torch.testing.assert_close(torch.tensor(fp16["losses"]), torch.tensor(fp32), rtol=0, atol=1e-2)
    errors = results[0]["errors"]
    assert errors["no_loss"].startswith("pipeline parallelism needs loss_fn: the last stage")
    assert errors["few"] == (
        "pipeline.schedule '1F1B' needs at least as many micro-batches as stages: "
        "gradient_accumulation_steps = 1 < 2 stages; raise gradient_accumulation_steps"
    )
    assert "use engine.train_batch(data_iter)" in errors["fwd"]
    assert errors["bwd"].startswith("engine.backward is not available under pipeline")
    assert "(inputs, targets) pair" in errors["pair"]
    assert errors["meta"].startswith(
        "a model built on the meta device with mesh.tp = 1 and mesh.pp = 2 needs init_fn"
    )
    assert errors["lp_pp"].startswith(
        "tensor_parallel.loss_parallel with pipeline parallelism (mesh.pp > 1) is not implemented"
    )


# --- splitting (no processes) ---------------------------------------------------------


def _gpt(n_layer: int = 4) -> GPT:
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=n_layer, n_head=4, n_embd=32)
    with torch.device("meta"):
        return GPT(cfg)


BLOCKS = [f"blocks.{i}" for i in range(4)]


def test_units_and_even_split() -> None:
    gpt = _gpt()
    assert model_units(gpt, BLOCKS) == ["wte", "wpe", "drop", *BLOCKS, "ln_f", "lm_head"]
    stages = plan_stages(gpt, BLOCKS, 2, PipelineConfig())
    # drop has no parameters: it stays on its own stage, like every unit.
    assert stages == [
        ["wte", "wpe", "drop", "blocks.0", "blocks.1"],
        ["blocks.2", "blocks.3", "ln_f", "lm_head"],
    ]


def test_first_and_last_stage_layers() -> None:
    gpt = _gpt(n_layer=8)
    blocks = [f"blocks.{i}" for i in range(8)]
    stages = plan_stages(gpt, blocks, 4, PipelineConfig(first_stage_layers=1, last_stage_layers=1))
    held = [[u for u in s if u.startswith("blocks")] for s in stages]
    assert [len(h) for h in held] == [1, 3, 3, 1]


def test_split_points() -> None:
    stages = plan_stages(_gpt(), BLOCKS, 2, PipelineConfig(split_points=("blocks.3",)))
    assert stages[1] == ["blocks.3", "ln_f", "lm_head"]


def test_pruned_stage_keeps_full_model_names_and_runs() -> None:
    torch.manual_seed(0)
    full = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32))
    units = model_units(full, BLOCKS)
    stages = plan_stages(full, BLOCKS, 2, PipelineConfig())
    import copy

    first = prune_to_stage(copy.deepcopy(full), units, stages[0])
    last = prune_to_stage(copy.deepcopy(full), units, stages[1])
    assert any(n.startswith("blocks.3.") for n, _ in last.named_parameters())
    assert not any(n.startswith("blocks.1.") for n, _ in last.named_parameters())
    x = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(last(first(x)), full(x))
    view = merged_view([first, last])
    assert [n for n, _ in view.named_parameters()] == [n for n, _ in full.named_parameters()]
    with pytest.raises(NotImplementedError, match="use engine.train_batch"):
        view(x)


def test_stage_ids_loop_and_v() -> None:
    assert stage_ids(1, 4, 2, v_style=False) == [1, 5]
    assert stage_ids(1, 4, 2, v_style=True) == [1, 6]


def test_more_stages_than_blocks() -> None:
    with pytest.raises(
        ValueError,
        match=r"^pipeline: 8 stages \(mesh\.pp \* pipeline\.stages_per_rank\) but the model has "
        r"only 4 blocks; every stage needs at least one block\. Lower mesh\.pp or "
        r"pipeline\.stages_per_rank$",
    ):
        plan_stages(_gpt(), BLOCKS, 8, PipelineConfig())


def test_layer_counts_that_do_not_fit() -> None:
    with pytest.raises(
        ValueError, match=r"first_stage_layers=3 and last_stage_layers=2 leave -1 of"
    ):
        plan_stages(_gpt(), BLOCKS, 2, PipelineConfig(first_stage_layers=3, last_stage_layers=2))


def test_split_point_errors() -> None:
    with pytest.raises(ValueError, match=r"has 2 names, which make 3 stages; the layout needs"):
        plan_stages(_gpt(), BLOCKS, 2, PipelineConfig(split_points=("blocks.1", "blocks.2")))
    with pytest.raises(ValueError, match=r"\['blocks\.9'\] are not split units of the model"):
        plan_stages(_gpt(), BLOCKS, 2, PipelineConfig(split_points=("blocks.9",)))


@pytest.mark.parametrize(
    ("schedule", "spr", "need"),
    [
        ("1F1B", 2, "exactly 1"),
        ("GPipe", 2, "exactly 1"),
        ("ZBVZeroBubble", 1, "exactly 2"),
        ("DualPipeV", 3, "exactly 2"),
        ("Interleaved1F1B", 1, ">= 2"),
        ("LoopedBFS", 1, ">= 2"),
        ("InterleavedZeroBubble", 1, ">= 2"),
    ],
)
def test_stages_per_rank_wrong_for_schedule(schedule: str, spr: int, need: str) -> None:
    with pytest.raises(
        ValueError,
        match=rf"^pipeline\.schedule '{schedule}' needs {need} stages per rank; got "
        rf"pipeline\.stages_per_rank = {spr}$",
    ):
        check_schedule(schedule, 2, spr, 8)


def test_too_few_microbatches() -> None:
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps = 3 < 4 stages"):
        check_schedule("1F1B", 4, 1, 3)
    with pytest.raises(
        ValueError, match=r"'DualPipeV' .* gradient_accumulation_steps = 3 < 4 stages"
    ):
        check_schedule("DualPipeV", 2, 2, 3)
    with pytest.raises(
        ValueError,
        match=r"multiple of its 2 rounds \(max\(1, 5 // pp 2\)\); got 5\. Use a multiple",
    ):
        check_schedule("Interleaved1F1B", 2, 2, 5)
    check_schedule("GPipe", 4, 1, 1)  # GPipe runs any count


def test_config_layer_counts_only_with_even_split() -> None:
    with pytest.raises(
        ValueError, match=r"'pipeline\.first_stage_layers' \(1\) applies to the even split only"
    ):
        Config.from_dict({"pipeline": {"first_stage_layers": 1, "split_points": ["blocks.2"]}})


# --- parameter-free layers and in-place ops at stage boundaries ---------------------


def test_parameter_free_units_stay_on_their_own_stage() -> None:
    from tests.pp_seq_bodies import make_chain

    chain = make_chain()
    blocks = ["0", "5", "9"]
    units = model_units(chain, blocks)
    stages = plan_stages(chain, blocks, 2, PipelineConfig(split_points=("5",)))
    assert stages == [units[:5], units[5:]]
    first = prune_to_stage(copy.deepcopy(chain), units, stages[0])
    last = prune_to_stage(copy.deepcopy(chain), units, stages[1])
    x = torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(last(first(x)), chain(x.clone()))


@pytest.mark.parametrize("split_at", ["4", "5"])
def test_chain_with_inplace_ops_at_the_boundary_matches_single_process(split_at: str) -> None:
    from tests import pp_seq_bodies as sb

    ref = sb.reference_grads(split_at)
    results = run_ranks(sb.chain_body, 2, (split_at,))
    assert results[0]["held"] == [str(i) for i in range(int(split_at))]
    grads = {**results[0]["grads"], **results[1]["grads"]}
    assert sorted(grads) == sorted(ref)
    for name, g in ref.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6)
