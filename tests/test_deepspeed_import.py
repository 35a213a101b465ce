"""`fsdpx-ckpt import-deepspeed` on real DeepSpeed checkpoints (tests/data/deepspeed_ckpt/,
made by scripts/make_deepspeed_fixtures.py with DeepSpeed 0.19.8; DeepSpeed is not
imported here): weights equal DeepSpeed's own zero_to_fp32 output bitwise, and fsdpx
resuming from the import continues DeepSpeed's recorded run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_tools import load_state_dict
from checkpoint_tools.cli import main
from checkpoint_tools.deepspeed import import_deepspeed
from checkpoint_tools.format import CheckpointReader
from tests.dist import run_ranks

DATA = Path(__file__).parent / "data" / "deepspeed_ckpt"
CASES = [
    "zero0_fp32",
    "zero0_fp16",
    "zero0_fp16_fused",
    "zero1_fp32",
    "zero2_fp16",
    "zero3_bf16",
    "zero3_universal",
    "zero1_universal",
]
# The universal checkpoints are ds_to_universal of these cases': the same runs.
RECORD_OF = {"zero3_universal": "zero3_bf16", "zero1_universal": "zero1_fp32"}
# Adam's step as DeepSpeed saved it: 4 steps, except stage 0 fp16, whose
# FP16_UnfusedOptimizer / FP16_Optimizer takes a zero-gradient step at construction
# ([Note: stage 0 layout]).
STEP = {"zero0_fp16": 5.0, "zero0_fp16_fused": 5.0}


def _reference(case: str) -> Path:
    """DeepSpeed's fp32 weights: zero_to_fp32's output; for stage 0 (which zero_to_fp32
    does not read), the fp32 masters DeepSpeed's optimizer held."""
    d = DATA / RECORD_OF.get(case, case)
    ref = d / "zero_to_fp32.safetensors"
    return ref if ref.is_file() else d / "fp32_masters.safetensors"


def _imported(tmp_path: Path, case: str) -> Path:
    out = tmp_path / f"{case}-fsdpx"
    import_deepspeed(DATA / case, out)
    return out


@pytest.mark.parametrize("case", CASES)
def test_weights_equal_zero_to_fp32_bitwise(tmp_path: Path, case: str) -> None:
    out = _imported(tmp_path, case)
    ref = load_file(str(_reference(case)))
    got = load_state_dict(out)
    assert sorted(got) == sorted(ref)
    for name, t in ref.items():
        assert got[name].dtype == t.dtype == torch.float32, name
        assert torch.equal(got[name], t), name


@pytest.mark.parametrize("case", CASES)
def test_training_state_is_carried_over(tmp_path: Path, case: str) -> None:
    record = json.loads((DATA / RECORD_OF.get(case, case) / "record.json").read_text())
    out = _imported(tmp_path, case)
    tag = "global_step4_universal" if case.endswith("universal") else "global_step4"
    assert (out / "latest").read_text().strip() == tag
    with CheckpointReader(out / tag) as reader:
        state = reader.state
        gas = record["config"]["gradient_accumulation_steps"]
        assert state["engine"]["global_steps"] == record["global_steps"] - record["continue"]
        assert state["engine"]["micro_steps"] == state["engine"]["global_steps"] * gas
        assert state["client_state"]["epoch"] == 1
        assert "dropped" not in state["client_state"]  # a tensor: listed, not kept
        assert state["deepspeed"]["dropped_client_state"] == ["dropped"]
        # DeepSpeed's last_batch_iteration 3 after 4 steps = torch's last_epoch 4.
        assert state["lr_scheduler"]["last_epoch"] == 4
        groups = state["optimizer"]["param_groups"]
        assert len(groups) == (2 if record["grouped"] else 1)
        names = [n for g in groups for n in g["params"]]
        assert sorted(names) == sorted(
            ["fc1.weight", "fc1.bias", "norm.weight", "norm.bias", "fc2.weight", "fc2.bias"]
        )
        for name in names:
            assert reader.read(f"optim/{name}/step").item() == STEP.get(case, 4.0)
            exp_avg = reader.read(f"optim/{name}/exp_avg")
            assert exp_avg.shape == reader.meta(f"model/{name}").shape
            assert exp_avg.abs().sum() > 0
        fp16 = record["config"].get("fp16")
        if fp16 and fp16.get("loss_scale"):
            assert state["loss_scaler"] == {"cur_scale": float(fp16["loss_scale"])}
        elif fp16:
            scaler = state["loss_scaler"]
            assert set(scaler) == {"cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"}
            assert scaler["cur_iter"] == 4
        else:
            assert state["loss_scaler"] is None


def test_universal_from_zero1_keeps_the_same_adam_state(tmp_path: Path) -> None:
    zero = _imported(tmp_path, "zero1_fp32") / "global_step4"
    uni = _imported(tmp_path, "zero1_universal") / "global_step4_universal"
    with CheckpointReader(zero) as a, CheckpointReader(uni) as b:
        assert a.state["optimizer"] == b.state["optimizer"]
        for name in a.state["optimizer"]["tensor_keys"]:
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(a.read(f"optim/{name}/{key}"), b.read(f"optim/{name}/{key}"))


def _resume(tmp_path: Path, world_size: int, runs: list[tuple[str, int | None]]) -> dict:
    from tests.ds_import_bodies import resume_body

    args = [
        (
            f"{case}/{stage}",
            str(DATA / RECORD_OF.get(case, case)),
            str(_imported(tmp_path, case)),
            stage,
        )
        for case, stage in runs
    ]
    return run_ranks(resume_body, world_size=world_size, args=(args,))[0]


def _check_continues(case: str, got: dict, tol: dict[str, float]) -> None:
    source = RECORD_OF.get(case, case)
    record = json.loads((DATA / source / "record.json").read_text())
    assert got["steps_before"] == record["steps"]
    assert got["global_steps"] == record["global_steps"]
    losses, ref = torch.tensor(got["losses"]), torch.tensor(record["losses_after"])
    # The first step after the resume runs on the imported weights alone.
    torch.testing.assert_close(losses[0], ref[0], rtol=tol["first"], atol=tol["first"])
    torch.testing.assert_close(losses, ref, rtol=tol["loss"], atol=tol["loss"])
    final = load_file(str(DATA / source / "continued.safetensors"))
    assert set(got["weights"]) == set(final) - {"out_scale"}
    for name, w in got["weights"].items():
        torch.testing.assert_close(w, final[name], rtol=tol["weight"], atol=tol["weight"], msg=name)


# fp32: DeepSpeed's run continued to fp32 rounding (torch's fp32 defaults; measured:
# equal). fp16/bf16 compute in 16 bits with other kernels and reduction orders than
# DeepSpeed's: a *fresh* fsdpx run of the same fp16 config already differs from
# DeepSpeed's by 1e-4 at step 1 and ~1% by step 7, so those cases get 16-bit bounds.
FP32 = {"first": 1e-5, "loss": 1e-5, "weight": 1e-5}
HALF = {"first": 2e-3, "loss": 5e-2, "weight": 2e-2}
# Stage 0 fp16 continues DeepSpeed's run closely (measured: losses 4e-4, weights 1.5e-5)
# once its moments are back in gradient units; as saved they were off by 2e-2
# ([Note: stage 0 fp16 moment units]), which this bound catches.
ZERO0_HALF = {"first": 2e-3, "loss": 2e-3, "weight": 2e-4}
TOL = {
    "zero0_fp32": FP32,
    "zero0_fp16": ZERO0_HALF,
    "zero0_fp16_fused": ZERO0_HALF,
    "zero1_fp32": FP32,
    "zero2_fp16": HALF,
    "zero3_bf16": HALF,
    "zero3_universal": HALF,
    "zero1_universal": FP32,
}


def test_resume_continues_the_deepspeed_run_at_the_same_world_size(tmp_path: Path) -> None:
    # Default tier: ZeRO-0 and ZeRO-1 fp32, ZeRO-0 fp16 and a universal checkpoint; the
    # slow twin runs every case.
    runs = ["zero0_fp32", "zero0_fp16", "zero1_fp32", "zero3_universal"]
    got = _resume(tmp_path, 2, [(case, None) for case in runs])
    for case in runs:
        _check_continues(case, got[f"{case}/None"], TOL[case])


@pytest.mark.slow
def test_resume_continues_every_deepspeed_run_at_the_same_world_size(tmp_path: Path) -> None:
    got = _resume(tmp_path, 2, [(case, None) for case in CASES])
    for case in CASES:
        _check_continues(case, got[f"{case}/None"], TOL[case])


def test_resume_at_another_world_size_and_stage(tmp_path: Path) -> None:
    # ZeRO-3 at 2 ranks -> ZeRO-1 at 1 rank, ZeRO-0 at 2 ranks -> ZeRO-3 at 1 rank: same
    # data (the micro-batch is global).
    # Stage 0 fp16 with FusedAdam (saved on one GPU) continues on one CPU rank.
    got = _resume(tmp_path, 1, [("zero3_bf16", 1), ("zero0_fp32", 3), ("zero0_fp16_fused", None)])
    _check_continues("zero3_bf16", got["zero3_bf16/1"], HALF)
    _check_continues("zero0_fp32", got["zero0_fp32/3"], FP32)
    _check_continues("zero0_fp16_fused", got["zero0_fp16_fused/None"], TOL["zero0_fp16_fused"])


@pytest.mark.slow
def test_resume_at_other_world_sizes_and_stages(tmp_path: Path) -> None:
    got = _resume(
        tmp_path,
        1,
        [("zero1_fp32", 3), ("zero2_fp16", 0), ("zero0_fp16", 2), ("zero1_universal", 2)],
    )
    _check_continues("zero1_fp32", got["zero1_fp32/3"], FP32)
    _check_continues("zero2_fp16", got["zero2_fp16/0"], HALF)
    _check_continues("zero0_fp16", got["zero0_fp16/2"], HALF)
    _check_continues("zero1_universal", got["zero1_universal/2"], FP32)


def test_cli_imports_and_renames(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert (
        main(
            [
                "import-deepspeed",
                str(DATA / "zero1_fp32"),
                str(out),
                "--tag",
                "global_step4",
                "--rename",
                r"^fc1\.=first.",
                "--rename",
                r"^fc2\.=second.",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "ZeRO-1, 2 rank(s), fp32, 6 parameters, step 4" in text
    assert "client_state keys ['dropped']" in text
    names = set(load_state_dict(out))
    assert {"first.weight", "second.bias", "norm.weight", "out_scale"} <= names
    assert main(["import-deepspeed", str(DATA / "zero1_fp32"), str(out), "--rename", "x"]) == 2
    assert "REGEX=REPL" in capsys.readouterr().err
    # The same tag again: refused, nothing overwritten.
    assert main(["import-deepspeed", str(DATA / "zero1_fp32"), str(out)]) == 1
    assert "already exists" in capsys.readouterr().err


def test_engine_loads_the_import_and_refuses_the_deepspeed_folder(tmp_path: Path) -> None:
    import fsdpx
    import fsdpx.deepspeed as deepspeed
    from checkpoint_tools.format import DeepSpeedCheckpointError
    from tests.ds_import_model import make_model

    engine = fsdpx.shard(make_model(), fsdpx.Config.from_dict({"zero": {"stage": 0}}))
    with pytest.raises(DeepSpeedCheckpointError, match="fsdpx-ckpt import-deepspeed DS_DIR"):
        engine.load_checkpoint(DATA / "zero1_fp32")
    # The DeepSpeed adapter too: never "no checkpoint, start fresh" (clarification 9).
    config = json.loads((DATA / "zero1_fp32" / "record.json").read_text())["config"]
    config["train_micro_batch_size_per_gpu"] = 4
    ds_engine, _, _, _ = deepspeed.initialize(model=make_model(), config=config)
    with pytest.raises(DeepSpeedCheckpointError, match="fsdpx-ckpt import-deepspeed DS_DIR"):
        ds_engine.load_checkpoint(str(DATA / "zero1_fp32"))
    ds_engine.destroy()
    out = _imported(tmp_path, "zero1_fp32")
    # DeepSpeed's run had two param groups; an optimizer built with one is told so.
    with pytest.raises(ValueError, match=r"param groups \(\[6\] parameters\) do not match"):
        engine.load_checkpoint(out)
    path, client = engine.load_checkpoint(out, load_optimizer_states=False)
    assert path.name == "global_step4" and client["epoch"] == 1
    assert engine.global_steps == 4


def test_inspect_describes_a_deepspeed_checkpoint(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(DATA / "zero2_fp16")]) == 0
    text = capsys.readouterr().out
    assert "ZeRO-2, 2 rank(s), fp16, DeepSpeed 0.19.8, step 4, scheduler WarmupDecayLR" in text
    assert "fp16 loss scaler" in text and "client_state['epoch']" in text
    assert "client_state['dropped'] (not msgpack-able)" in text
    assert main(["inspect", "--json", str(DATA / "zero3_universal")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "universal" and info["dtype"] == "bf16"
    assert [p["name"] for p in info["parameters"]][:2] == ["fc1.weight", "fc2.weight"]
