"""Review (rev6): the native shuffle/unshuffle + CRC kernels (SSSE3 path for 2- and
4-byte elements, [Note: one-load shuffle]) equal the numpy reference at every small
length (0..200 elements; every source/destination misalignment 0..15 bytes up to 48
elements, one each beyond), for element sizes 1, 2, 4 and 8, and around the 8192-element
block edge: shuffle with the CRC of a random subset of planes, and unshuffle back."""

from __future__ import annotations

import random

import numpy as np
import pytest

from checkpoint_tools.format.kernels import NumpyKernels
from fsdpx.ops._loader import load_ops
from fsdpx.ops.shuffle import NativeKernels

REF = NumpyKernels()


@pytest.fixture(scope="module")
def native() -> NativeKernels:
    status = load_ops()
    if not status.available:
        pytest.skip(f"native fsdpx ops unavailable: {status.reason}")
    return NativeKernels()


def _misaligned(n: int, offset: int, rnd: random.Random) -> np.ndarray:
    """A writable n-byte uint8 array starting `offset` bytes past a 64-byte boundary."""
    base = np.frombuffer(bytearray(rnd.randbytes(n + 128)), dtype=np.uint8)
    skip = (-base.ctypes.data) % 64 + offset
    out = base[skip : skip + n]
    assert len(out) == n and (n == 0 or out.ctypes.data % 64 == offset)
    return out


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_shuffle_unshuffle_every_small_length_and_alignment(
    native: NativeKernels, size: int
) -> None:
    rnd = random.Random(size)
    lengths = [*range(0, 201), 8191, 8192, 8193, 8192 + 15, 8192 + 16, 8192 + 17, 16_400]
    for n in lengths:
        # every source offset for the lengths around the 16-element vector step; one
        # (varying) offset each for the rest, so every length and offset is covered
        for src_off in range(16) if n <= 48 else [n % 16]:
            dst_off = (src_off * 7 + n) % 16
            src = _misaligned(n * size, src_off, rnd)
            want = [rnd.random() < 0.5 for _ in range(size)]
            got = _misaligned(n * size, dst_off, rnd)
            ref = np.empty_like(src)
            crcs = native.shuffle_crc(src, size, got, want)
            assert crcs == REF.shuffle_crc(src, size, ref, want), (n, src_off)
            assert np.array_equal(got, ref), (n, src_off, dst_off)
            # and back: every plane given, misaligned planes and destination
            planes = []
            for k in range(size):
                p = _misaligned(n, (src_off + k) % 16, rnd)
                p[...] = ref[k * n : (k + 1) * n]
                planes.append(p)
            back = _misaligned(n * size, dst_off, rnd)
            back_ref = back.copy()
            assert native.unshuffle_crc(planes, back, True) == REF.unshuffle_crc(
                planes, back_ref, True
            )
            assert np.array_equal(back, src), (n, src_off)
            assert np.array_equal(back_ref, src)
