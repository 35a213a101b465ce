"""Format 1.2's tensor table ([Note: tensor table] in checkpoint_tools/format/routing.py):
golden bytes, a reader that opens only the indexes it needs (counted at a synthetic
256-rank layout), 1.0/1.1 MANIFESTs still read every index, and an index that disagrees
with the table is refused.
"""

from __future__ import annotations

import random
import struct
import zlib
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from checkpoint_tools.format import (
    CheckpointFormatError,
    CheckpointReader,
    RankWriter,
    coverage,
    write_manifest,
)
from checkpoint_tools.format.layout import DATA_HEADER, INDEX_MAGIC, MANIFEST_MAGIC, pack_container
from checkpoint_tools.format.routing import build_routing

GOLDEN = Path(__file__).parent / "data" / "ckpt_golden" / "table"
W = torch.arange(12, dtype=torch.float32).reshape(4, 3)
B = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)


def write_golden_table(d: Path) -> None:
    """2 ranks: model/w and optim/w/exp_avg split by rows (one shared layout), model/b
    replicated on both ranks."""
    infos = []
    for rank in range(2):
        w = RankWriter(d, rank, compression="none", file_id=bytes(range(16 * rank, 16 * rank + 16)))
        rows = slice(2 * rank, 2 * rank + 2)
        w.add("model/w", W[rows], global_shape=(4, 3), offsets=(2 * rank, 0))
        w.add("model/b", B, global_shape=(2,), offsets=(0,))
        w.add("optim/w/exp_avg", -W[rows], global_shape=(4, 3), offsets=(2 * rank, 0))
        infos.append(w.close())
    write_manifest(d, world_size=2, rank_files=infos, state={"step": 3})


def container_body(path: Path) -> tuple[int, Any]:
    raw = path.read_bytes()
    minor, n = struct.unpack_from("<H", raw, 10)[0], struct.unpack_from("<Q", raw, 16)[0]
    return minor, msgpack.unpackb(raw[24 : 24 + n])


def test_golden_table_bytes_match_writer(tmp_path: Path) -> None:
    write_golden_table(tmp_path)
    for f in sorted(GOLDEN.iterdir()):
        assert (tmp_path / f.name).read_bytes() == f.read_bytes(), f.name


def test_golden_table_layout_follows_spec() -> None:
    minor, body = container_body(GOLDEN / "MANIFEST")
    assert minor == 2 and body["writer"] == "fsdpx-checkpoint 1.2"
    assert body["tensors"] == [
        ["model/w", "F32", [4, 3], 0],
        ["model/b", "BF16", [2], 1],
        ["optim/w/exp_avg", "F32", [4, 3], 0],
    ]
    assert body["layouts"] == [
        [[0, [0, 0], [2, 3]], [1, [2, 0], [2, 3]]],
        [[0, [0], [2]], [1, [0], [2]]],
    ]
    assert all("pieces" not in entry for entry in body["ranks"])  # the table holds them
    for rank in range(2):  # rank files are 1.0 (no codec 2 chunk)
        assert container_body(GOLDEN / f"rank-{rank:05d}.index")[0] == 0


def test_golden_table_reads_one_index_per_rank_shard() -> None:
    with CheckpointReader(GOLDEN, prefer_rank=1) as r:
        assert r.index_reads == 0 and r.names() == ["model/w", "model/b", "optim/w/exp_avg"]
        assert r.info("model/w").shape == (4, 3) and r.index_reads == 0
        assert torch.equal(r.read("model/w", (2, 0), (2, 3)), W[2:])
        assert torch.equal(r.read("model/b"), B)  # the replica of prefer_rank
        assert torch.equal(r.read("optim/w/exp_avg", (3, 1), (1, 2)), -W[3:, 1:])
        assert r.index_reads == 1 and r.index_bytes == (GOLDEN / "rank-00001.index").stat().st_size
        assert torch.equal(r.read("model/w"), W) and r.index_reads == 2
        assert r.format_version == (1, 2)
        r.verify(deep=True)


# --- many ranks ---------------------------------------------------------------------------

RANKS, TENSORS, ROWS = 256, 12, 8


def synthetic(d: Path, *, table: bool, shapes: str = "shared") -> None:
    """RANKS index files (no data files: only opening and planning are exercised) of
    TENSORS row-split tensors; "distinct" gives every tensor its own row count, so no two
    tensors share a layout (the table's worst case)."""
    infos = []
    for r in range(RANKS):
        pieces, summary = [], []
        for t in range(TENSORS):
            rows = ROWS + (t if shapes == "distinct" else 0)
            gshape, offs, shape = [rows * RANKS, 16], [rows * r, 0], [rows, 16]
            pieces.append(
                {
                    "name": f"model/layer{t}.weight",
                    "dtype": "F32",
                    "global_shape": gshape,
                    "offsets": offs,
                    "shape": shape,
                    "chunks": [[DATA_HEADER.size, rows * 64, rows * 64, 0, 0]],
                }
            )
            summary.append([f"model/layer{t}.weight", "F32", gshape, offs, shape])
        body = {
            "rank": r,
            "file_id": bytes(16),
            "data_file": f"rank-{r:05d}.data",
            "data_size": 1 << 30,
            "compression": "none",
            "chunk_bytes": 4 << 20,
            "pieces": pieces,
        }
        blob = pack_container(INDEX_MAGIC, msgpack.packb(body, use_bin_type=True), 0)
        (d / f"rank-{r:05d}.index").write_bytes(blob)
        (d / f"rank-{r:05d}.data").touch()  # present (readers check), never read here
        infos.append(
            {
                "rank": r,
                "index_file": f"rank-{r:05d}.index",
                "index_size": len(blob),
                "index_crc32": zlib.crc32(blob),
                "data_file": f"rank-{r:05d}.data",
                "data_size": 1 << 30,
                "file_id": bytes(16),
                "pieces": summary,
            }
        )
    write_manifest(d, world_size=RANKS, rank_files=infos, state={}, tensor_table=table)


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for label, table, shapes in [
        ("table", True, "shared"),
        ("distinct", True, "distinct"),
        ("legacy", False, "shared"),
    ]:
        out[label] = tmp_path_factory.mktemp(label)
        synthetic(out[label], table=table, shapes=shapes)
    return out


def plan_shard(r: CheckpointReader, rank: int, world: int) -> list[int]:
    """What loading rank `rank` of `world` asks for (its rows of every tensor); the ranks
    whose pieces it would read."""
    ranks = set()
    for name in r.names():
        rows = r.info(name).shape[0] // world
        meta = r.pieces_for(name, (rows * rank, 0), (rows, 16))
        ranks |= {p.rank for p in meta.pieces}
    return sorted(ranks)


@pytest.mark.parametrize("label", ["table", "distinct"])
def test_each_rank_reads_only_the_indexes_it_needs(many: dict[str, Path], label: str) -> None:
    d = many[label]
    size = (d / "rank-00077.index").stat().st_size
    with CheckpointReader(d, prefer_rank=77) as r:
        assert r.index_reads == 0  # opening reads MANIFEST only
        assert plan_shard(r, 77, RANKS) == [77]  # same world size: its own index
        assert (r.index_reads, r.index_bytes) == (1, size)
    with CheckpointReader(d) as r:  # half the ranks: two saved ranks per loading rank
        assert plan_shard(r, 5, RANKS // 2) == [10, 11]
        assert r.index_reads == 2


def test_a_manifest_without_table_reads_every_index(many: dict[str, Path]) -> None:
    assert container_body(many["legacy"] / "MANIFEST")[0] == 0
    with CheckpointReader(many["legacy"]) as r:
        assert r.index_reads == RANKS  # at open, as 1.0 / 1.1 readers do
        assert plan_shard(r, 77, RANKS) == [77]
        assert r.index_reads == RANKS


def test_the_table_shares_layouts_between_tensors_of_one_shape(many: dict[str, Path]) -> None:
    assert len(container_body(many["table"] / "MANIFEST")[1]["layouts"]) == 1
    assert len(container_body(many["distinct"] / "MANIFEST")[1]["layouts"]) == TENSORS


# --- the table and the indexes must agree -------------------------------------------------


def forge_manifest(d: Path, edit: Any) -> None:
    _, body = container_body(d / "MANIFEST")
    edit(body)
    (d / "MANIFEST").write_bytes(
        pack_container(MANIFEST_MAGIC, msgpack.packb(body, use_bin_type=True), 2)
    )


@pytest.mark.parametrize(
    "edit,match",
    [
        (
            lambda b: b["tensors"].append(["model/extra", "F32", [4, 3], 0]),
            "holds 3 pieces, the MANIFEST's tensor table lists 4",
        ),
        (lambda b: b["tensors"].pop(), "index holds a tensor the MANIFEST's tensor table does"),
        (
            lambda b: b["tensors"][1].__setitem__(0, "model/c"),
            "index holds a tensor the MANIFEST's tensor table does not list",
        ),
        (lambda b: b["tensors"][1].__setitem__(1, "F16"), "table says dtype torch.float16"),
        (
            lambda b: b["layouts"][1].__setitem__(1, [1, [0], [1]]),
            "element \\(1,\\) uncovered|the MANIFEST's tensor table lists",
        ),
        (lambda b: b["layouts"][0].reverse(), "rank 0 out of order"),
        (lambda b: b["tensors"][0].__setitem__(3, 5), "layout 5 is not one of the 2 layouts"),
        (lambda b: b["tensors"].append(list(b["tensors"][0])), "listed twice"),
        (lambda b: b["layouts"][0][0].__setitem__(1, [0]), "same number of dims as the layout"),
    ],
)
def test_table_disagreeing_with_an_index_is_refused(tmp_path: Path, edit: Any, match: str) -> None:
    write_golden_table(tmp_path)
    forge_manifest(tmp_path, edit)
    with pytest.raises(CheckpointFormatError, match=match), CheckpointReader(tmp_path) as r:
        for name in r.names():
            r.read(name)


def test_ranks_disagreeing_on_a_tensor_cannot_write_a_table() -> None:
    with pytest.raises(ValueError, match="rank 1 stores dtype BF16 shape \\[4\\]"):
        build_routing([[["model/x", "F32", [4], [0], [2]]], [["model/x", "BF16", [4], [2], [2]]]])
    with pytest.raises(ValueError, match="have no 'pieces' list"):
        write_manifest(Path("unused"), world_size=1, rank_files=[{"rank": 0}], state={})


if __name__ == "__main__":  # regenerate the golden files: python -m tests.test_ckpt_table
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for f in GOLDEN.iterdir():
        f.unlink()
    write_golden_table(GOLDEN)


def test_one_dim_sweep_agrees_with_the_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """coverage.uncovered's fast path (row/column shards, replicas) answers as the grid."""
    rng = random.Random(0)
    cases = []
    for _ in range(600):
        nd = rng.randint(1, 3)
        shape = tuple(rng.randint(1, 5) for _ in range(nd))
        split = rng.randrange(nd)
        boxes = []
        for _ in range(rng.randint(0, 4)):
            off, shp = [0] * nd, list(shape)
            if rng.random() < 0.8:
                lo = rng.randint(0, shape[split])
                off[split], shp[split] = lo, rng.randint(lo, shape[split]) - lo
            if rng.random() < 0.1:  # sometimes a second split dim: the grid decides
                d = rng.randrange(nd)
                off[d] = rng.randint(0, shape[d])
                shp[d] = rng.randint(0, shape[d] - off[d])
            boxes.append((tuple(off), tuple(shp)))
        cases.append((shape, boxes, coverage.uncovered(shape, boxes)))
    monkeypatch.setattr(coverage, "_sweep_one_dim", lambda shape, boxes: (False, None))
    for shape, boxes, fast in cases:
        assert coverage.uncovered(shape, boxes) == fast, (shape, boxes)
