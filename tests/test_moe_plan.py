"""moe.plan: MoE blocks fsdpx does not recognise, described by a glob -> router / experts /
shared experts plan (fsdpx/moe/plan.py), against the unconverted model."""

from __future__ import annotations

import copy

import pytest
import torch

from fsdpx.config import Config, MeshConfig, MoEPlanEntry
from fsdpx.moe.parallel import check_expert_parallel
from fsdpx.moe.plan import apply_moe_plan, planned_blocks
from fsdpx.parallel_dims import ParallelDims
from tests import moe_plan_bodies as pb
from tests.dist import run_ranks


def _plan(**changes: object) -> dict[str, MoEPlanEntry]:
    entry = {**pb.PLAN["layers.*.moe"], **changes}
    return Config.from_dict({"moe": {"plan": {"layers.*.moe": entry}}}).moe.plan or {}


def test_planned_model_computes_what_the_model_computes() -> None:
    model = pb.make_model()
    planned = copy.deepcopy(model)
    assert apply_moe_plan(planned, _plan()) == pb.LAYERS
    names = [n for n, _, _ in planned_blocks(planned)]
    assert names == ["layers.0.moe", "layers.1.moe"]
    stacked = planned.get_parameter("layers.0.moe.experts.expert.up.weight")
    assert stacked.shape == (pb.EXPERTS, 12, pb.D)  # expert j is row j
    torch.testing.assert_close(stacked[3], model.get_parameter("layers.0.moe.experts.3.up.weight"))
    x = torch.randn(3, 5, pb.D)
    torch.testing.assert_close(planned(x), model(x))


def test_router_logits_are_returned_when_asked() -> None:
    planned = pb.make_model()
    apply_moe_plan(planned, _plan(return_router_logits=True))
    out, logits = planned.layers[0].moe(torch.randn(2, 3, pb.D))
    assert out.shape == (2, 3, pb.D) and logits.shape == (6, pb.EXPERTS)


@pytest.mark.parametrize(
    ("plan", "match"),
    [
        ({"blocks.*.moe": pb.PLAN["layers.*.moe"]}, r"glob 'blocks\.\*\.moe' matches no module"),
        (
            {"layers.*.moe": {**pb.PLAN["layers.*.moe"], "router": "router"}},
            r"block 'layers\.0\.moe' \(LoopMoE\) has no submodule 'router' for router",
        ),
        (
            {"layers.*.moe": {**pb.PLAN["layers.*.moe"], "experts": "shared"}},
            r"layers\.0\.moe\.shared must be an nn\.ModuleList of 2 or more expert modules; got MLP",
        ),
        (
            {"layers.*.moe": {**pb.PLAN["layers.*.moe"], "top_k": 5}},
            r"top_k \(5\) exceeds the 4 experts of 'layers\.0\.moe'",
        ),
        (
            {"layers.*.moe": pb.PLAN["layers.*.moe"], "layers.0.*": pb.PLAN["layers.*.moe"]},
            r"module 'layers\.0\.moe' is matched by moe\.plan globs",
        ),
    ],
)
def test_bad_plans_are_errors(plan: dict[str, object], match: str) -> None:
    parsed = Config.from_dict({"moe": {"plan": plan}}).moe.plan
    with pytest.raises(ValueError, match=match):
        apply_moe_plan(pb.make_model(), parsed)


def test_plan_entry_needs_router_and_experts() -> None:
    with pytest.raises(
        ValueError, match=r"'moe\.plan\.\*\.router' must be the name of a submodule"
    ):
        Config.from_dict({"moe": {"plan": {"x": {"experts": "experts"}}}})


def test_planned_experts_must_divide_by_ep() -> None:
    model = pb.make_model()
    apply_moe_plan(model, _plan())
    dims = ParallelDims.from_config(MeshConfig(ep=3), world_size=3)
    with pytest.raises(
        ValueError, match=r"'layers\.0\.moe' has 4 experts, not divisible by mesh\.ep \(3\)"
    ):
        check_expert_parallel(model, dims, 3)


def test_plan_ep2_matches_one_process_two_ranks() -> None:
    """ep = 2 on 2 ranks, ZeRO-3: outputs equal the unconverted model's, then 3 AdamW steps
    (losses, parameters with the experts stacked) equal one process training the
    unconverted model; every routed token is computed once (moe_tokens over the ranks)."""
    results = run_ranks(pb.plan_ep_body, 2, args=({"mesh": {"ep": 2}, "zero": {"stage": 3}},))
    outputs, losses, params = pb.reference_run(dp=2)
    assert sum(r["rows"] for r in results) == 2 * pb.LAYERS * pb.SEQS * pb.TOKENS * pb.K
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["output"], outputs[rank])
        torch.testing.assert_close(r["losses"], losses)
        assert r["params"].keys() == params.keys()
        for name, p in params.items():
            torch.testing.assert_close(r["params"][name], p, msg=lambda m, n=name: f"{n}: {m}")
        # Rank r sent r + 1 rows of D floats to each of the 2 ranks, one of them itself.
        assert r["sent"] == (rank + 1) * pb.D * 4
