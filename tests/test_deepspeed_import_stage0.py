"""ZeRO stage 0 DeepSpeed checkpoints (the optimizer inside mp_rank_00_model_states.pt):
the parameter order the importer recovers, the fp16 moment units, and the ways a stage 0
file can be wrong ([Note: stage 0 layout], [Note: stage 0 parameter order])."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint_tools import load_state_dict
from checkpoint_tools.cli import main
from checkpoint_tools.deepspeed import import_deepspeed
from checkpoint_tools.deepspeed.stage0 import match_order
from checkpoint_tools.deepspeed.unpickle import load
from checkpoint_tools.format import CheckpointError, CheckpointReader, DeepSpeedImportError

DATA = Path(__file__).parent / "data" / "deepspeed_ckpt"
STATES = Path("global_step4") / "mp_rank_00_model_states.pt"


def _copy(tmp_path: Path, case: str = "zero0_fp32") -> tuple[Path, dict[str, Any]]:
    # Loaded from the original: the copy is rewritten while the load's mapping is alive.
    ds = Path(shutil.copytree(DATA / case, tmp_path / case))
    return ds, load(DATA / case / STATES)


def _refused(ds: Path, out: Path, match: str) -> DeepSpeedImportError:
    with pytest.raises(DeepSpeedImportError, match=match) as info:
        import_deepspeed(ds, out)
    assert isinstance(info.value, CheckpointError)
    assert not out.exists() or not any(out.iterdir()), "a refused import left output"
    return info.value


def _regroup(raw: dict[str, Any], groups: list[list[str]]) -> None:
    """Rewrite the fp32 stage 0 optimizer as if built with these groups (module names),
    numbering the parameters 0, 1, ... in that order; moments keep their parameter."""
    opt = raw["optimizer"]
    by_name = dict(
        zip(
            ["fc1.weight", "fc2.weight", "fc1.bias", "norm.weight", "norm.bias", "fc2.bias"],
            range(6),
            strict=True,
        )
    )
    old_state, template = opt["state"], opt["param_groups"][0]
    state, pgroups, i = {}, [], 0
    for names in groups:
        ids = []
        for n in names:
            state[i] = old_state[by_name[n]]
            ids.append(i)
            i += 1
        pgroups.append({**template, "params": ids})
    opt["state"], opt["param_groups"] = state, pgroups


def test_the_optimizer_order_is_recovered_from_module_order_and_shapes() -> None:
    names = ["a", "b", "c", "d"]
    shapes = {"a": (2, 3), "b": (3,), "c": (3,), "d": (3, 2)}
    got = match_order(names, shapes, [[(2, 3), (3, 2)], [(3,), (3,)]], Path("f"))
    assert got == [["a", "d"], ["b", "c"]]
    # A slot without state (None) takes any shape, when that leaves one way.
    assert match_order(names, shapes, [[(2, 3), None], [(3,), (3,)]], Path("f")) == got
    with pytest.raises(DeepSpeedImportError, match="more than one way.*'b', 'c'"):
        match_order(names, shapes, [[(2, 3), (3,)], [(3,), (3, 2)]], Path("f"))
    with pytest.raises(DeepSpeedImportError, match="cannot be matched"):
        match_order(names, shapes, [[(3, 2), (2, 3)], [(3,), (3,)]], Path("f"))


def test_groups_built_in_another_order_are_refused(tmp_path: Path) -> None:
    ds, raw = _copy(tmp_path)
    _regroup(
        raw, [["fc2.weight", "fc1.weight"], ["fc1.bias", "norm.weight", "norm.bias", "fc2.bias"]]
    )
    torch.save(raw, ds / STATES)
    err = _refused(ds, tmp_path / "out", "cannot be matched to the module's parameters")
    assert err.path == str(ds / STATES) and err.tensor == "optimizer.param_groups"


def test_same_shaped_parameters_that_fit_two_groups_are_refused(tmp_path: Path) -> None:
    ds, raw = _copy(tmp_path)
    # fc1.bias (13,) could be group 0's second slot or group 1's first, and norm.weight
    # the other: two namings, and a guess could swap their moments.
    _regroup(
        raw, [["fc1.weight", "fc1.bias"], ["norm.weight", "norm.bias", "fc2.weight", "fc2.bias"]]
    )
    torch.save(raw, ds / STATES)
    _refused(ds, tmp_path / "out", "more than one way.*'fc1.bias', 'norm.bias', 'norm.weight'")


def test_parameters_outside_the_optimizer_are_refused(tmp_path: Path) -> None:
    ds, raw = _copy(tmp_path)
    _regroup(raw, [["fc1.weight", "fc2.weight"], ["fc1.bias", "norm.weight", "norm.bias"]])
    torch.save(raw, ds / STATES)
    _refused(ds, tmp_path / "out", "holds 5 parameters in 2 group.*has 6.*frozen parameters")


def _flatten(raw: dict[str, Any]) -> None:
    """Rewrite the unfused fp16 stage 0 optimizer as FP16_Optimizer (FusedAdam) saves it:
    one flat fp32 master per group, the inner optimizer's state over those flat tensors."""
    opt = raw["optimizer"]
    inner = opt["optimizer_state_dict"]
    opt["fp32_groups_flat"] = [
        torch.cat([t.reshape(-1) for t in g]) for g in opt.pop("fp32_groups")
    ]
    state: dict[int, dict[str, Any]] = {}
    for g, grp in enumerate(inner["param_groups"]):
        per = [inner["state"][i] for i in grp["params"]]
        state[g] = {
            "step": per[0]["step"],
            **{k: torch.cat([s[k].reshape(-1) for s in per]) for k in ("exp_avg", "exp_avg_sq")},
        }
        grp["params"] = [g]
    inner["state"] = state


def test_fused_fp16_flat_masters_import_as_the_unfused_layout(tmp_path: Path) -> None:
    """[Note: stage 0 flat groups]: the same run saved flat gives the same checkpoint."""
    ds, raw = _copy(tmp_path, "zero0_fp16")
    _flatten(raw)
    torch.save(raw, ds / STATES)
    flat = import_deepspeed(ds, tmp_path / "flat")
    unfused = import_deepspeed(DATA / "zero0_fp16", tmp_path / "unfused")
    with CheckpointReader(flat.output) as a, CheckpointReader(unfused.output) as b:
        assert a.names() == b.names()
        assert "optim/fc1.weight/exp_avg" in a.names()
        for name in b.names():
            assert torch.equal(a.read(name), b.read(name)), name


def test_flat_groups_that_do_not_add_up_or_fit_two_ways_are_refused(tmp_path: Path) -> None:
    ds, raw = _copy(tmp_path, "zero0_fp16")
    _flatten(raw)
    flats = raw["optimizer"]["fp32_groups_flat"]
    # Group 0 is fc1.weight (7x13) and fc2.weight (13x3); group 1 the others, 13, 13, 13, 3.
    flats[1] = flats[1][:-1]
    torch.save(raw, ds / STATES)
    err = _refused(ds, tmp_path / "out", "hold 171 elements.*parameters have 172")
    assert err.tensor == "optimizer.fp32_groups_flat"
    # By sizes alone 130 | 42 is also fc1.weight + fc1.bias + norm.* | fc2.*; the masters'
    # values (the fp16 parameters are their slices) leave one way. Masters whose values
    # match no parameter (a file whose 'module' is not the masters' copy) leave none.
    flats[1] = torch.cat([flats[1], torch.zeros(1)])
    flats[0] = flats[0] + 1
    torch.save(raw, ds / STATES)
    _refused(ds, tmp_path / "out", "cannot be matched to the module's parameters")
    from checkpoint_tools.deepspeed.stage0_flat import match_flat

    shapes = {"a": (4,), "b": (2, 2), "c": (3,)}
    assert match_flat(["a", "b", "c"], shapes, [8, 3], Path("f")) == [["a", "b"], ["c"]]
    with pytest.raises(DeepSpeedImportError, match="more than one way"):
        match_flat(["a", "b", "c"], shapes, [4, 7], Path("f"))  # a | b c, or b | a c
    # The values decide: only `b` fits group 0.
    assert match_flat(
        ["a", "b", "c"], shapes, [4, 7], Path("f"), lambda n, g, o: (n == "b") == (g == 0)
    ) == [["b"], ["a", "c"]]


def test_a_missing_optimizer_is_refused(tmp_path: Path) -> None:
    ds, raw = _copy(tmp_path, "zero0_fp16")
    raw["optimizer"] = None
    torch.save(raw, ds / STATES)
    _refused(ds, tmp_path / "out", "expected the optimizer's state dict under 'optimizer'")


def test_a_master_of_the_wrong_shape_is_refused(tmp_path: Path) -> None:
    ds, raw = _copy(tmp_path, "zero0_fp16")
    raw["optimizer"]["fp32_groups"][1][3] = torch.zeros(4)  # fc2.bias is (3,)
    torch.save(raw, ds / STATES)
    _refused(ds, tmp_path / "out", "cannot be matched")


def test_zero_files_lost_is_not_mistaken_for_stage_0(tmp_path: Path) -> None:
    ds = Path(shutil.copytree(DATA / "zero1_fp32", tmp_path / "z1"))
    for f in (ds / "global_step4").glob("*optim_states.pt"):
        f.unlink()
    _refused(ds, tmp_path / "out", "next to this ZeRO model states file.*incomplete copy")


def test_tied_parameters_are_written_under_every_name(tmp_path: Path) -> None:
    ds, raw = _copy(tmp_path)
    module = dict(raw["module"])
    module["tied.weight"] = module["fc2.weight"]  # one storage under two names, as torch saves
    raw["module"] = module
    torch.save(raw, ds / STATES)
    import_deepspeed(ds, tmp_path / "out")
    sd = load_state_dict(tmp_path / "out")
    assert torch.equal(sd["tied.weight"], sd["fc2.weight"])


def test_fp16_moments_come_back_in_gradient_units(tmp_path: Path) -> None:
    raw = load(DATA / "zero0_fp16" / STATES)
    saved = raw["optimizer"]["optimizer_state_dict"]["state"]
    report = import_deepspeed(DATA / "zero0_fp16", tmp_path / "out")
    assert any("deepspeedai/DeepSpeed#8393" in n and "256" in n for n in report.notes)
    with CheckpointReader(report.output) as r:
        # fc1.weight is the optimizer's parameter 0 (group 0 lists fc1.weight, fc2.weight).
        assert torch.equal(r.read("optim/fc1.weight/exp_avg"), saved[0]["exp_avg"] * 256)
        assert torch.equal(r.read("optim/fc1.weight/exp_avg_sq"), saved[0]["exp_avg_sq"] * 65536)
    # Another DeepSpeed version: imported as saved, and the report says so.
    ds, raw = _copy(tmp_path, "zero0_fp16")
    raw["ds_version"] = "0.14.0"
    torch.save(raw, ds / STATES)
    report = import_deepspeed(ds, tmp_path / "out2")
    assert any("imported as saved" in n for n in report.notes)
    with CheckpointReader(report.output) as r:
        assert torch.equal(r.read("optim/fc1.weight/exp_avg"), saved[0]["exp_avg"])


def test_inspect_describes_a_stage_0_checkpoint(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(DATA / "zero0_fp16")]) == 0
    text = capsys.readouterr().out
    assert "ZeRO-0, 2 rank(s), fp16, DeepSpeed 0.19.8, step 4, scheduler WarmupLR" in text
    assert "fp16 loss scaler" in text and "fc1.weight" in text


def test_stage_0_loss_scaler_fields_become_fsdpx_scaler_state() -> None:
    from checkpoint_tools.deepspeed.training_state import loss_scaler

    dynamic = {
        "dynamic_loss_scale": True,
        "cur_scale": 1024.0,
        "cur_iter": 7,
        "last_overflow_iter": 3,
        "scale_factor": 2.0,
        "scale_window": 2,
    }
    # cur_hysteresis is not saved: the config's (DeepSpeed's resume starts from it too).
    assert loss_scaler(dynamic, True, {"fp16": {"hysteresis": 3}}) == {
        "cur_scale": 1024.0,
        "cur_iter": 7,
        "last_overflow_iter": 3,
        "cur_hysteresis": 3,
    }
    default = loss_scaler(dynamic, True, {})
    assert default is not None and default["cur_hysteresis"] == 2  # DeepSpeed's default
    static = {"dynamic_loss_scale": False, "cur_scale": 256.0, "cur_iter": 4}
    assert loss_scaler(static, True, {}) == {"cur_scale": 256.0}
    assert loss_scaler(static, False, {}) is None  # bf16 / fp32: fsdpx keeps no scaler
