"""Hostile safetensors files give a clear error naming file and tensor, before any tensor
byte is read; the run arithmetic of shard rectangles."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdpx.hf.local_slices import element_runs, split_runs
from fsdpx.hf.safetensors_read import SafetensorsError, SafetensorsFile


def _write(path: Path, header: dict, data: bytes, declared: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if declared is None else declared) + raw + data)
    return path


def _good_header() -> dict:
    return {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
    }


def test_a_good_file_reads_runs(tmp_path: Path) -> None:
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.arange(4, dtype=torch.bfloat16)
    data = a.numpy().tobytes() + b.view(torch.int16).numpy().tobytes()
    with SafetensorsFile(_write(tmp_path / "m.safetensors", _good_header(), data)) as f:
        out = torch.empty(2, 2)
        f.read_into("a", out, element_runs((2, 3), [[0, 1], [1, 2]]))
        assert out.tolist() == [[1.0, 2.0], [4.0, 5.0]]
        assert f.bytes_read == 8 + len(json.dumps(_good_header())) + 16


@pytest.mark.parametrize(
    ("case", "match"),
    [
        (
            "truncated",
            r"m\.safetensors: tensor 'b': ends at data byte 32, but the file holds only 28 data bytes: truncated",
        ),
        (
            "lying_size",
            r"m\.safetensors: tensor 'a': data_offsets \[0, 20\] span 20 bytes, but F32 \[2, 3\] needs 24",
        ),
        ("huge_header", r"m\.safetensors: header length 18446744073709551615 is above the"),
        ("header_past_end", r"m\.safetensors: header length 4096 runs past the end of the file"),
        ("overlap", r"m\.safetensors: tensors 'a' and 'b' overlap in the data section"),
        ("bad_dtype", r"m\.safetensors: tensor 'a': dtype 'F33' is not one of"),
        ("not_json", r"m\.safetensors: header is not valid JSON"),
    ],
)
def test_hostile_files_are_refused_naming_file_and_tensor(
    tmp_path: Path, case: str, match: str
) -> None:
    header, data, declared = _good_header(), bytes(32), None
    path = tmp_path / "m.safetensors"
    if case == "truncated":
        data = bytes(28)
    elif case == "lying_size":
        header["a"]["data_offsets"] = [0, 20]
    elif case == "huge_header":
        declared = 2**64 - 1
    elif case == "header_past_end":
        declared = 4096
    elif case == "overlap":
        header["b"]["data_offsets"] = [20, 28]
    elif case == "bad_dtype":
        header["a"]["dtype"] = "F33"
    if case == "not_json":
        path.write_bytes(struct.pack("<Q", 4) + b"{{{{" + data)
    else:
        _write(path, header, data, declared)
    with pytest.raises(SafetensorsError, match=match):
        SafetensorsFile(path)


def test_element_runs_merge_and_split() -> None:
    # Whole tensor: one run.
    assert element_runs((4, 3), [[0, 1, 2, 3], [0, 1, 2]]) == [(0, 12)]
    # Rows 2-3 (ZeRO shard of dim 0): one run.
    assert element_runs((4, 3), [[2, 3], [0, 1, 2]]) == [(6, 6)]
    # Column 1-2 of every row (a dim-1 shard): one run per row.
    assert element_runs((2, 3), [[0, 1], [1, 2]]) == [(1, 2), (4, 2)]
    # Strided rows 0 and 2: two runs.
    assert element_runs((4, 3), [[0, 2], [0, 1, 2]]) == [(0, 3), (6, 3)]
    assert element_runs((), []) == [(0, 1)]
    assert element_runs((0, 3), [[], [0, 1, 2]]) == []
    # Ranges (what local_index_lists returns for whole and Shard dims) give the same runs.
    assert element_runs((4, 3), [range(2, 4), range(3)]) == [(6, 6)]
    assert element_runs((2, 3), [range(2), range(1, 3)]) == [(1, 2), (4, 2)]
    assert element_runs((4, 3), [range(4), range(3)]) == [(0, 12)]
    assert element_runs((0, 3), [range(0), range(3)]) == []


def test_split_runs_cuts_runs_into_groups_of_at_most_the_limit() -> None:
    runs = [(0, 5), (10, 2), (20, 7)]
    groups = list(split_runs(runs, 4))
    assert groups == [[(0, 4)], [(4, 1), (10, 2), (20, 1)], [(21, 4)], [(25, 2)]]
    assert all(sum(c for _, c in g) <= 4 for g in groups)
    assert list(split_runs(runs, 100)) == [runs]
    assert list(split_runs([], 4)) == []


def test_import_without_transformers_says_how_to_install() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "try:\n import fsdpx.hf\nexcept ImportError as e:\n print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install fsdpx[hf]" in out.stdout


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from tests.hf_bodies import tiny_llama

    path = tmp_path_factory.mktemp("llama")
    tiny_llama().save_pretrained(path)
    return path


def _rewrite(src: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    """Copy a saved model with its safetensors tensors edited by `edit(dict) -> dict`."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(
        edit(load_file(src / "model.safetensors")), dst / "model.safetensors", {"format": "pt"}
    )
    return dst


def test_checkpoint_mismatches_are_errors_before_sharding(llama_dir: Path, tmp_path: Path) -> None:
    """No process group is started: every check runs before fsdpx.shard."""
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import fsdpx.hf

    def drop(sd: dict) -> dict:
        del sd["model.norm.weight"]
        return sd

    def as_int(sd: dict) -> dict:
        sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.int32)
        return sd

    def reshape(sd: dict) -> dict:
        sd["model.norm.weight"] = torch.ones(7)
        return sd

    with pytest.raises(
        ValueError, match=r"no tensor for 1 parameters of LlamaForCausalLM: model\.norm\.weight"
    ):
        fsdpx.hf.from_pretrained(LlamaForCausalLM, _rewrite(llama_dir, tmp_path / "a", drop))
    with pytest.raises(
        SafetensorsError,
        match=r"model\.safetensors: tensor 'model\.norm\.weight' is torch\.int32, but LlamaForCausalLM\.model\.norm\.weight is torch\.float32",
    ):
        fsdpx.hf.from_pretrained(LlamaForCausalLM, _rewrite(llama_dir, tmp_path / "b", as_int))
    with pytest.raises(
        ValueError,
        match=r"tensor 'model\.norm\.weight' has shape \[7\], but LlamaForCausalLM\.model\.norm\.weight has shape \[32\]",
    ):
        fsdpx.hf.from_pretrained(LlamaForCausalLM, _rewrite(llama_dir, tmp_path / "c", reshape))
    with pytest.raises(FileNotFoundError, match=r"reads safetensors only"):
        fsdpx.hf.from_pretrained(LlamaForCausalLM, tmp_path, config=object())
    assert not dist.is_initialized()


def test_only_fsdpx_hf_imports_transformers_or_accelerate() -> None:
    """Every import statement (any depth, functions included) outside fsdpx/hf/."""
    import ast

    root = Path(__file__).resolve().parent.parent
    offenders = []
    for package in ("fsdpx", "checkpoint_tools", "monitor"):
        for path in (root / package).rglob("*.py"):
            if (root / "fsdpx" / "hf") in path.parents:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                if any(n.split(".")[0] in ("transformers", "accelerate") for n in names):
                    offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert offenders == []
