"""fsdpx.ops.shuffle: the native shuffle+CRC kernels equal the numpy reference byte for
byte (and so write identical checkpoints), opcheck on every op, and input validation."""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.library import opcheck

from checkpoint_tools.format import CheckpointReader, RankWriter, write_manifest
from checkpoint_tools.format.kernels import NumpyKernels
from fsdpx.ops._loader import load_ops
from fsdpx.ops.shuffle import NativeKernels, checkpoint_kernels, native_available
from tests.test_ckpt_planes import GOLDEN, weights, write_golden_planes

REF = NumpyKernels()


@pytest.fixture
def native() -> NativeKernels:
    status = load_ops()
    if not status.available:
        pytest.skip(f"native fsdpx ops unavailable: {status.reason}")
    assert native_available()
    return NativeKernels()


def rand_bytes(n: int, seed: int) -> np.ndarray:
    return np.frombuffer(bytearray(random.Random(seed).randbytes(n)), dtype=np.uint8)


@pytest.mark.parametrize("size", [1, 2, 4, 8])
@pytest.mark.parametrize("elements", [1, 7, 8191, 8192, 20_000])
def test_shuffle_crc_equals_reference(native: NativeKernels, size: int, elements: int) -> None:
    src = rand_bytes(size * elements, seed=size * elements)
    want = [k % 2 == 0 for k in range(size)]
    got, ref = np.empty_like(src), np.empty_like(src)
    assert native.shuffle_crc(src, size, got, want) == REF.shuffle_crc(src, size, ref, want)
    assert np.array_equal(got, ref)


@pytest.mark.parametrize("size", [2, 4, 8])
def test_unshuffle_crc_equals_reference_with_missing_planes(
    native: NativeKernels, size: int
) -> None:
    n = 10_001
    planes = [rand_bytes(n, seed=k) for k in range(size)]
    given = [p if k != 1 else None for k, p in enumerate(planes)]
    got, ref = rand_bytes(n * size, 99).copy(), rand_bytes(n * size, 99).copy()
    for crc in (True, False):
        assert native.unshuffle_crc(given, got, crc) == REF.unshuffle_crc(given, ref, crc)
        assert np.array_equal(got, ref)
    # read-only planes (bytes) fall back to the reference and still give the same result
    assert native.unshuffle_crc([bytes(p) for p in planes], got, True) == REF.unshuffle_crc(
        planes, ref, True
    )
    assert np.array_equal(got, ref)


def test_crc32_equals_zlib_at_every_length_and_alignment(native: NativeKernels) -> None:
    buf = rand_bytes(1 << 17, seed=3)
    rnd = random.Random(4)
    for n in [*range(0, 200), 16_384, 16_385, 65_536 + 13, (1 << 17) - 7]:
        start = rnd.randrange(0, 8)
        data = buf[start : start + n]
        value = rnd.randrange(0, 1 << 32)
        assert native.crc32(data, value) == zlib.crc32(data.data, value), (n, start)


def test_native_kernels_write_the_golden_bytes(
    native: NativeKernels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import checkpoint_tools.format.writer as writer_mod

    monkeypatch.setattr(writer_mod, "DEFAULT_KERNELS", native)  # what write_golden_planes uses
    write_golden_planes(tmp_path)
    for name in ("MANIFEST", "rank-00000.data", "rank-00000.index"):
        assert (tmp_path / name).read_bytes() == (GOLDEN / "planes" / name).read_bytes(), name


def test_native_and_numpy_write_and_read_each_others_checkpoints(
    native: NativeKernels, tmp_path: Path
) -> None:
    t = {"w": weights(300_000).reshape(600, 500), "h": weights(70_000, 2).bfloat16()}
    for kernels in (native, REF):
        d = tmp_path / kernels.name
        w = RankWriter(d, 0, chunk_bytes=100_000, threads=2, kernels=kernels, file_id=b"f" * 16)
        for name, x in t.items():
            w.add(f"model/{name}", x, global_shape=x.shape, offsets=[0] * x.dim())
        write_manifest(d, world_size=1, rank_files=[w.close()], state={})
    for name in ("rank-00000.data", "rank-00000.index"):
        assert (tmp_path / "native" / name).read_bytes() == (tmp_path / "numpy" / name).read_bytes()
    for kernels in (native, REF):
        with CheckpointReader(tmp_path / "numpy", kernels=kernels) as r:
            assert torch.equal(r.read("model/w"), t["w"])
            assert torch.equal(r.read("model/h", (1000,), (5000,)), t["h"][1000:6000])


def test_checkpoint_kernels_are_native_when_built(native: NativeKernels) -> None:
    assert checkpoint_kernels().name == "native"


def test_opcheck(native: NativeKernels) -> None:
    src = torch.from_numpy(rand_bytes(4 * 300, 5).copy())
    opcheck(torch.ops.fsdpx.shuffle_crc.default, (src, torch.empty_like(src), 4, [True] * 4))
    planes = [torch.from_numpy(rand_bytes(300, k).copy()) for k in range(4)]
    opcheck(torch.ops.fsdpx.unshuffle_crc.default, ([planes[0], None, *planes[2:]], src, True))
    opcheck(torch.ops.fsdpx.crc32.default, (src, 7))


def test_bad_inputs_are_refused(native: NativeKernels) -> None:
    src = torch.zeros(12, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="element size must be 1, 2, 4 or 8, got 3"):
        torch.ops.fsdpx.shuffle_crc(src, torch.empty_like(src), 3, [True] * 3)
    with pytest.raises(RuntimeError, match="expected src of a whole number of 8-byte elements"):
        torch.ops.fsdpx.shuffle_crc(src, torch.empty_like(src), 8, [True] * 8)
    with pytest.raises(RuntimeError, match="expected dst to be a contiguous 1-d uint8 CPU"):
        torch.ops.fsdpx.shuffle_crc(src, torch.zeros(12), 4, [True] * 4)
    with pytest.raises(RuntimeError, match="plane 1 has 2 bytes, expected 3"):
        torch.ops.fsdpx.unshuffle_crc([src[:3], src[:2], None, None], src, True)
    with pytest.raises(RuntimeError, match=r"value must be a CRC-32 in \[0, 2\*\*32\)"):
        torch.ops.fsdpx.crc32(src, -1)
