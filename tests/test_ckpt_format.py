"""The checkpoint format: golden bytes, round trips for every dtype and shape split across
writers, arbitrary sub-rectangles, compression settings, and the user-facing errors."""

from __future__ import annotations

import importlib
import shutil
import struct
import zlib
from pathlib import Path

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_tools.format import (
    DTYPES,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointReader,
    CheckpointVersionError,
    RankWriter,
    model_name,
    optim_name,
    split_optim_name,
    write_manifest,
)
from checkpoint_tools.format.layout import CODEC_PLANES, CODEC_RAW, CODEC_SHUFFLE_ZSTD

GOLDEN = Path(__file__).parent / "data" / "ckpt_golden"


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bitwise view for exact comparison (works for fp8, bool, 0-d)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    return torch.randint(0, 120, shape, generator=g).to(dtype)


def split_rows(n: int, parts: int) -> list[tuple[int, int]]:
    """Uneven split of n rows into `parts` ranges (some may be empty)."""
    cuts = sorted({0, n, *(min(n, (i * n) // parts + i % 2) for i in range(1, parts))})
    ranges = list(zip(cuts[:-1], cuts[1:], strict=True))
    while len(ranges) < parts:
        ranges.append((n, n))
    return ranges


def write_split(
    d: Path, tensors: dict[str, torch.Tensor], world: int, dim: int = 0, **kw: object
) -> None:
    """Write each tensor split unevenly along `dim` (0-d tensors replicated) by `world` writers."""
    infos = []
    for rank in range(world):
        w = RankWriter(d, rank, **kw)  # type: ignore[arg-type]
        for name, t in tensors.items():
            if t.dim() == 0 or t.dim() <= dim:
                w.add(name, t, global_shape=t.shape, offsets=[0] * t.dim())
                continue
            lo, hi = split_rows(t.shape[dim], world)[rank]
            offs = [0] * t.dim()
            offs[dim] = lo
            w.add(name, t.narrow(dim, lo, hi - lo), global_shape=t.shape, offsets=offs)
        infos.append(w.close())
    write_manifest(d, world_size=world, rank_files=infos, state={"step": 7})


# --- golden bytes -------------------------------------------------------------------------


def write_golden(d: Path, compression: str) -> None:
    w = RankWriter(d, 0, compression=compression, file_id=bytes(range(16)))  # type: ignore[arg-type]
    w.add(
        "model/w",
        torch.arange(6, dtype=torch.float32).reshape(2, 3),
        global_shape=(2, 3),
        offsets=(0, 0),
    )
    w.add(
        "model/b", torch.tensor([1.5, -2.0], dtype=torch.bfloat16), global_shape=(2,), offsets=(0,)
    )
    w.add("model/z", torch.zeros(64, dtype=torch.float32), global_shape=(64,), offsets=(0,))
    info = w.close()
    # 1.0's MANIFEST (no tensor table): these files are what 1.0 and 1.1 readers read
    write_manifest(
        d,
        world_size=1,
        rank_files=[info],
        state={"step": 1, "rng": b"\x01\x02"},
        tensor_table=False,
    )


def test_golden_bytes_match_writer(tmp_path: Path) -> None:
    write_golden(tmp_path, "none")
    for name in ("MANIFEST", "rank-00000.data", "rank-00000.index"):
        assert (tmp_path / name).read_bytes() == (GOLDEN / "none" / name).read_bytes(), name


def test_golden_byte_layout_follows_spec() -> None:
    data = (GOLDEN / "none" / "rank-00000.data").read_bytes()
    # data header: magic, major 1, minor 0, flags 0, file id; then raw little-endian frames
    assert data[:32] == b"FSDPXDAT" + struct.pack("<HHI", 1, 0, 0) + bytes(range(16))
    assert data[32:56] == struct.pack("<6f", 0, 1, 2, 3, 4, 5)
    assert (
        data[56:60]
        == torch.tensor([1.5, -2.0], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    )
    index = (GOLDEN / "none" / "rank-00000.index").read_bytes()
    magic, major, minor, flags, n = struct.unpack_from("<8sHHIQ", index)
    assert (magic, major, minor, flags, len(index)) == (b"FSDPXIDX", 1, 0, 0, 24 + n + 4)
    assert struct.unpack_from("<I", index, 24 + n)[0] == zlib.crc32(index[: 24 + n])
    body = msgpack.unpackb(index[24 : 24 + n])
    w = body["pieces"][0]
    assert (w["name"], w["dtype"], w["global_shape"], w["offsets"], w["shape"]) == (
        "model/w",
        "F32",
        [2, 3],
        [0, 0],
        [2, 3],
    )
    assert w["chunks"] == [[32, 24, 24, zlib.crc32(data[32:56]), CODEC_RAW]]


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_golden_checkpoints_read(compression: str) -> None:
    r = CheckpointReader(GOLDEN / compression)
    assert r.names() == ["model/w", "model/b", "model/z"]
    want_codec = CODEC_SHUFFLE_ZSTD if compression == "zstd" else CODEC_RAW
    assert [c.codec for c in r.meta("model/z").pieces[0].chunks] == [want_codec]
    assert_bitwise(r.read("model/z"), torch.zeros(64))
    assert r.state == {"step": 1, "rng": b"\x01\x02"}
    assert_bitwise(r.read("model/w"), torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert_bitwise(r.read("model/b"), torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
    r.verify(deep=True)


# --- round trips --------------------------------------------------------------------------

SHAPES = [(), (0,), (0, 3), (1,), (7,), (5, 3), (11, 4, 3)]


@pytest.mark.parametrize("compression", ["zstd", "none"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_round_trip_every_dtype_and_shape(
    tmp_path: Path, dtype: torch.dtype, compression: str
) -> None:
    tensors = {f"model/t{i}": sample(dtype, s, seed=i) for i, s in enumerate(SHAPES)}
    # 10-byte chunks: most pieces span several frames, frames split at element bounds.
    write_split(tmp_path, tensors, world=3, compression=compression, chunk_bytes=10)
    r = CheckpointReader(tmp_path)
    assert r.world_size == 3 and r.state == {"step": 7}
    for name, t in tensors.items():
        assert r.meta(name).dtype == dtype and r.meta(name).shape == tuple(t.shape)
        assert_bitwise(r.read(name), t)
        flat = [b.clone() for b in r.iter_blocks(name, max_bytes=16)]
        got = torch.cat(flat) if flat else torch.empty(0, dtype=dtype)
        assert_bitwise(got, t.reshape(-1))
    r.verify(deep=True)


def test_column_split_and_replicas(tmp_path: Path) -> None:
    t = sample(torch.float32, (9, 10))
    write_split(tmp_path, {"model/c": t}, world=4, dim=1, chunk_bytes=12)
    r = CheckpointReader(tmp_path)
    assert_bitwise(r.read("model/c"), t)
    # replicated: every rank holds the whole tensor; readers take one copy
    d = tmp_path / "rep"
    infos = []
    for rank in range(2):
        w = RankWriter(d, rank)
        w.add("model/r", t, global_shape=t.shape, offsets=(0, 0))
        infos.append(w.close())
    write_manifest(d, world_size=2, rank_files=infos, state={})
    assert_bitwise(CheckpointReader(d).read("model/r"), t)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_sub_rectangles(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    d = tmp_path_factory.mktemp("rect")
    shape = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple))
    dim = data.draw(st.integers(0, len(shape) - 1))
    t = sample(torch.float16, shape, seed=len(shape))
    write_split(
        d, {"model/x": t}, world=3, dim=dim, chunk_bytes=data.draw(st.sampled_from([2, 6, 64]))
    )
    offs = [data.draw(st.integers(0, s - 1)) for s in shape]
    sub = [data.draw(st.integers(0, s - o)) for s, o in zip(shape, offs, strict=True)]
    got = CheckpointReader(d).read("model/x", offs, sub)
    want = t[tuple(slice(o, o + n) for o, n in zip(offs, sub, strict=True))]
    assert_bitwise(got, want)


def test_large_read_uses_slabs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import checkpoint_tools.format.assemble as reader_mod

    monkeypatch.setattr(reader_mod, "SLAB_BYTES", 64)  # force many slabs and split chunks
    t = sample(torch.float32, (40, 7))
    write_split(tmp_path, {"model/x": t}, world=3, dim=1, chunk_bytes=40)
    r = CheckpointReader(tmp_path)
    assert_bitwise(r.read("model/x"), t)
    assert_bitwise(r.read("model/x", (3, 2), (30, 4)), t[3:33, 2:6])


def test_zstd_compresses_and_incompressible_chunks_stay_raw(tmp_path: Path) -> None:
    smooth = torch.linspace(0, 1, 1 << 16).to(torch.bfloat16)
    noise = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    for comp in ("none", "zstd"):
        write_split(
            tmp_path / comp, {"model/s": smooth, "model/n": noise}, world=1, compression=comp
        )
    z, n = CheckpointReader(tmp_path / "zstd"), CheckpointReader(tmp_path / "none")
    zs = z.meta("model/s").pieces[0]
    assert {c.codec for c in zs.chunks} == {CODEC_PLANES}  # bf16: 2-byte elements
    assert zs.stored_bytes < 0.5 * smooth.numel() * 2
    assert {c.codec for c in z.meta("model/n").pieces[0].chunks} == {CODEC_RAW}
    assert {c.codec for c in n.meta("model/s").pieces[0].chunks} == {CODEC_RAW}
    assert_bitwise(z.read("model/s"), smooth)
    assert_bitwise(n.read("model/n"), noise)


def test_threads_write_identical_files(tmp_path: Path) -> None:
    t = torch.linspace(0, 1, 50_000).reshape(100, 500)
    noise = sample(torch.uint8, (9000,))
    for threads in (1, 3):
        w = RankWriter(
            tmp_path / str(threads), 0, chunk_bytes=4096, threads=threads, file_id=b"x" * 16
        )
        w.add("model/t", t, global_shape=t.shape, offsets=(0, 0))
        w.add("model/n", noise, global_shape=(9000,), offsets=(0,))
        w.close()
    for name in ("rank-00000.data", "rank-00000.index"):
        assert (tmp_path / "1" / name).read_bytes() == (tmp_path / "3" / name).read_bytes()
    with pytest.raises(ValueError, match="threads must be a positive int; got 0"):
        RankWriter(tmp_path / "bad", 0, threads=0)


def test_early_writeback_asks_for_finished_stretches_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    import checkpoint_tools.format.writer as writer_mod
    from checkpoint_tools.format.writeback import start_writeback

    calls: list[tuple[int, int, bool]] = []

    def spy(fd: int, offset: int, nbytes: int) -> bool:
        ok = start_writeback(fd, offset, nbytes)
        calls.append((offset, nbytes, ok))
        return ok

    monkeypatch.setattr(writer_mod, "WRITEBACK_BYTES", 1000)
    monkeypatch.setattr(writer_mod, "start_writeback", spy)
    t = torch.arange(6000, dtype=torch.float32)  # 6 chunks of 4000 bytes after the header
    w = RankWriter(tmp_path, 0, compression="none", chunk_bytes=4000, file_id=b"x" * 16)
    w.add("model/t", t, global_shape=t.shape, offsets=(0,))
    write_manifest(tmp_path, world_size=1, rank_files=[w.close()], state={})
    # One stretch per chunk written, each ending >= 1000 bytes before the bytes written
    # by then (32 + 4000 k), in order: the kernel is asked only for finished bytes.
    linux = sys.platform.startswith("linux")
    assert calls == [(1000 * k, 1000, linux) for k in range(6)]
    assert torch.equal(CheckpointReader(tmp_path).read("model/t"), t)
    assert start_writeback(0, 0, 0) is False  # nothing to write: not asked


def test_state_round_trip(tmp_path: Path) -> None:
    state = {
        "step": 3,
        "rng": {"cpu": b"\x00" * 100, "cuda": [b"a", b"b"]},
        "client": {"epoch": 2, 5: "int key"},
        "lr": 1e-3,
        "none": None,
    }
    w = RankWriter(tmp_path, 0)
    write_manifest(tmp_path, world_size=1, rank_files=[w.close()], state=state)
    assert CheckpointReader(tmp_path).state == state


def test_names() -> None:
    assert model_name("h.0.w") == "model/h.0.w"
    assert optim_name("h.0.w", "exp_avg") == "optim/h.0.w/exp_avg"
    assert split_optim_name("optim/h.0.w/exp_avg") == ("h.0.w", "exp_avg")
    with pytest.raises(ValueError, match="must not contain '/'"):
        optim_name("w", "a/b")


# --- user-facing errors -------------------------------------------------------------------


def test_writer_rejects_bad_input(tmp_path: Path) -> None:
    w = RankWriter(tmp_path, 0)
    t = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"invalid tensor name '\.\./x'.*'\.\.' components"):
        w.add("../x", t, global_shape=(2, 3), offsets=(0, 0))
    with pytest.raises(ValueError, match="invalid tensor name '/abs'"):
        w.add("/abs", t, global_shape=(2, 3), offsets=(0, 0))
    with pytest.raises(ValueError, match="does not fit inside global_shape"):
        w.add("model/x", t, global_shape=(2, 3), offsets=(1, 0))
    with pytest.raises(ValueError, match="same number of dims"):
        w.add("model/x", t, global_shape=(6,), offsets=(0,))
    with pytest.raises(ValueError, match="which the format cannot store"):
        w.add("model/c", torch.zeros(2, dtype=torch.complex64), global_shape=(2,), offsets=(0,))
    w.add("model/x", t, global_shape=(2, 3), offsets=(0, 0))
    with pytest.raises(ValueError, match="already added on rank 0"):
        w.add("model/x", t, global_shape=(2, 3), offsets=(0, 0))
    info = w.close()
    with pytest.raises(ValueError, match="is closed or aborted"):
        w.add("model/y", t, global_shape=(2, 3), offsets=(0, 0))
    with pytest.raises(ValueError, match="compression must be 'zstd' or 'none'"):
        RankWriter(tmp_path / "b", 0, compression="lz4")  # type: ignore[arg-type]
    with pytest.raises(FileExistsError):
        RankWriter(tmp_path, 0)  # two writers for one rank
    with pytest.raises(
        ValueError, match=r"one rank file entry for each rank 0\.\.1; got ranks \[0\]"
    ):
        write_manifest(tmp_path, world_size=2, rank_files=[info], state={})
    with pytest.raises(ValueError, match="msgpack-able values"):
        write_manifest(tmp_path, world_size=1, rank_files=[info], state={"t": torch.zeros(1)})


def test_writer_refuses_dtensors_and_stops_after_a_failed_add(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class FakeDTensor(torch.Tensor):  # duck-types DTensor's two distinguishing attributes
        placements = ()

        def to_local(self) -> torch.Tensor:
            return self

    w = RankWriter(tmp_path, 0)
    fake = torch.zeros(2).as_subclass(FakeDTensor)
    with pytest.raises(
        ValueError, match=r"is a DTensor; pass its local shard \(`t.to_local\(\)`\)"
    ):
        w.add("model/d", fake, global_shape=(2,), offsets=(0,))
    from checkpoint_tools.format import codec

    def broken(*a: object, **k: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(codec, "encode", broken)
    with pytest.raises(OSError, match="disk full"):
        w.add("model/x", torch.zeros(4), global_shape=(4,), offsets=(0,))
    with pytest.raises(ValueError, match="is closed or aborted; cannot add 'model/y'"):
        w.add("model/y", torch.zeros(4), global_shape=(4,), offsets=(0,))
    with pytest.raises(ValueError, match="already closed or aborted"):
        w.close()


def test_reader_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="checkpoint directory does not exist"):
        CheckpointReader(tmp_path / "nope")
    with pytest.raises(CheckpointNotFoundError, match="no MANIFEST: the checkpoint is incomplete"):
        CheckpointReader(tmp_path)
    write_split(tmp_path, {"model/x": torch.zeros(4, 2)}, world=2)
    r = CheckpointReader(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="no such tensor.*tensor 'model/y'"):
        r.read("model/y")
    with pytest.raises(
        ValueError, match=r"rectangle at offsets=\(3, 0\) with shape=\(2, 2\) does not fit"
    ):
        r.read("model/x", (3, 0), (2, 2))


def test_newer_major_version_is_refused(tmp_path: Path) -> None:
    shutil.copytree(GOLDEN / "none", tmp_path / "c")
    m = tmp_path / "c" / "MANIFEST"
    raw = bytearray(m.read_bytes())
    raw[8:10] = struct.pack("<H", 2)
    raw[-4:] = struct.pack("<I", zlib.crc32(raw[:-4]))
    m.write_bytes(bytes(raw))
    with pytest.raises(
        CheckpointVersionError,
        match=r"format 2\.0; this reader supports format 1\.x only. Upgrade fsdpx",
    ):
        CheckpointReader(tmp_path / "c")


def test_gap_in_pieces_is_reported(tmp_path: Path) -> None:
    w = RankWriter(tmp_path, 0)
    w.add("model/x", torch.zeros(2, 3), global_shape=(4, 3), offsets=(0, 0))
    write_manifest(tmp_path, world_size=1, rank_files=[w.close()], state={})
    with pytest.raises(CheckpointFormatError, match=r"leave element \(2, 0\) uncovered"):
        CheckpointReader(tmp_path)


if __name__ == "__main__":  # regenerate the golden files: python -m tests.test_ckpt_format
    for comp in ("none", "zstd"):
        shutil.rmtree(GOLDEN / comp, ignore_errors=True)
        write_golden(GOLDEN / comp, comp)


def test_each_format_class_has_one_import_path() -> None:
    """The format is `checkpoint_tools.format` only: the runtime's star re-export
    (`fsdpx.checkpoint.format`) is gone, and `fsdpx.checkpoint` offers no format class."""
    import checkpoint_tools.format as pure
    import fsdpx.checkpoint as runtime

    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("fsdpx.checkpoint.format")
    for name in pure.__all__:
        assert not hasattr(runtime, name), name
