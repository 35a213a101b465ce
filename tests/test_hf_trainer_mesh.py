"""fsdpx.hf.Trainer beyond data parallelism, on 2 gloo ranks against the stock Trainer on
one process (same data, seed, global batch): tensor parallel (mesh.tp = 2, a tiny Llama)
and expert parallel (mesh.ep = 2, a tiny Mixtral), ZeRO-3, accumulation 2, clipping on
every step, the linear schedule; evaluate() and predict() over the dp ranks; checkpoint-N
resume and save_model() in Hugging Face layout. Pipeline and sequence parallel meshes are
refused (tests/test_hf_trainer_config.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist import run_ranks
from tests.hf_trainer_mesh_bodies import MESH_CASES, meshed, stock

pytest.importorskip("transformers")

CASES = list(MESH_CASES)


def _env(world: int) -> dict[str, str]:
    return {"LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("hf_trainer_mesh")
    reference = run_ranks(stock, 1, (str(tmp), CASES), env=_env(1))[0]
    ours = run_ranks(meshed, 2, (str(tmp), CASES), env=_env(2))
    return {"tmp": tmp, "reference": reference, "ours": ours}


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_match_the_stock_trainer(runs: dict[str, Any], case: str) -> None:
    ref = runs["reference"][case]
    want_mesh = {"tp2": {"tp": 2, "ep": 1, "dp": 1}, "ep2": {"tp": 1, "ep": 2, "dp": 2}}[case]
    for rank_result in runs["ours"]:
        ours = rank_result[case]
        assert ours["mesh"] == want_mesh
        # micro x accumulation x dp ranks: the global batch of the one-process run
        assert ours["total_batch"] == ref["total_batch"] == 8
        assert len(ours["losses"]) == len(ref["losses"]) == 4
        torch.testing.assert_close(ours["losses"], ref["losses"])
        assert all(n is not None and n > 0.1 for n in ours["grad_norms"])  # clipping was active
        assert ours["params"].keys() == ref["params"].keys()
        for name, value in ref["params"].items():
            torch.testing.assert_close(ours["params"][name], value, msg=name)
        torch.testing.assert_close(ours["eval_loss"], ref["eval_loss"])
        # every sample once, in the dataset's order (not once per tensor-parallel rank)
        assert ours["predictions"].shape == ref["predictions"].shape == (16, 16, 128)
        torch.testing.assert_close(ours["predictions"], ref["predictions"])


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
