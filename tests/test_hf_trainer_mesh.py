"""fsdpx.hf.Trainer beyond data parallelism, on 2 gloo ranks against the stock Trainer on
one process (same data, seed, global batch): tensor parallel (mesh.tp = 2, a tiny Llama),
expert parallel (mesh.ep = 2, a tiny Mixtral) and sequence parallel (mesh.sp = 2, Ulysses
and ring attention, a tiny Llama, -100 labels spread unevenly over the sequence halves;
Ulysses again with average_tokens_across_devices off),
ZeRO-3, accumulation 2, clipping on every step, the linear schedule; evaluate() and
predict() over the dp ranks; checkpoint-N resume and save_model() in Hugging Face layout.
Pipeline meshes are refused (tests/test_hf_trainer_config.py). In the slow tier, tp 2 x
dp 2 on 4 ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist import run_ranks
from tests.hf_trainer_mesh_bodies import meshed, stock

pytest.importorskip("transformers")

CASES = ["tp2", "ep2", "sp2", "sp2ring", "sp2local"]
MESHES = {
    "tp2": {"tp": 2, "sp": 1, "ep": 1, "dp": 1},
    "ep2": {"tp": 1, "sp": 1, "ep": 2, "dp": 2},
    "sp2": {"tp": 1, "sp": 2, "ep": 1, "dp": 1},
    "sp2ring": {"tp": 1, "sp": 2, "ep": 1, "dp": 1},
    "sp2local": {"tp": 1, "sp": 2, "ep": 1, "dp": 1},
    "tp2dp2": {"tp": 2, "sp": 1, "ep": 1, "dp": 2},
}


def _env(world: int) -> dict[str, str]:
    return {"LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("hf_trainer_mesh")
    reference = run_ranks(stock, 1, (str(tmp), CASES), env=_env(1))[0]
    ours = run_ranks(meshed, 2, (str(tmp), CASES), env=_env(2))
    return {"tmp": tmp, "reference": reference, "ours": ours}


def _matches(ours: dict[str, Any], ref: dict[str, Any], mesh: dict[str, int]) -> None:
    assert ours["mesh"] == mesh
    # micro x accumulation x dp ranks: the global batch of the one-process run
    assert ours["total_batch"] == ref["total_batch"] == 8
    assert len(ours["losses"]) == len(ref["losses"]) == 4
    # Under sp each rank sums the cross-entropy of its half of the sequence and the halves
    # are added in the gradient reduction: the order of the fp32 sums differs from one
    # process's, so the losses (python floats) compare at fp32 tolerance.
    fp32: dict[str, Any] = {"rtol": 1.3e-6, "atol": 1e-5} if mesh["sp"] > 1 else {}
    torch.testing.assert_close(ours["losses"], ref["losses"], **fp32)
    assert all(n is not None and n > 0.1 for n in ours["grad_norms"])  # clipping was active
    # The norms before clipping: the gradients' scale, which Adam and clipping would hide
    # from the losses and parameters (fp32 tolerance: a sum over differently split tensors).
    torch.testing.assert_close(ours["grad_norms"], ref["grad_norms"], rtol=1.3e-6, atol=1e-5)
    assert ours["params"].keys() == ref["params"].keys()
    for name, value in ref["params"].items():
        torch.testing.assert_close(ours["params"][name], value, msg=name)
    torch.testing.assert_close(ours["eval_loss"], ref["eval_loss"], **fp32)
    # every sample once, in the dataset's order (not once per tensor-parallel rank)
    assert ours["predictions"].shape == ref["predictions"].shape == (16, 16, 128)
    torch.testing.assert_close(ours["predictions"], ref["predictions"])


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_match_the_stock_trainer(runs: dict[str, Any], case: str) -> None:
    for rank_result in runs["ours"]:
        _matches(rank_result[case], runs["reference"][case], MESHES[case])


@pytest.mark.slow
def test_tp2_dp2_on_four_ranks_matches_the_stock_trainer(tmp_path: Path) -> None:
    """Two tensor-parallel groups: each group's ranks get the same samples, the groups
    different ones (the dp split of [Note: Trainer data over dp]); resume and save too."""
    reference = run_ranks(stock, 1, (str(tmp_path), ["tp2"]), env=_env(1))[0]["tp2"]
    ours = run_ranks(meshed, 4, (str(tmp_path), ["tp2dp2"]), env=_env(4))
    for rank_result in ours:
        _matches(rank_result["tp2dp2"], reference, MESHES["tp2dp2"])
        assert rank_result["tp2dp2"]["resumed_losses"] == rank_result["tp2dp2"]["losses"]


@pytest.mark.parametrize("case", CASES)
def test_resume_from_checkpoint_and_save_model(runs: dict[str, Any], case: str) -> None:
    """checkpoint-4 removed, the run resumed from checkpoint-2: steps 3 and 4 log bitwise
    the uninterrupted losses and end at bitwise its weights; save_model() loads in plain
    transformers with those weights."""
    from transformers import AutoModelForCausalLM

    for rank_result in runs["ours"]:
        ours = rank_result[case]
        assert ours["resumed_losses"] == ours["losses"]  # steps 1-2 from trainer_state.json
        for name, value in ours["params"].items():
            torch.testing.assert_close(ours["resumed_params"][name], value, rtol=0, atol=0)
    final = Path(runs["tmp"]) / case / "final"
    plain = AutoModelForCausalLM.from_pretrained(final).state_dict()
    for name, value in runs["ours"][0][case]["params"].items():
        torch.testing.assert_close(plain[name], value, rtol=0, atol=0, msg=name)
