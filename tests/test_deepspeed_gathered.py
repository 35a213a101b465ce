"""`fsdpx.deepspeed.zero.GatheredParameters` on 2 gloo ranks at ZeRO stages 0-3 (and 3 with
ZeRO-Offload): reads are
the full parameters, modifier_rank's writes reach every shard and training goes on from
them as a single process would, modifier_rank=None drops writes, refusals are errors."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests import ds_gather_bodies as bodies
from tests.dist import run_ranks

CASES = ["0", "1", "2", "3", "3+offload"]
EDITED = (bodies.MLP_W, bodies.LN_W, bodies.WTE)


@pytest.fixture(scope="module")
def swept() -> list[dict[str, Any]]:
    return run_ranks(bodies.stages_body, 2, (CASES,))


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, torch.Tensor]]:
    return bodies.reference()


def _named(name: str, message: str) -> str:
    return f"{name}: {message}"


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=functools.partial(_named, name))


@pytest.mark.parametrize("case", CASES)
def test_reads_are_the_full_parameters(
    swept: list[dict[str, Any]], case: str, reference: Any
) -> None:
    for res in (r[case] for r in swept):
        _close(res["before"], reference["step1"])
        for name, value in res["read"].items():
            assert torch.equal(value, res["before"][name]), name
        assert res["read_types"] == {"Parameter"}  # plain full tensors, not DTensors
        assert res["after_read_types"] == {"DTensor"}


@pytest.mark.parametrize("case", CASES)
def test_modifier_rank_none_drops_writes(swept: list[dict[str, Any]], case: str) -> None:
    for res in (r[case] for r in swept):
        for name, value in res["after_none"].items():
            assert torch.equal(value, res["before"][name]), name


@pytest.mark.parametrize("case", CASES)
def test_disabled_nested_and_duplicates(swept: list[dict[str, Any]], case: str) -> None:
    for res in (r[case] for r in swept):
        assert res["disabled_type"] == "DTensor"
        assert res["nested"] == [(128, 32), (32,)]
        assert res["after_nested_types"] == {"DTensor"}


@pytest.mark.parametrize("case", CASES)
def test_modifier_rank_writes_reach_every_shard_and_training_goes_on(
    swept: list[dict[str, Any]], case: str, reference: Any
) -> None:
    for res in (r[case] for r in swept):
        _close(res["after_modify"], reference["modified"])
        assert float(res["after_modify"][bodies.WTE][3, 0]) == -1.0  # rank 0's, not -2.0
        for name in res["before"]:
            if name not in EDITED:
                assert torch.equal(res["after_modify"][name], res["before"][name]), name
        _close(res["trained"], reference["step2"])


def test_refusals_and_no_ops() -> None:
    results = run_ranks(bodies.refusals_body, 2)
    assert [r["plain"] for r in results] == [0.0, 1.0]  # plain tensors: untouched, per rank
    assert all(r["restored"] for r in results)


def test_hsdp_and_tensor_parallel_meshes() -> None:
    results = run_ranks(bodies.mesh_body, 4)
    initial = {n: p.detach() for n, p in bodies.small_model().named_parameters()}
    expected = bodies.mesh_reference()
    for rank, res in enumerate(results):
        for layout in ("hsdp", "tp"):
            _close(res[layout]["read"], initial)
            _close(res[layout]["after"], expected)
            assert float(res[layout]["after"]["0.weight"][1, 0]) == 13.0, (rank, layout)


def test_between_micro_steps_inside_forward_and_a_reshaped_modification() -> None:
    for res in run_ranks(bodies.lifecycle_body, 2):
        assert res["True"]["kinds"] == {"Parameter"}  # FSDP2's unsharded plain tensors
        initial = dict(bodies.make_model().named_parameters())
        for name, value in res["True"]["reads"].items():
            assert torch.equal(value, initial[name].detach()), name
        for name, value in res["True"]["params"].items():
            assert torch.equal(value, res["False"]["params"][name]), name
        assert len(res["hook_errors"]) == 1
        assert "cannot run inside the forward or backward" in res["hook_errors"][0]
        assert res["unchanged"]
