"""Hostile and damaged checkpoints: every case raises a documented CheckpointError
subtype naming the file (and tensor/offset for data damage), never another exception,
never allocates beyond declared sizes, never opens files outside the checkpoint, never
unpickles. Forged cases re-sign the checksum chain (index CRC in MANIFEST, MANIFEST CRC)
so the parser, not the checksum, has to catch them."""

from __future__ import annotations

import builtins
import os
import pickle
import re
import shutil
import struct
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import checkpoint_tools
from checkpoint_tools.format import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointReader,
    RankWriter,
    write_manifest,
)
from checkpoint_tools.format.layout import (
    CODEC_SHUFFLE_ZSTD,
    INDEX_MAGIC,
    MANIFEST_MAGIC,
    pack_container,
)

FILES = ["MANIFEST", "rank-00000.index", "rank-00001.index", "rank-00000.data", "rank-00001.data"]
PEAK_LIMIT = 8 << 20  # the checkpoint is a few KiB; any big allocation is a bug


def make_base(d: Path) -> dict[str, torch.Tensor]:
    tensors = {
        "model/w": torch.linspace(-1, 1, 600).reshape(20, 30),
        "model/b": torch.arange(20, dtype=torch.bfloat16),
        "optim/w/exp_avg": torch.zeros(20, 30),
        "model/s": torch.tensor(5, dtype=torch.int64),
    }
    infos = []
    for rank in range(2):
        w = RankWriter(d, rank, chunk_bytes=256)
        for name, t in tensors.items():
            if t.dim() == 0:
                w.add(name, t, global_shape=(), offsets=())
            else:
                lo = 0 if rank == 0 else 7
                hi = 7 if rank == 0 else t.shape[0]
                w.add(name, t[lo:hi], global_shape=t.shape, offsets=(lo, *[0] * (t.dim() - 1)))
        infos.append(w.close())
    write_manifest(d, world_size=2, rank_files=infos, state={"step": 1, "rng": b"\x00" * 32})
    return tensors


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("base") / "ckpt"
    make_base(d)
    return d


@pytest.fixture
def ckpt(base: Path, tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(base, d)
    return d


def load_all(d: Path) -> None:
    """Everything a loader does: open, read every tensor, verify every chunk deeply."""
    with CheckpointReader(d) as r:
        for name in r.names():
            r.read(name)
        r.verify(deep=True)


def expect_error(d: Path, kind: type[CheckpointError] = CheckpointError) -> CheckpointError:
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError) as info:
            load_all(d)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(info.value, kind), repr(info.value)
    assert peak < PEAK_LIMIT, f"peak {peak} bytes while rejecting a hostile checkpoint"
    return info.value


# --- random damage ------------------------------------------------------------------------


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(file=st.sampled_from(FILES), where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_any_bit_flip_is_detected(
    base: Path, tmp_path: Path, file: str, where: float, bit: int
) -> None:
    d = tmp_path / f"flip-{file}-{where}-{bit}"
    shutil.copytree(base, d)
    raw = bytearray((d / file).read_bytes())
    pos = int(where * len(raw))
    raw[pos] ^= 1 << bit
    (d / file).write_bytes(bytes(raw))
    err = expect_error(d)
    assert err.path is not None and Path(err.path).name == file, (err, file, pos)
    if file.endswith(".data") and pos >= 32:
        # a flipped data byte is reported at its chunk: tensor name and chunk offset
        assert err.tensor is not None and err.offset is not None
        assert err.offset <= pos < err.offset + 256 + 64, (err, pos)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(file=st.sampled_from(FILES), where=st.floats(0, 1, exclude_max=True), extra=st.booleans())
def test_truncation_or_extension_is_detected(
    base: Path, tmp_path: Path, file: str, where: float, extra: bool
) -> None:
    d = tmp_path / f"trunc-{file}-{where}-{extra}"
    shutil.copytree(base, d)
    raw = (d / file).read_bytes()
    (d / file).write_bytes(raw + b"\x00" * 7 if extra else raw[: int(where * len(raw))])
    err = expect_error(d, CheckpointError)
    assert err.path is not None and Path(err.path).name == file


@pytest.mark.parametrize(
    "pair", [("rank-00000.data", "rank-00001.data"), ("rank-00000.index", "rank-00001.index")]
)
def test_swapped_rank_files(ckpt: Path, pair: tuple[str, str]) -> None:
    a, b = ckpt / pair[0], ckpt / pair[1]
    tmp = ckpt / "swap"
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    err = expect_error(ckpt, CheckpointCorruptError)
    assert "swapped" in str(err) or "MANIFEST expects" in str(err)


def test_same_size_data_file_from_another_checkpoint(ckpt: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    make_base(other)  # same tensors, same sizes, different random file ids
    shutil.copy(other / "rank-00001.data", ckpt / "rank-00001.data")
    with pytest.raises(CheckpointCorruptError, match="belongs to another rank or checkpoint"):
        load_all(ckpt)


def test_missing_files(ckpt: Path) -> None:
    (ckpt / "rank-00001.data").unlink()
    with pytest.raises(CheckpointError, match="missing checkpoint file 'rank-00001.data'"):
        load_all(ckpt)
    (ckpt / "MANIFEST").unlink()
    with pytest.raises(CheckpointError, match="no MANIFEST"):
        load_all(ckpt)


# --- forged files (checksums re-signed) ---------------------------------------------------


def read_container(path: Path) -> Any:
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw, 16)
    return msgpack.unpackb(raw[24 : 24 + n], strict_map_key=False)


def resign(
    d: Path,
    index_body: dict[str, Any] | None = None,
    rank: int = 0,
    manifest_body: bytes | None = None,
) -> None:
    """Write a forged index for `rank` (or a raw MANIFEST body) with a valid checksum chain."""
    manifest = read_container(d / "MANIFEST")
    if index_body is not None:
        blob = pack_container(INDEX_MAGIC, msgpack.packb(index_body, use_bin_type=True))
        (d / f"rank-{rank:05d}.index").write_bytes(blob)
        manifest["ranks"][rank]["index_size"] = len(blob)
        manifest["ranks"][rank]["index_crc32"] = zlib.crc32(blob)
    body = (
        manifest_body if manifest_body is not None else msgpack.packb(manifest, use_bin_type=True)
    )
    # keep the MANIFEST's version: 1.2 (with its tensor table) for the base checkpoint
    (minor,) = struct.unpack_from("<H", (d / "MANIFEST").read_bytes(), 10)
    (d / "MANIFEST").write_bytes(pack_container(MANIFEST_MAGIC, body, minor))


def forge_index(d: Path, edit: Callable[[dict[str, Any]], None], rank: int = 0) -> None:
    body = read_container(d / f"rank-{rank:05d}.index")
    edit(body)
    resign(d, body, rank)


def piece(body: dict[str, Any], name: str) -> dict[str, Any]:
    return next(p for p in body["pieces"] if p["name"] == name)


@pytest.mark.parametrize(
    "name", ["../../etc/passwd", "/abs/path", "model//x", "model/./x", "a\\b", "x\x00y", ""]
)
def test_hostile_tensor_names(ckpt: Path, name: str) -> None:
    forge_index(ckpt, lambda b: piece(b, "model/b").__setitem__("name", name))
    with pytest.raises(CheckpointFormatError, match="invalid tensor name"):
        load_all(ckpt)


@pytest.mark.parametrize(
    "field,value",
    [
        ("index_file", "../outside/rank-00000.index"),
        ("index_file", "/etc/passwd"),
        ("data_file", "rank-00000.data/../../x"),
        ("data_file", "rank-00001.data"),  # another rank's file
    ],
)
def test_manifest_paths_outside_directory(
    ckpt: Path, field: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = read_container(ckpt / "MANIFEST")
    manifest["ranks"][0][field] = value
    resign(ckpt, manifest_body=msgpack.packb(manifest, use_bin_type=True))
    opened = record_opens(monkeypatch)
    with pytest.raises(
        CheckpointFormatError, match="expected rank 0 with files 'rank-00000.index'"
    ):
        load_all(ckpt)
    assert_inside(opened, ckpt)


def record_opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    opened: list[str] = []
    real_open, real_os_open = builtins.open, os.open

    def spy_open(file: Any, *a: Any, **k: Any) -> Any:
        if not isinstance(file, int):
            opened.append(os.fspath(file))
        return real_open(file, *a, **k)

    def spy_os_open(path: Any, *a: Any, **k: Any) -> int:
        opened.append(os.fspath(path))
        return real_os_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(os, "open", spy_os_open)
    return opened


def assert_inside(opened: list[str], d: Path) -> None:
    root = d.resolve()
    for p in opened:
        assert Path(p).resolve().is_relative_to(root), f"opened {p} outside {root}"


def test_symlinked_rank_file_is_refused(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = tmp_path / "secret"
    shutil.copy(ckpt / "rank-00001.data", outside)
    (ckpt / "rank-00001.data").unlink()
    (ckpt / "rank-00001.data").symlink_to(outside)
    with pytest.raises(CheckpointFormatError, match="symlinks are refused"):
        load_all(ckpt)


def test_fifo_under_a_checkpoint_name_does_not_hang(ckpt: Path) -> None:
    (ckpt / "MANIFEST").unlink()
    os.mkfifo(ckpt / "MANIFEST")
    with pytest.raises(CheckpointFormatError, match="'MANIFEST' is not a regular file"):
        load_all(ckpt)


def test_latest_symlink_outside_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "elsewhere").write_text("global_step1\n")
    (root / "latest").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointFormatError, match="symlinks are refused"):
        checkpoint_tools.resolve_checkpoint(root)


def zstd_frame_declaring(content_size: int | None, payload: bytes = b"abcd") -> bytes:
    """A zstd frame whose header declares `content_size` (None: no size) with one raw block."""
    magic = struct.pack("<I", 0xFD2FB528)
    block = struct.pack("<I", (len(payload) << 3) | 1)[:3] + payload  # last block, raw
    if content_size is None:
        return magic + bytes([0x00, 0x50]) + block  # no FCS, window descriptor
    return magic + bytes([0xE0]) + struct.pack("<Q", content_size) + block


@pytest.mark.parametrize("declared", [1 << 40, 200 << 20, None, 3])
def test_zstd_frame_declaring_wrong_content_size(ckpt: Path, declared: int | None) -> None:
    def edit(body: dict[str, Any]) -> None:
        chunk = piece(body, "model/w")["chunks"][0]
        frame = zstd_frame_declaring(declared)
        data = bytearray((ckpt / "rank-00000.data").read_bytes())
        data[chunk[0] : chunk[0] + len(frame)] = frame
        (ckpt / "rank-00000.data").write_bytes(bytes(data))
        chunk[1:5] = [len(frame), chunk[2], zlib.crc32(frame), CODEC_SHUFFLE_ZSTD]

    forge_index(ckpt, edit)
    err = expect_error(ckpt, CheckpointCorruptError)
    assert "zstd frame declares" in str(err) and err.tensor == "model/w" and err.offset == 32


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda p: p["chunks"][0].__setitem__(2, 1 << 40), "out of range"),  # raw size bomb
        (lambda p: p["chunks"][0].__setitem__(0, 1 << 50), "out of range"),  # offset past EOF
        (lambda p: p["chunks"][0].__setitem__(4, 9), "out of range"),  # unknown codec
        (lambda p: p.__setitem__("shape", [7, 31]), "does not fit global shape|chunks hold"),
        (lambda p: p.update(shape=[7, 3000000], global_shape=[20, 3000000]), "chunks hold"),
        (lambda p: p.__setitem__("global_shape", [1 << 40, 30]), "stores dtype"),
        (lambda p: p.__setitem__("dtype", "F128"), "unknown dtype"),
        (lambda p: p.__setitem__("offsets", [-1, 0]), "expected ints"),
        (lambda p: p.__setitem__("chunks", [[1, 2, 3]]), "list of 5 ints"),
        (lambda p: p.__setitem__("chunks", "x" * 10), "must be list"),
        (lambda p: p.__setitem__("global_shape", [1] * 100), "at most 64"),
    ],
)
def test_forged_index_fields(
    ckpt: Path, edit: Callable[[dict[str, Any]], None], match: str
) -> None:
    forge_index(ckpt, lambda b: edit(piece(b, "model/w")))
    err = expect_error(ckpt, CheckpointFormatError)
    assert err.path is None or Path(err.path).is_relative_to(ckpt)
    assert re.search(match, str(err)), str(err)


def bombs() -> Iterator[tuple[str, bytes]]:
    yield "array 2^32-1", b"\xdd\xff\xff\xff\xff"
    yield "map 2^32-1", b"\xdf\xff\xff\xff\xff"
    yield "str 2^32-1", b"\xdb\xff\xff\xff\xff" + b"a" * 10
    yield "bin 2^32-1", b"\xc6\xff\xff\xff\xff" + b"a" * 10
    yield "ext", b"\xd4\x01\x00"
    yield "deep arrays", b"\x91" * 200_000 + b"\xc0"
    yield "deep maps", b"\x81\xa1k" * 100_000 + b"\xc0"
    yield "trailing data", msgpack.packb({"a": 1}) + b"\x00"
    yield "not a map", msgpack.packb([1, 2, 3])
    yield "unhashable key", b"\x81\x91\x01\x01"


@pytest.mark.parametrize("label,body", list(bombs()), ids=[b[0] for b in bombs()])
def test_msgpack_bombs_in_manifest_and_index(ckpt: Path, label: str, body: bytes) -> None:
    resign(ckpt, manifest_body=body)
    err = expect_error(ckpt, CheckpointFormatError)
    assert Path(err.path or "").name == "MANIFEST"


@pytest.mark.parametrize("label,body", list(bombs())[:6], ids=[b[0] for b in list(bombs())[:6]])
def test_msgpack_bombs_in_index(ckpt: Path, label: str, body: bytes) -> None:
    blob = pack_container(INDEX_MAGIC, body)
    (ckpt / "rank-00001.index").write_bytes(blob)
    manifest = read_container(ckpt / "MANIFEST")
    manifest["ranks"][1].update(index_size=len(blob), index_crc32=zlib.crc32(blob))
    resign(ckpt, manifest_body=msgpack.packb(manifest, use_bin_type=True))
    err = expect_error(ckpt, CheckpointFormatError)
    assert Path(err.path or "").name == "rank-00001.index"


def test_chunks_sharing_an_offset(ckpt: Path) -> None:
    """Two index entries pointing at the same frame is not damage the CRC can see; the
    reader must still only ever raise CheckpointError or succeed (here: succeed)."""

    def edit(body: dict[str, Any]) -> None:
        chunks = piece(body, "model/w")["chunks"]
        chunks[1] = list(chunks[0])

    forge_index(ckpt, edit)
    load_all(ckpt)


def without_tensor_table(d: Path) -> None:
    """Rewrite MANIFEST as 1.0 (no tensor table): readers then read every index."""
    manifest = read_container(d / "MANIFEST")
    del manifest["tensors"], manifest["layouts"]
    body = msgpack.packb(manifest, use_bin_type=True)
    (d / "MANIFEST").write_bytes(pack_container(MANIFEST_MAGIC, body, 0))


@pytest.mark.parametrize("table", [True, False], ids=["1.2-table", "1.0-manifest"])
def test_huge_global_shape_with_small_pieces(ckpt: Path, table: bool) -> None:
    if not table:
        without_tensor_table(ckpt)
    for rank in range(2):
        forge_index(
            ckpt, lambda b: piece(b, "model/w").__setitem__("global_shape", [1 << 40, 30]), rank
        )
    if table:  # the table says the same (else: "the MANIFEST's tensor table says (20, 30)")
        manifest = read_container(ckpt / "MANIFEST")
        next(t for t in manifest["tensors"] if t[0] == "model/w")[2] = [1 << 40, 30]
        resign(ckpt, manifest_body=msgpack.packb(manifest, use_bin_type=True))
    err = expect_error(ckpt, CheckpointFormatError)  # bounded: no 2**40-row allocation
    assert "leave element (20, 0) uncovered" in str(err) and err.tensor == "model/w"


def test_container_declaring_huge_body(ckpt: Path) -> None:
    raw = bytearray((ckpt / "MANIFEST").read_bytes())
    raw[16:24] = struct.pack("<Q", 1 << 60)
    (ckpt / "MANIFEST").write_bytes(bytes(raw))
    with pytest.raises(
        CheckpointCorruptError, match="header declares a 1152921504606846976-byte body"
    ):
        load_all(ckpt)


def test_index_mismatching_manifest(ckpt: Path) -> None:
    forge_index(ckpt, lambda b: b.__setitem__("rank", 1))
    with pytest.raises(
        CheckpointCorruptError, match="index field 'rank' does not match the MANIFEST"
    ):
        load_all(ckpt)


# --- no code execution on the load path ----------------------------------------------------


def test_load_path_never_unpickles(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def forbidden(*a: Any, **k: Any) -> Any:
        raise AssertionError("pickle/torch.load used on the checkpoint load path")

    for mod, attr in [(pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(mod, attr, forbidden)
    opened = record_opens(monkeypatch)
    load_all(ckpt)
    state = checkpoint_tools.load_state_dict(ckpt, include_optimizer=True)
    assert set(state) == {"w", "b", "s", "optim/w/exp_avg"}
    assert_inside(opened, ckpt)


# --- structure fuzzing: replace any field of a valid body with any msgpack value ----------

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


def paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from paths(v, (*prefix, i))


def replaced(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, dict):
        return {**obj, head: replaced(obj[head], rest, value)}
    return [replaced(v, rest, value) if i == head else v for i, v in enumerate(obj)]


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), which=st.sampled_from(["MANIFEST", "rank-00000.index"]))
def test_any_field_replaced_by_any_value(
    base: Path, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject, which: str
) -> None:
    d = tmp_path_factory.mktemp("fuzz") / "ckpt"
    shutil.copytree(base, d)
    body = read_container(d / which)
    path = data.draw(st.sampled_from(list(paths(body))))
    value = data.draw(values)
    forged = replaced(body, path, value)
    if which == "MANIFEST":
        resign(d, manifest_body=msgpack.packb(forged, use_bin_type=True))
    else:
        blob = pack_container(INDEX_MAGIC, msgpack.packb(forged, use_bin_type=True))
        (d / which).write_bytes(blob)
        manifest = read_container(d / "MANIFEST")
        manifest["ranks"][0].update(index_size=len(blob), index_crc32=zlib.crc32(blob))
        resign(d, manifest_body=msgpack.packb(manifest, use_bin_type=True))
    try:
        load_all(d)
    except CheckpointError:
        return
    # Accepted: only harmless fields may change (state content, informational keys, or
    # a replacement equal to the original).
    assert forged == body or path[:1] in {
        ("state",),
        ("writer",),
        ("compression",),
        ("chunk_bytes",),
    }, path


@pytest.mark.slow
@settings(
    max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    file=st.sampled_from(FILES),
    edits=st.lists(
        st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=8
    ),
)
def test_many_random_byte_edits(
    base: Path, tmp_path_factory: pytest.TempPathFactory, file: str, edits: list[tuple[float, int]]
) -> None:
    """Stress version (`pytest -m slow`): several bytes XORed at once in one file."""
    d = tmp_path_factory.mktemp("edits") / "ckpt"
    shutil.copytree(base, d)
    raw = bytearray((d / file).read_bytes())
    original = bytes(raw)
    for where, mask in edits:
        raw[int(where * len(raw))] ^= mask
    assume(bytes(raw) != original)  # two edits of one byte can cancel out
    (d / file).write_bytes(bytes(raw))
    err = expect_error(d)
    assert err.path is not None and Path(err.path).name == file
