"""Hostile and damaged DeepSpeed checkpoints: `fsdpx-ckpt import-deepspeed` refuses them
with a DeepSpeedImportError (a CheckpointError) naming file and key, runs nothing from a
pickle, and leaves no output behind."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from checkpoint_tools.deepspeed import import_deepspeed
from checkpoint_tools.deepspeed.rectangles import flat_rectangles, max_pieces
from checkpoint_tools.deepspeed.unpickle import load
from checkpoint_tools.format import CheckpointError, DeepSpeedImportError

DATA = Path(__file__).parent / "data" / "deepspeed_ckpt"


class _Touch:
    """Pickles as a call of os.system that would create `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _copy(tmp_path: Path, case: str = "zero1_fp32") -> Path:
    return Path(shutil.copytree(DATA / case, tmp_path / case))


def _refused(ds: Path, out: Path, match: str) -> DeepSpeedImportError:
    with pytest.raises(DeepSpeedImportError, match=match) as info:
        import_deepspeed(ds, out)
    assert isinstance(info.value, CheckpointError)
    assert not out.exists() or not any(out.iterdir()), "a refused import left output"
    return info.value


def test_a_global_outside_the_allow_list_is_refused_and_never_run(tmp_path: Path) -> None:
    ds = _copy(tmp_path)
    marker = tmp_path / "pwned"
    states = ds / "global_step4" / "mp_rank_00_model_states.pt"
    good = load(states)
    torch.save({**good, "epoch": _Touch(marker)}, states)
    err = _refused(ds, tmp_path / "out", r"the pickle calls the global '(posix|os)\.system'")
    assert err.path == str(states)
    assert not marker.exists()


def test_a_deepspeed_class_name_cannot_smuggle_in_another_global(tmp_path: Path) -> None:
    # A global named like an allowed class's module but another attribute is refused.
    ds = _copy(tmp_path)
    optim = ds / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"zero_stage": shutil.rmtree}}, optim)
    _refused(ds, tmp_path / "out", r"the global 'shutil\.rmtree'")
    assert (ds / "global_step4").is_dir()


def test_truncated_file(tmp_path: Path) -> None:
    ds = _copy(tmp_path)
    optim = ds / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = optim.read_bytes()
    optim.write_bytes(data[: len(data) // 2])
    err = _refused(ds, tmp_path / "out", r"cannot read this DeepSpeed file.*truncated")
    assert err.path == str(optim)


def test_missing_rank_file(tmp_path: Path) -> None:
    ds = _copy(tmp_path, "zero3_bf16")
    (ds / "global_step4" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    _refused(ds, tmp_path / "out", r"one optimizer file per rank 0\.\.1; ranks \[0\] are missing")


def test_mismatched_world_sizes(tmp_path: Path) -> None:
    ds = _copy(tmp_path)
    tag = ds / "global_step4"
    shutil.copy(
        tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt",
    )
    err = _refused(ds, tmp_path / "out", r"written by one of 2 ranks, but the folder holds 3")
    assert err.tensor == "partition_count"


@pytest.mark.parametrize("case", ["zero1_fp32", "zero3_bf16"])
def test_shapes_that_do_not_add_up(tmp_path: Path, case: str) -> None:
    ds = _copy(tmp_path, case)
    name = "mp_rank_00" if case == "zero1_fp32" else "zero_pp_rank_0_mp_rank_00"
    states = ds / "global_step4" / f"{name}_model_states.pt"
    raw = load(states)
    raw["param_shapes"][0]["fc2.weight"] = torch.Size([5, 13])  # 65 elements, not 39
    torch.save(raw, states)
    err = _refused(ds, tmp_path / "out", "the shapes do not add up")
    assert err.path is not None and "optim_states" in err.path


def test_universal_parameter_of_the_wrong_size(tmp_path: Path) -> None:
    ds = _copy(tmp_path, "zero3_universal")
    exp_avg = ds / "global_step4_universal" / "zero" / "norm.bias" / "exp_avg.pt"
    torch.save(torch.zeros(12), exp_avg)
    err = _refused(ds, tmp_path / "out", r"expected a floating-point tensor of 13 elements")
    assert err.path == str(exp_avg) and err.tensor == "norm.bias"


def test_not_a_deepspeed_folder_and_bad_tags(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    _refused(tmp_path / "empty", tmp_path / "out", "expected DeepSpeed ZeRO optimizer files")
    ds = _copy(tmp_path)
    (ds / "latest").write_text("../../etc")
    _refused(ds, tmp_path / "out", "expected one checkpoint tag in this file")
    with pytest.raises(DeepSpeedImportError, match="--tag 'a/b' is not a tag"):
        import_deepspeed(ds, tmp_path / "out", tag="a/b")


def test_flat_runs_become_rectangles_covering_each_element_once() -> None:
    for shape in [(3, 4, 5), (7,), (2, 1, 3), (13, 7), ()]:
        n = int(torch.tensor(shape).prod()) if shape else 1
        for a in range(n + 1):
            for b in range(a, n + 1):
                hits = torch.zeros(shape, dtype=torch.int32)
                rects = flat_rectangles(a, b, shape)
                assert len(rects) <= max_pieces(len(shape))
                for offs, size in rects:
                    hits[tuple(slice(o, o + s) for o, s in zip(offs, size, strict=True))] += 1
                expected = torch.zeros(n, dtype=torch.int32)
                expected[a:b] = 1
                assert torch.equal(hits.reshape(-1), expected), (shape, a, b)


def test_names_module_prefix_renames_and_collisions() -> None:
    from checkpoint_tools.deepspeed.model_states import Naming

    naming = Naming(["module.fc.weight", "module.fc.bias"], [])
    assert naming.fqn("module.fc.weight") == "fc.weight"
    assert naming.notes == ["removed the 'module.' prefix that every name carried"]
    mixed = Naming(["module.fc.weight", "head.bias"], [])
    assert mixed.fqn("module.fc.weight") == "module.fc.weight" and not mixed.notes
    with pytest.raises(DeepSpeedImportError, match="would both be named 'x'"):
        Naming(["a.w", "b.w"], [(r"^.*$", "x")])
    with pytest.raises(DeepSpeedImportError, match="not a valid name"):
        Naming(["a.w"], [(r"\.", "/../")])


def test_shared_parameters_are_written_under_every_name(tmp_path: Path) -> None:
    from checkpoint_tools import load_state_dict

    ds = _copy(tmp_path)
    states = ds / "global_step4" / "mp_rank_00_model_states.pt"
    raw = load(states)
    raw["shared_params"] = {"tied.weight": "fc2.weight"}
    torch.save(raw, states)
    import_deepspeed(ds, tmp_path / "out")
    sd = load_state_dict(tmp_path / "out")
    assert torch.equal(sd["tied.weight"], sd["fc2.weight"])
