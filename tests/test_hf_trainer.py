"""fsdpx.hf.Trainer on 2 gloo ranks against the stock transformers Trainer on one process
(same script, data, seed and global batch): ZeRO-2 and ZeRO-3, gradient accumulation 2,
clipping on every step, the linear and cosine schedules, the Trainer's optimizer and the
config's, then evaluate() and predict() (eval_accumulation_steps=1). Then resume from
checkpoint-N in fresh processes: bitwise the same losses and final weights. bf16 and fp16
runs on 2 ranks against the same on one process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist import run_ranks
from tests.hf_trainer_bodies import PARITY_CASES, fsdpx_resume, fsdpx_runs, stock_reference

pytest.importorskip("transformers")

TOL = {"bf16": 1e-2, "fp16": 1e-3}


def _env(world: int) -> dict[str, str]:
    # accelerate (under TrainingArguments) wants torchrun's view of the node; the process
    # group itself is the one tests/dist.py started, which accelerate reuses.
    return {"LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("hf_trainer")
    reference = run_ranks(stock_reference, 1, (str(tmp / "ref"),), env=_env(1))[0]
    ours = run_ranks(fsdpx_runs, 2, (str(tmp / "fsdpx"),), env=_env(2))
    return {"tmp": tmp, "reference": reference, "ours": ours}


@pytest.mark.parametrize("case", range(len(PARITY_CASES)), ids=[c["name"] for c in PARITY_CASES])
def test_two_ranks_match_the_stock_trainer(runs: dict[str, Any], case: int) -> None:
    ref = runs["reference"]["parity"][case]
    for rank_result in runs["ours"]:
        ours = rank_result["parity"][case]
        assert len(ours["losses"]) == len(ref["losses"]) == 4
        torch.testing.assert_close(ours["losses"], ref["losses"])
        torch.testing.assert_close(ours["eval_loss"], ref["eval_loss"])
        # predict(): every sample's logits, gathered from both ranks in the dataset's order
        assert ours["predictions"].shape == ref["predictions"].shape == (16, 16, 128)
        torch.testing.assert_close(ours["predictions"], ref["predictions"])
        assert all(n is not None and n > 0.1 for n in ours["grad_norms"])  # clipping was active
        assert ours["params"].keys() == ref["params"].keys()
        for name, value in ref["params"].items():
            torch.testing.assert_close(ours["params"][name], value, msg=name)


def test_activation_checkpointing_argument_is_fsdpx_checkpointing(runs: dict[str, Any]) -> None:
    ref = runs["reference"]["parity"][0]
    for rank_result in runs["ours"]:
        ours = rank_result["checkpointed"]
        assert ours["fsdpx_ac"] and not ours["hf_ac"]
        torch.testing.assert_close(ours["losses"], ref["losses"])
        for name, value in ref["params"].items():
            torch.testing.assert_close(ours["params"][name], value, msg=name)


def test_resume_from_checkpoint_gives_the_uninterrupted_losses_bitwise(
    runs: dict[str, Any],
) -> None:
    out = runs["tmp"] / "fsdpx" / "resume"
    # save_total_limit=2 rotated checkpoint-2 away; each kept one holds the trainer state,
    # the model's config and the fsdpx checkpoint (the weights once), and no pickle.
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    ckpt = out / "checkpoint-4"
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == 4
    assert (ckpt / "config.json").is_file() and (ckpt / "generation_config.json").is_file()
    assert (ckpt / "fsdpx" / "latest").is_file()
    assert not list(ckpt.glob("*.safetensors*")), "weights stored twice"
    assert not list(ckpt.rglob("*.bin")) and not list(ckpt.rglob("*.pt"))
    _consolidate_matches_the_saved_model(out / "checkpoint-6", out / "final", runs["tmp"] / "c6")
    full = runs["ours"][0]["uninterrupted"]["log"]
    shutil.rmtree(out / "checkpoint-6")  # as if the job died after step 4's save
    resumed = run_ranks(fsdpx_resume, 2, (str(runs["tmp"] / "fsdpx"),), env=_env(2))
    for r in resumed:
        steps = [h["step"] for h in r["log"]]
        assert steps == [1, 2, 3, 4, 5, 6]  # the log history comes back with the state
        assert [h["loss"] for h in r["log"][4:]] == [h["loss"] for h in full[4:]]
        assert [h["grad_norm"] for h in r["log"][4:]] == [h["grad_norm"] for h in full[4:]]
    _same_weights(out / "final-resumed", out / "final")


def test_load_best_model_at_end_loads_the_best_checkpoints_weights(runs: dict[str, Any]) -> None:
    for rank_result in runs["ours"]:
        best = rank_result["best"]
        assert best["best"] == "checkpoint-2"
        assert sorted(best["saved"]) == [2, 4]
        for name, value in best["saved"][2].items():
            torch.testing.assert_close(best["params"][name], value, rtol=0, atol=0, msg=name)
        # step 4's weights differ, so the comparison above says something
        assert any(not torch.equal(best["saved"][4][n], v) for n, v in best["saved"][2].items())


def _same_weights(got: Path, want: Path) -> None:
    from safetensors.torch import load_file

    saved, expected = load_file(got / "model.safetensors"), load_file(want / "model.safetensors")
    assert saved.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0, msg=name)


def _consolidate_matches_the_saved_model(ckpt: Path, final: Path, out: Path) -> None:
    """`fsdpx-ckpt consolidate --hf-config` turns the fsdpx state of the last checkpoint-N
    into a directory plain transformers loads, with the weights save_model() wrote at the
    end of the same run."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from checkpoint_tools.cli import main

    assert main(["consolidate", str(ckpt / "fsdpx"), str(out), "--hf-config", str(ckpt)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    state = model.state_dict()  # consolidate writes a tied weight under both names
    for name, value in load_file(final / "model.safetensors").items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_on_two_ranks_matches_one_process(runs: dict[str, Any], dtype: str) -> None:
    """bf16=True / fp16=True with the JSON's section "auto": the blocks compute in that
    dtype over fp32 masters, as on one process; fp16 scales the loss (no step skipped)."""
    one = runs["reference"]["precision"][dtype]
    fp32 = runs["reference"]["parity"][0]
    want = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[dtype]
    for rank_result in runs["ours"]:
        ours = rank_result["precision"][dtype]
        assert ours["compute"] == one["compute"] == [want]
        assert ours["masters"] == one["masters"] == ["torch.float32"]
        assert ours["skipped"] == one["skipped"] == 0
        assert ours["loss_scale"] == one["loss_scale"] == (2.0**16 if dtype == "fp16" else 1.0)
        torch.testing.assert_close(ours["losses"], one["losses"], rtol=TOL[dtype], atol=0)
        for name, value in one["params"].items():
            torch.testing.assert_close(
                ours["params"][name], value, rtol=0, atol=TOL[dtype], msg=name
            )
        # the same training as fp32, to the dtype's precision
        torch.testing.assert_close(ours["losses"], fp32["losses"], rtol=TOL[dtype], atol=0)


def test_consolidate_hf_config_needs_a_model_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from checkpoint_tools.cli import main

    assert (
        main(["consolidate", str(tmp_path), str(tmp_path / "o"), "--hf-config", str(tmp_path)]) == 2
    )
    assert f"--hf-config {tmp_path}: no config.json there" in capsys.readouterr().err
    assert main(["consolidate", str(tmp_path), "m.pt", "--hf-config", str(tmp_path)]) == 2
    assert "OUT must be a directory" in capsys.readouterr().err
