"""fsdpx.export.save_full_model: safetensors files that the safetensors library loads,
bitwise equal to the gathered parameters, sharded with a correct index, and loadable into
the plain unsharded model."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fsdpx
from fsdpx.demo.gpt import GPT, GPTConfig
from fsdpx.export import INDEX_FILE, SINGLE_FILE, save_full_model
from tests.dist import run_ranks

safetensors_torch = pytest.importorskip("safetensors.torch")

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _trained_engine(stage: int) -> fsdpx.Engine:
    torch.manual_seed(0)
    engine = fsdpx.shard(GPT(TINY), fsdpx.Config.from_dict({"zero": {"stage": stage}}))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, TINY.vocab_size, (2, TINY.block_size), generator=g)
    engine.backward(engine(x, x.roll(1, dims=1)))
    engine.step()  # parameters now differ from their initial values
    engine(x)  # stage 1 leaves parameters unsharded after forward; export must cope
    return engine


def _export_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in (3, 1):
        engine = _trained_engine(stage)
        base = Path(root) / f"stage{stage}"
        files = {
            "fp32": save_full_model(engine.module, base / "fp32"),
            "bf16": save_full_model(engine.module, base / "bf16", dtype="bf16"),
            "sharded": save_full_model(engine.module, base / "sharded", max_shard_bytes=40_000),
        }
        full = {n: t.full_tensor().clone() for n, t in engine.module.state_dict().items()}
        out[stage] = (files, full)
    # A write failure on rank 0 (out_dir is a file) must stop every rank, not hang them.
    blocker = Path(root) / "not_a_dir"
    if rank == 0:
        blocker.write_text("x")
    torch.distributed.barrier()
    try:
        save_full_model(engine.module, blocker)
        out["error"] = None
    except Exception as exc:
        out["error"] = type(exc).__name__
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("export")
    return root, run_ranks(_export_body, 2, (str(root),))


@pytest.mark.parametrize("stage", [3, 1])
def test_fp32_export_is_bitwise_equal_to_gathered_params(
    exported: tuple[Path, list[dict[str, Any]]], stage: int
) -> None:
    root, results = exported
    files, full = results[0][stage]
    (path,) = files["fp32"]
    assert path == root / f"stage{stage}" / "fp32" / SINGLE_FILE
    assert files == results[1][stage][0]  # every rank gets the same paths
    loaded = safetensors_torch.load_file(path)
    assert set(loaded) == set(full)
    for name, ref in full.items():
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], ref), name
    assert [p.name for p in path.parent.iterdir()] == [SINGLE_FILE]  # no *.tmp left


@pytest.mark.parametrize("stage", [3, 1])
def test_bf16_export_is_the_cast_of_the_params(
    exported: tuple[Path, list[dict[str, Any]]], stage: int
) -> None:
    root, results = exported
    _, full = results[0][stage]
    loaded = safetensors_torch.load_file(root / f"stage{stage}" / "bf16" / SINGLE_FILE)
    for name, ref in full.items():
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name], ref.to(torch.bfloat16)), name


def test_sharded_export_has_a_complete_index(exported: tuple[Path, list[dict[str, Any]]]) -> None:
    root, results = exported
    files, full = results[0][3]
    out = root / "stage3" / "sharded"
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    assert files["sharded"] == [*shards, out / INDEX_FILE]
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (out / SINGLE_FILE).exists()
    index = json.loads((out / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(full)
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in full.values())
    merged: dict[str, torch.Tensor] = {}
    for shard in shards:
        assert shard.stat().st_size <= 40_000 + 4096  # header slack; no tensor > 40 kB here
        part = safetensors_torch.load_file(shard)
        assert all(index["weight_map"][n] == shard.name for n in part)
        merged.update(part)
    for name, ref in full.items():
        assert torch.equal(merged[name], ref), name


def test_export_loads_into_a_plain_model_strictly(
    exported: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, results = exported
    _, full = results[0][3]
    for variant in ("fp32", "sharded"):
        out = root / "stage3" / variant
        state: dict[str, torch.Tensor] = {}
        for f in sorted(out.glob("*.safetensors")):
            state.update(safetensors_torch.load_file(f))
        model = GPT(TINY)
        model.load_state_dict(state, strict=True)
        x = torch.randint(0, TINY.vocab_size, (1, TINY.block_size))
        for name, p in model.named_parameters():
            assert torch.equal(p, full[name]), name
        assert torch.isfinite(model(x)).all()


def test_a_write_failure_on_rank_0_stops_every_rank(
    exported: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = exported
    assert results[0]["error"] == "FileExistsError"
    assert results[1]["error"] == "OSError"


# --- single process -------------------------------------------------------------------


class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0]))
        self.register_buffer("count", torch.tensor([7], dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


def test_golden_bytes_of_a_tiny_file(tmp_path: Path) -> None:
    (path,) = save_full_model(_WithBuffer(), tmp_path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = (
        b'{"__metadata__":{"format":"pt"},'
        b'"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        b'"count":{"dtype":"I64","shape":[1],"data_offsets":[8,16]}}'
    )
    header += b" " * (-len(header) % 8)
    assert n == len(header) and n % 8 == 0
    assert raw[8 : 8 + n] == header
    assert raw[8 + n :] == struct.pack("<2f", 1.0, 2.0) + struct.pack("<q", 7)


def test_cast_keeps_integer_buffers_and_skips_non_persistent(tmp_path: Path) -> None:
    (path,) = save_full_model(_WithBuffer(), tmp_path, dtype="fp16")
    loaded = safetensors_torch.load_file(path)
    assert set(loaded) == {"w", "count"}
    assert loaded["w"].dtype == torch.float16 and loaded["count"].dtype == torch.int64
    assert loaded["count"].item() == 7


def test_reexport_with_other_sharding_removes_stale_files(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    sharded = save_full_model(model, tmp_path, max_shard_bytes=40_000)
    assert len(sharded) > 2
    (single,) = save_full_model(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [SINGLE_FILE]
    model.load_state_dict(safetensors_torch.load_file(single), strict=True)


def test_empty_tensor_and_oversized_tensor(tmp_path: Path) -> None:
    m = nn.Module()
    m.register_buffer("empty", torch.zeros(0, 3))
    m.big = nn.Parameter(torch.arange(100, dtype=torch.float32))
    m.small = nn.Parameter(torch.ones(2))
    paths = save_full_model(m, tmp_path, max_shard_bytes=64)  # big alone exceeds the limit
    assert [p.name for p in paths][-1] == INDEX_FILE
    state: dict[str, torch.Tensor] = {}
    for p in paths[:-1]:
        state.update(safetensors_torch.load_file(p))
    assert state["empty"].shape == (0, 3)
    assert torch.equal(state["big"], torch.arange(100, dtype=torch.float32))


def test_bad_arguments_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"dtype must be None, 'fp32', 'bf16' or 'fp16'"):
        save_full_model(_WithBuffer(), tmp_path, dtype="float16")
    with pytest.raises(ValueError, match="max_shard_bytes must be positive"):
        save_full_model(_WithBuffer(), tmp_path, max_shard_bytes=0)
    m = nn.Module()
    m.register_buffer("c", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="safetensors cannot store"):
        save_full_model(m, tmp_path)
