"""Format 1.1 byte-plane coding (codec 2): golden bytes, the frame layout as FORMAT.md
§3.2 states it, version choice, CRC combination, damage detection, and 1.0 checkpoints
still loading. Native-vs-numpy kernel equality is in tests/test_ops_shuffle.py."""

from __future__ import annotations

import random
import shutil
import struct
import zlib
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zstandard

from checkpoint_tools.format import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointReader,
    RankWriter,
    write_manifest,
)
from checkpoint_tools.format.kernels import NumpyKernels, crc32_combine
from checkpoint_tools.format.layout import CODEC_PLANES, CODEC_RAW, CODEC_SHUFFLE_ZSTD
from tests.test_ckpt_hostile import zstd_frame_declaring

GOLDEN = Path(__file__).parent / "data" / "ckpt_golden"


def weights(n: int, seed: int = 0) -> torch.Tensor:
    """Deterministic trained-like fp32 values (integer hashing, no RNG library): random
    sign and mantissa, exponent in 4 values, so only the top byte plane compresses."""
    i = np.arange(n, dtype=np.uint64) + np.uint64(seed * 1_000_003)
    h = (i * np.uint64(2654435761)) % np.uint64(1 << 32)
    h ^= h >> np.uint64(15)
    h = (h * np.uint64(2246822519)) % np.uint64(1 << 32)
    h ^= h >> np.uint64(13)
    sign = (h >> np.uint64(31)) << np.uint64(31)
    exp = (np.uint64(120) + (h >> np.uint64(24)) % np.uint64(4)) << np.uint64(23)
    bits = (sign | exp | (h & np.uint64(0x7FFFFF))).astype(np.uint32)
    return torch.from_numpy(bits.view(np.float32).copy())


def write_golden_planes(d: Path) -> None:
    w = RankWriter(d, 0, compression="zstd", file_id=bytes(range(16)))
    w.add("model/w", weights(2048).reshape(32, 64), global_shape=(32, 64), offsets=(0, 0))
    w.add("model/h", weights(2048, 1).bfloat16(), global_shape=(2048,), offsets=(0,))
    w.add("model/z", torch.zeros(64, dtype=torch.float32), global_shape=(64,), offsets=(0,))
    w.add("model/i", torch.arange(256, dtype=torch.uint8), global_shape=(256,), offsets=(0,))
    info = w.close()
    write_manifest(d, world_size=1, rank_files=[info], state={"step": 2}, tensor_table=False)


def index_body(d: Path) -> dict:
    raw = (d / "rank-00000.index").read_bytes()
    (n,) = struct.unpack_from("<Q", raw, 16)
    return msgpack.unpackb(raw[24 : 24 + n])


def test_golden_planes_bytes_match_writer(tmp_path: Path) -> None:
    # zstd frames are stable for one libzstd version; after an upgrade, regenerate with
    # `python -m tests.test_ckpt_planes` once the layout test below still passes.
    write_golden_planes(tmp_path)
    for name in ("MANIFEST", "rank-00000.data", "rank-00000.index"):
        assert (tmp_path / name).read_bytes() == (GOLDEN / "planes" / name).read_bytes(), name


# planes_zstd_defaults/: the same tensors and the same format, written before byte planes
# got their own zstd table ([Note: plane compressor]); kept so that files of that writer
# are checked against the spec and read, as every 1.1 file must be.
PLANES_GOLDEN = ["planes", "planes_zstd_defaults"]


@pytest.mark.parametrize("golden", PLANES_GOLDEN)
def test_golden_planes_layout_follows_spec(golden: str) -> None:
    data = (GOLDEN / golden / "rank-00000.data").read_bytes()
    assert data[:16] == b"FSDPXDAT" + struct.pack("<HHI", 1, 1, 0)
    index = (GOLDEN / golden / "rank-00000.index").read_bytes()
    assert struct.unpack_from("<HH", index, 8) == (1, 1)
    manifest = (GOLDEN / golden / "MANIFEST").read_bytes()
    assert struct.unpack_from("<HH", manifest, 8) == (1, 0)  # 1.1 adds nothing to MANIFEST
    pieces = {p["name"]: p for p in index_body(GOLDEN / golden)["pieces"]}
    expect = {
        "model/w": (weights(2048), 4, [False, False, False, True]),
        "model/h": (weights(2048, 1).bfloat16(), 2, [False, True]),
        "model/z": (torch.zeros(64), 4, [True] * 4),
    }
    for name, (tensor, size, zstd_planes) in expect.items():
        ((offset, stored, raw_size, crc, codec),) = pieces[name]["chunks"]
        frame = data[offset : offset + stored]
        assert codec == CODEC_PLANES and raw_size == tensor.numel() * size
        assert crc == zlib.crc32(frame)
        n = raw_size // size
        shuffled = tensor.view(torch.uint8).numpy().reshape(n, size).T
        sizes = struct.unpack_from(f"<{size}I", frame)
        at = 4 * size
        for k, plane_size in enumerate(sizes):
            part = frame[at : at + plane_size]
            at += plane_size
            assert (plane_size < n) == zstd_planes[k], (name, k)
            plain = zstandard.ZstdDecompressor().decompress(part) if plane_size < n else part
            assert plain == shuffled[k].tobytes()
        assert at == stored
    # one-byte elements keep codec 1 (whole chunk zstd) or raw; never codec 2
    assert pieces["model/i"]["chunks"][0][4] in (CODEC_RAW, CODEC_SHUFFLE_ZSTD)


@pytest.mark.parametrize("compression", ["none", "zstd", *PLANES_GOLDEN])
def test_golden_checkpoints_of_both_versions_load(compression: str) -> None:
    planes = compression in PLANES_GOLDEN
    with CheckpointReader(GOLDEN / compression) as r:
        assert r.format_version == ((1, 1) if planes else (1, 0))
        assert torch.equal(r.read("model/z"), torch.zeros(64))
        if planes:
            assert torch.equal(r.read("model/w").view(-1), weights(2048))
            assert torch.equal(r.read("model/h"), weights(2048, 1).bfloat16())
            assert torch.equal(
                r.read("model/w", (3, 5), (20, 7)), weights(2048).view(32, 64)[3:23, 5:12]
            )
            r.verify(deep=True)
        else:
            assert torch.equal(r.read("model/w"), torch.arange(6.0).reshape(2, 3))


def test_version_is_the_lowest_that_describes_the_files(tmp_path: Path) -> None:
    for comp, data, want in (
        ("none", weights(4096), 0),
        ("zstd", torch.rand(4096, generator=torch.Generator().manual_seed(0)).double(), None),
        ("zstd", weights(4096), 1),
    ):
        d = tmp_path / f"{comp}{want}"
        w = RankWriter(d, 0, compression=comp)  # type: ignore[arg-type]
        w.add("model/x", data, global_shape=data.shape, offsets=(0,))
        write_manifest(d, world_size=1, rank_files=[w.close()], state={})
        minor = struct.unpack_from("<H", (d / "rank-00000.data").read_bytes(), 10)[0]
        codecs = {c[4] for p in index_body(d)["pieces"] for c in p["chunks"]}
        assert minor == (1 if CODEC_PLANES in codecs else 0)
        if want is not None:
            assert minor == want
        assert torch.equal(CheckpointReader(d).read("model/x"), data)


def test_plane_compressor_only_for_byte_planes_at_level_1(tmp_path: Path) -> None:
    # [Note: plane compressor]: byte planes at level 1 use hash_log 6; one-byte elements
    # (codec 1) and other levels use zstd's own parameters for the level.
    w32, u8 = weights(4096), torch.arange(4096, dtype=torch.int32).to(torch.uint8)

    def frames(level: int) -> tuple[bytes, bytes]:
        d = tmp_path / f"l{level}"
        w = RankWriter(d, 0, level=level)
        w.add("model/w", w32, global_shape=w32.shape, offsets=(0,))
        w.add("model/u", u8, global_shape=u8.shape, offsets=(0,))
        w.close()
        data = (d / "rank-00000.data").read_bytes()
        (wp, up) = index_body(d)["pieces"]
        (offset, stored, _, _, codec), ((u_off, u_stored, _, _, u_codec),) = (
            wp["chunks"][0],
            up["chunks"],
        )
        assert (codec, u_codec) == (CODEC_PLANES, CODEC_SHUFFLE_ZSTD)
        frame = data[offset : offset + stored]
        sizes = struct.unpack_from("<4I", frame)
        return frame[16 + sum(sizes[:3]) :], data[u_off : u_off + u_stored]

    exponent = weights(4096).view(torch.uint8).numpy().reshape(-1, 4)[:, 3].tobytes()
    small_table = zstandard.ZstdCompressionParameters.from_level(
        1, hash_log=6, write_content_size=True
    )
    for level, planes in (
        (1, zstandard.ZstdCompressor(compression_params=small_table)),
        (3, zstandard.ZstdCompressor(level=3, write_content_size=True)),
    ):
        plane, whole = frames(level)
        own = zstandard.ZstdCompressor(level=level, write_content_size=True)
        assert plane == planes.compress(exponent)
        assert whole == own.compress(u8.numpy().tobytes())
        if level == 1:  # the small table does change the frame
            assert plane != own.compress(exponent)


def test_a_plane_is_compressed_only_when_it_shrinks_below_80_percent(tmp_path: Path) -> None:
    # [Note: byte-plane coding]: a top plane of 112 equally likely byte values compresses to
    # ~0.86 (it was compressed under the former 90% bar) and is stored raw; 64 values
    # compress to ~0.76 and are worth it.
    rng = np.random.default_rng(0)
    w = RankWriter(tmp_path, 0)
    for values in (112, 64):
        b = rng.integers(0, 256, (8192, 4), dtype=np.uint8)
        b[:, 3] = rng.integers(0, values, 8192)
        t = torch.from_numpy(b.reshape(-1).view(np.float32).copy())
        w.add(f"model/v{values}", t, global_shape=t.shape, offsets=(0,))
    w.close()
    chunks = {p["name"]: p["chunks"] for p in index_body(tmp_path)["pieces"]}
    assert [c[4] for c in chunks["model/v112"]] == [CODEC_RAW]
    ((offset, stored, _, _, codec),) = chunks["model/v64"]
    assert codec == CODEC_PLANES
    frame = (tmp_path / "rank-00000.data").read_bytes()[offset : offset + stored]
    sizes = struct.unpack_from("<4I", frame)
    assert sizes[:3] == (8192,) * 3 and 0.7 * 8192 < sizes[3] < 0.8 * 8192


def test_codec2_in_a_1_0_index_is_a_format_error(tmp_path: Path) -> None:
    shutil.copytree(GOLDEN / "planes", tmp_path / "c")
    d = tmp_path / "c"
    for name in ("rank-00000.data", "rank-00000.index"):
        raw = bytearray((d / name).read_bytes())
        raw[10:12] = struct.pack("<H", 0)
        if name.endswith("index"):
            raw[-4:] = struct.pack("<I", zlib.crc32(raw[:-4]))
        (d / name).write_bytes(bytes(raw))
    _fix_manifest(d)
    with pytest.raises(CheckpointFormatError, match=r"chunk \[.*\] is out of range"):
        CheckpointReader(d)


def _fix_manifest(d: Path) -> None:
    """Rewrite MANIFEST's index size/CRC after an index edit (keeps the tests about what
    they test, not about the MANIFEST noticing the edit)."""
    raw = (d / "MANIFEST").read_bytes()
    (n,) = struct.unpack_from("<Q", raw, 16)
    body = msgpack.unpackb(raw[24 : 24 + n])
    index = (d / "rank-00000.index").read_bytes()
    body["ranks"][0]["index_size"] = len(index)
    body["ranks"][0]["index_crc32"] = zlib.crc32(index)
    new = msgpack.packb(body, use_bin_type=True)
    head = raw[:16] + struct.pack("<Q", len(new))
    (d / "MANIFEST").write_bytes(head + new + struct.pack("<I", zlib.crc32(head + new)))


def _planes_chunk(d: Path, name: str) -> list[int]:
    return next(p for p in index_body(d)["pieces"] if p["name"] == name)["chunks"][0]


@pytest.mark.parametrize("where", ["header", "raw plane", "zstd plane"])
def test_damage_in_any_part_of_a_plane_frame_is_caught(tmp_path: Path, where: str) -> None:
    d = tmp_path / "c"
    shutil.copytree(GOLDEN / "planes", d)
    offset, stored, *_ = _planes_chunk(d, "model/w")
    at = {"header": offset + 1, "raw plane": offset + 16 + 5, "zstd plane": offset + stored - 3}
    raw = bytearray((d / "rank-00000.data").read_bytes())
    raw[at[where]] ^= 0x40
    (d / "rank-00000.data").write_bytes(bytes(raw))
    with CheckpointReader(d) as r:
        with pytest.raises(CheckpointCorruptError, match="fails its CRC-32 check"):
            r.read("model/w")
        with pytest.raises(CheckpointCorruptError, match="fails its CRC-32 check"):
            r.verify()


def test_inconsistent_plane_sizes_with_a_matching_crc_are_refused(tmp_path: Path) -> None:
    d = tmp_path / "c"
    shutil.copytree(GOLDEN / "planes", d)
    offset, stored, *_ = _planes_chunk(d, "model/w")
    raw = bytearray((d / "rank-00000.data").read_bytes())
    raw[offset : offset + 4] = struct.pack("<I", 10**6)  # plane 0 larger than the frame
    (d / "rank-00000.data").write_bytes(bytes(raw))
    body = index_body(d)  # re-sign the frame, as a hostile writer would
    for p in body["pieces"]:
        if p["name"] == "model/w":
            p["chunks"][0][3] = zlib.crc32(raw[offset : offset + stored])
    idx = (d / "rank-00000.index").read_bytes()
    new = msgpack.packb(body, use_bin_type=True)
    head = idx[:16] + struct.pack("<Q", len(new))
    (d / "rank-00000.index").write_bytes(head + new + struct.pack("<I", zlib.crc32(head + new)))
    _fix_manifest(d)
    with (
        CheckpointReader(d) as r,
        pytest.raises(CheckpointCorruptError, match=r"declares plane sizes \[1000000"),
    ):
        r.read("model/w")


def test_zstd_plane_declaring_a_huge_size_is_refused_before_decompressing(
    tmp_path: Path,
) -> None:
    d = tmp_path / "c"
    shutil.copytree(GOLDEN / "planes", d)
    offset, stored, *_ = _planes_chunk(d, "model/w")
    raw = bytearray((d / "rank-00000.data").read_bytes())
    frame = raw[offset : offset + stored]
    sizes = list(struct.unpack_from("<4I", frame))
    bomb = zstd_frame_declaring(1 << 40)  # a frame header claiming a terabyte
    head = 16 + sum(sizes[:3])
    new = frame[:head] + bomb
    new[12:16] = struct.pack("<I", len(bomb))
    data = raw[:offset] + new + raw[offset + stored :]
    (d / "rank-00000.data").write_bytes(bytes(data))
    body = index_body(d)
    delta = len(new) - stored
    for p in body["pieces"]:
        for c in p["chunks"]:
            if c[0] == offset:
                c[1], c[3] = len(new), zlib.crc32(new)
            elif c[0] > offset:
                c[0] += delta
    _resign_index(d, body, delta)
    with (
        CheckpointReader(d) as r,
        pytest.raises(CheckpointCorruptError, match="zstd frame declares 1099511627776 bytes"),
    ):
        r.read("model/w")


def _resign_index(d: Path, body: dict, data_delta: int) -> None:
    body["data_size"] += data_delta
    idx = (d / "rank-00000.index").read_bytes()
    new = msgpack.packb(body, use_bin_type=True)
    head = idx[:16] + struct.pack("<Q", len(new))
    (d / "rank-00000.index").write_bytes(head + new + struct.pack("<I", zlib.crc32(head + new)))
    raw = (d / "MANIFEST").read_bytes()
    (n,) = struct.unpack_from("<Q", raw, 16)
    man = msgpack.unpackb(raw[24 : 24 + n])
    man["ranks"][0]["data_size"] += data_delta
    packed = msgpack.packb(man, use_bin_type=True)
    mhead = raw[:16] + struct.pack("<Q", len(packed))
    (d / "MANIFEST").write_bytes(mhead + packed + struct.pack("<I", zlib.crc32(mhead + packed)))
    _fix_manifest(d)


def test_crc32_combine_matches_zlib() -> None:
    rnd = random.Random(0)
    for _ in range(50):
        a = rnd.randbytes(rnd.randrange(0, 300))
        b = rnd.randbytes(rnd.choice([0, 1, 7, 64, 1000, 70_000]))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_numpy_kernels_shuffle_and_unshuffle_invert() -> None:
    k = NumpyKernels()
    src = np.frombuffer(random.Random(1).randbytes(4 * 1000), dtype=np.uint8)
    planes = np.empty_like(src)
    crcs = k.shuffle_crc(src, 4, planes, [True, False, True, True])
    assert crcs[1] == 0 and crcs[2] == zlib.crc32(planes[2000:3000].data)
    assert planes[1000 + 7] == src[7 * 4 + 1]
    back = np.zeros_like(src)
    got = k.unshuffle_crc([planes[i * 1000 : (i + 1) * 1000] for i in range(4)], back, True)
    assert np.array_equal(back, src) and got[3] == zlib.crc32(planes[3000:].data)


def test_parallel_reads_and_pipelined_writes_give_the_same_tensors(tmp_path: Path) -> None:
    t = weights(60_000).reshape(300, 200)
    for threads in (1, 3):
        d = tmp_path / str(threads)
        w = RankWriter(d, 0, chunk_bytes=4000, threads=threads, file_id=b"t" * 16)
        w.add("model/t", t, global_shape=t.shape, offsets=(0, 0))
        write_manifest(d, world_size=1, rank_files=[w.close()], state={})
    assert (tmp_path / "1" / "rank-00000.data").read_bytes() == (
        tmp_path / "3" / "rank-00000.data"
    ).read_bytes()
    with CheckpointReader(tmp_path / "3", threads=3) as r:
        assert torch.equal(r.read("model/t"), t)
        assert torch.equal(r.read("model/t", (7, 0), (250, 200)), t[7:257])
        assert torch.equal(r.read("model/t", (7, 3), (250, 190)), t[7:257, 3:193])
    with pytest.raises(ValueError, match="threads must be a positive int; got 0"):
        CheckpointReader(tmp_path / "3", threads=0)


def test_read_into_decodes_in_place_and_wait_collects_deferred_chunks(tmp_path: Path) -> None:
    t = weights(60_000).reshape(300, 200)
    u = weights(9_000, seed=1).to(torch.bfloat16)
    w = RankWriter(tmp_path, 0, chunk_bytes=4000, threads=2, file_id=b"t" * 16)
    w.add("model/t", t, global_shape=t.shape, offsets=(0, 0))
    w.add("model/u", u, global_shape=u.shape, offsets=(0,))
    write_manifest(tmp_path, world_size=1, rank_files=[w.close()], state={})
    with CheckpointReader(tmp_path, threads=3) as r:
        rows, cols, whole = torch.zeros(250, 200), torch.zeros(250, 190), torch.zeros_like(u)
        r.read_into("model/t", rows, (7, 0), wait=False)  # chunks left to the workers
        r.read_into("model/t", cols, (7, 3), wait=False)  # strided: decoded before return
        r.read_into("model/u", whole, wait=False)
        r.wait()
        assert torch.equal(rows, t[7:257]) and torch.equal(cols, t[7:257, 3:193])
        assert torch.equal(whole, u)
        for bad, found in (
            (torch.zeros(250, 200, dtype=torch.float64), "torch.float64 on cpu"),
            (torch.zeros(200, 250).t(), "contiguous=False"),
            (torch.zeros(250, 200, requires_grad=True), "requires_grad=True"),
        ):
            with pytest.raises(ValueError, match=f"dtype torch.float32 .*got .*{found}"):
                r.read_into("model/t", bad)
    data = tmp_path / "rank-00000.data"
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF  # the last chunk of model/u
    data.write_bytes(bytes(raw))
    with CheckpointReader(tmp_path, threads=3) as r:
        out = torch.zeros_like(u)
        r.read_into("model/u", out, wait=False)  # the damage surfaces in wait()
        with pytest.raises(CheckpointCorruptError, match="fails its CRC-32 check"):
            r.wait()
        r.wait()  # reported once; nothing left pending


if __name__ == "__main__":  # regenerate: python -m tests.test_ckpt_planes
    shutil.rmtree(GOLDEN / "planes", ignore_errors=True)
    write_golden_planes(GOLDEN / "planes")
