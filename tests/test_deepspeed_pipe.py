"""`fsdpx.deepspeed.pipe`: a PipelineModule through initialize + train_batch / eval_batch
on 2 pipeline ranks equals the same nn.Sequential trained in one process; its
partition methods, tied layers and errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdpx.deepspeed._partition import partition_balanced, partition_uniform
from fsdpx.deepspeed._pipe_config import pipeline_ds_config
from fsdpx.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from tests import ds_pipe_bodies as bodies
from tests.dist import run_ranks


def test_two_stages_match_a_single_process() -> None:
    # 1F1B with 4 micro-batches; GPipe (1 micro-batch < 2 stages) with the uniform split;
    # one stage (no pipeline: 2 data-parallel ranks, the same train_batch / eval_batch).
    cases = [(2, 4, "parameters"), (2, 1, "uniform"), (1, 2, "parameters")]
    results = run_ranks(bodies.pipe_body, 2, (cases,))
    for i, (stages, gas, _) in enumerate(cases):
        ref = bodies.reference(dp=3 - stages, micro=2, gas=gas, steps=bodies.STEPS)
        r0, r1 = results[0][i], results[1][i]
        assert r0["losses"] == r1["losses"] and r0["eval"] == r1["eval"]
        torch.testing.assert_close(r0["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r0["eval"], ref["eval"], rtol=1e-5, atol=1e-6)
        held = {**r0["state"], **r1["state"]}
        assert sorted(held) == sorted(ref["state"])
        if stages == 2:
            assert not set(r0["state"]) & set(r1["state"])  # each stage holds its layers
        for name, value in ref["state"].items():
            torch.testing.assert_close(held[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # 'parameters': conv1 + relu + pool + conv2 ... on stage 0, the big Linear starts stage 1.
    assert results[0][0]["parts"] == [0, 8, 11]
    assert results[0][1]["parts"] == [0, 6, 11]


def test_partitions() -> None:
    assert partition_uniform(5, 2) == [0, 3, 5]
    assert partition_uniform(2, 3) == [0, 1, 2, 2]
    # Trailing parameter-free layers stay with the layer before them.
    assert partition_balanced([10, 0, 0, 10, 0, 5], 2) == [0, 3, 6]
    assert partition_balanced([5, 0, 5, 0, 5, 0, 5, 0], 2) == [0, 4, 8]
    net = PipelineModule(
        [nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)],
        num_stages=3,
        partition_method="type:linear",
    )
    assert net.parts == [0, 2, 4, 5]
    assert net.split_points() == ("2", "4")
    assert [net.stage_owner(i) for i in range(5)] == [0, 0, 1, 1, 2]


def test_layer_names_seeding_and_forward() -> None:
    def build() -> PipelineModule:
        return PipelineModule(
            [LayerSpec(nn.Linear, 3, 4), lambda x: x * 2, LayerSpec(nn.Linear, 4, 2)],
            num_stages=1,
            seed_layers=True,
        )

    a, b = build(), build()
    assert [n for n, _ in a.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    torch.manual_seed(1234 + 2)
    torch.testing.assert_close(a.get_submodule("2").weight, nn.Linear(4, 2).weight)
    torch.testing.assert_close(a.get_submodule("0").weight, b.get_submodule("0").weight)
    x = torch.randn(5, 3)
    ref = a.get_submodule("2")(a.get_submodule("0")(x) * 2)
    torch.testing.assert_close(a(x), ref)


def test_tied_layers_share_one_module_on_one_stage() -> None:
    net = PipelineModule(
        [
            TiedLayerSpec("w", nn.Linear, 4, 4, bias=False),
            nn.ReLU(),
            TiedLayerSpec("w", nn.Linear, 4, 4, bias=False, forward_fn=lambda m, x: x @ m.weight),
            nn.Linear(4, 4),
        ],
        num_stages=1,
    )
    assert net.get_submodule("0.module") is net.get_submodule("2.module")
    assert [n for n, _ in net.named_parameters()] == ["0.module.weight", "3.weight", "3.bias"]
    x = torch.randn(2, 4)
    w = net.get_submodule("0.module").weight
    torch.testing.assert_close(net(x), net.get_submodule("3")(torch.relu(x @ w.T) @ w))


def test_tied_layers_across_stages_match_a_single_process(tmp_path: Path) -> None:
    """The embedding on stage 0 tied to the output projection on stage 1: both copies get
    the summed gradient and stay equal to the one tied weight of a single-process run,
    with clipping on (the norm counts the tie once; counted twice, the clip factor and so
    every weight would differ); a checkpoint holds both copies and resumes exactly."""
    gas, clip = 2, 0.05
    results = run_ranks(bodies.tied_body, 2, (gas, clip, str(tmp_path / "ckpt")))
    ref = bodies.tied_reference(gas, clip)
    r0, r1 = results
    assert r0["parts"] == [0, 2, 4]
    assert r0["losses"] == r1["losses"]
    torch.testing.assert_close(r0["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
    assert sorted(r0["state"]) == ["0.module.weight", "1.bias", "1.weight"]
    assert sorted(r1["state"]) == ["3.module.weight"]
    assert torch.equal(r0["state"]["0.module.weight"], r1["state"]["3.module.weight"])
    held = {**r0["state"], **r1["state"]}
    held.pop("3.module.weight")
    assert sorted(held) == sorted(ref["state"])
    for name, value in ref["state"].items():
        torch.testing.assert_close(held[name], value, rtol=1e-5, atol=1e-6, msg=name)
    for r in results:
        assert re.search(r"stages \[0, 1\] .* is sharded differently on them", r["layout_error"])
        assert r["resumed_loss"] == r["losses"][-1]
        assert r["resumed_state"].keys() == r["state"].keys()
        assert all(torch.equal(r["resumed_state"][k], v) for k, v in r["state"].items())


def test_errors() -> None:
    with pytest.raises(ValueError, match="topology=.* is not supported.*pass num_stages"):
        PipelineModule([nn.Linear(2, 2)], topology=object())
    with pytest.raises(ValueError, match="needs num_stages >= 1; got None"):
        PipelineModule([nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=r"'type:conv' matched no layer; .*\['Linear'\]"):
        PipelineModule(
            [nn.Linear(2, 2), nn.Linear(2, 2)], num_stages=2, partition_method="type:conv"
        )
    with pytest.raises(ValueError, match="partition_method 'profile' is not supported"):
        PipelineModule([nn.Linear(2, 2)], num_stages=1, partition_method="profile")
    with pytest.raises(TypeError, match="LayerSpec takes an nn.Module subclass"):
        LayerSpec(torch.relu)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="layer 1 is a int"):
        PipelineModule([nn.Linear(2, 2), 3], num_stages=1)
    net = PipelineModule([nn.Linear(2, 2), nn.Linear(2, 2)], num_stages=3)
    with pytest.raises(ValueError, match="3 stages but only 2 layers .* Lower num_stages"):
        net.split_points()
    two = PipelineModule([nn.Linear(2, 2), nn.Linear(2, 2)], num_stages=2)
    with pytest.raises(
        ValueError, match=r"pipeline.stages = 4 but the PipelineModule has num_stages = 2"
    ):
        pipeline_ds_config(two, {"pipeline": {"stages": 4}})
    assert pipeline_ds_config(two, {})["pipeline"] == {"stages": 2}


def test_activation_checkpoint_interval_runs_chunks_with_parameters_through_the_func() -> None:
    from fsdpx.deepspeed import checkpointing

    calls: list[int] = []

    def counting(fn, *args):  # type: ignore[no-untyped-def]
        calls.append(len(args))
        return checkpointing.checkpoint(fn, *args)

    def build(interval: int) -> PipelineModule:
        torch.manual_seed(0)
        layers = [nn.Linear(4, 4), nn.ReLU(), nn.Tanh(), nn.Sigmoid(), nn.Linear(4, 2)]
        return PipelineModule(
            layers,
            num_stages=1,
            activation_checkpoint_interval=interval,
            activation_checkpoint_func=counting,
        )

    x = torch.randn(3, 4)
    plain, chunked = build(0), build(2)
    plain(x).sum().backward()
    chunked(x).sum().backward()
    # Chunks [Linear, ReLU], [Tanh, Sigmoid], [Linear]: the parameter-free one runs plainly.
    assert calls == [1, 1]
    for (name, a), (_, b) in zip(plain.named_parameters(), chunked.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_save_16bit_model_refuses_pipeline_parallelism() -> None:
    """A gather over one stage would write a silently incomplete file (it did)."""
    from types import SimpleNamespace

    from fsdpx.deepspeed._save16 import save_16bit

    engine = SimpleNamespace(
        config=SimpleNamespace(precision=SimpleNamespace(param_dtype="fp32")),
        parallel_dims=SimpleNamespace(pp=2),
    )
    for name in ("model.safetensors", "pytorch_model.bin"):
        with pytest.raises(NotImplementedError, match="each stage holds part of the model"):
            save_16bit(engine, Path("/nonexistent"), name)  # type: ignore[arg-type]


def test_find_ties_and_the_tie_refusals() -> None:
    from fsdpx.pipeline_tied import Tie, TiedGradients, find_ties

    torch.manual_seed(0)
    net = PipelineModule(bodies.tied_layers(), num_stages=2, partition_method="uniform")
    ties = find_ties(net, [["0", "1", "2"], ["3"]])
    assert ties == [Tie((0, 1), ("0.module.weight", "3.module.weight"))]
    assert find_ties(net, [["0", "1", "2", "3"]]) == []  # one stage: a plain shared weight
    with pytest.raises(NotImplementedError, match=r"one stage per rank .* stages \[0, 3\]"):
        TiedGradients(ties, [net, net], [0, 3], mesh=None)  # type: ignore[arg-type]
    tied = TiedGradients([], [net], [0], mesh=None)  # type: ignore[arg-type]
    tied._held.append((net.get_parameter("0.module.weight"), None))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="got no gradient on this stage"):
        tied.reduce()
