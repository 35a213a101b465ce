"""Review (rev6) of the encoder's frame copies (79ad854, codec._keep: each zstd frame is
copied into its own plane's slot of the scratch buffer before its CRC): on the chunks
where that could go wrong, both kernels give the same stored bytes, the frame CRC is
zlib's over the parts as written, and the frame decodes to the chunk. The chunks: a plane
whose sample compresses but whose whole does not (stored raw after a zstd attempt), one-
byte elements (codec 1, the frame copied to the scratch start), every plane compressed
(each frame in its own slot, none overwriting another), and short odd tails."""

from __future__ import annotations

import random
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from checkpoint_tools.format import codec
from checkpoint_tools.format.kernels import Kernels, NumpyKernels
from checkpoint_tools.format.layout import CODEC_PLANES, CODEC_SHUFFLE_ZSTD
from fsdpx.ops._loader import load_ops
from fsdpx.ops.shuffle import NativeKernels, native_available


def _kernels() -> list[Kernels]:
    out: list[Kernels] = [NumpyKernels()]
    if load_ops().available and native_available():
        out.append(NativeKernels())
    return out


def _sampled_wrong(n: int) -> np.ndarray:
    """fp32 elements: plane 2 all zero (compresses), plane 3 random except that the four
    sampled segments hold the same 1024 random bytes. The sample (the four back to back)
    compresses; the whole plane does not (the repeats are too far apart for level 1's
    small table), so plane 3 is stored raw after a zstd attempt, in a codec-2 frame."""
    rows = np.frombuffer(bytearray(random.Random(1).randbytes(4 * n)), dtype=np.uint8)
    rows = rows.copy().reshape(n, 4)
    rows[:, 2] = 0
    seg = np.frombuffer(random.Random(2).randbytes(codec.SAMPLE_ELEMENTS), dtype=np.uint8)
    for a in np.linspace(0, n - codec.SAMPLE_ELEMENTS, codec.SAMPLE_SEGMENTS).astype(np.int64):
        rows[a : a + codec.SAMPLE_ELEMENTS, 3] = seg
    return rows.reshape(-1)


def _chunks() -> dict[str, tuple[np.ndarray, int]]:
    rnd = np.random.default_rng(0)
    w = (rnd.standard_normal(50_001) * 1e-2).astype(np.float32)
    return {
        "sampled_wrong": (_sampled_wrong(40_000), 4),
        "u8_runs": (np.repeat(np.arange(97, dtype=np.uint8), 301), 1),
        "all_planes": (np.full(30_001, 0.5, dtype=np.float64).view(np.uint8).copy(), 8),
        "fp32_odd": (w.view(np.uint8).copy(), 4),
        "bf16_tail": (w[:4_107].view(np.uint8)[: 2 * 4_107].copy(), 2),
    }


@pytest.mark.parametrize("level", [1, 3])
def test_frames_copied_into_the_scratch_buffer_are_the_bytes_written(
    tmp_path: Path, level: int
) -> None:
    zstd = codec.compressors(level)
    for name, (raw, size) in _chunks().items():
        stored = []
        for kernels in _kernels():
            scratch = np.full(len(raw), 0xAB, dtype=np.uint8)
            enc = codec.encode(raw, size, zstd, kernels, scratch)
            frame = b"".join(bytes(p) for p in enc.parts)  # after the whole chunk's encode
            assert len(frame) == enc.size and enc.crc == zlib.crc32(frame), (name, kernels.name)
            dst, planes = np.empty_like(raw), np.empty_like(raw)
            codec.decode_into(
                memoryview(frame), enc.codec, size, dst, planes, kernels=NumpyKernels(),
                expected_crc=enc.crc, path=tmp_path, tensor=name, offset=0,
            )  # fmt: skip
            assert np.array_equal(dst, raw), (name, kernels.name)
            stored.append((enc.codec, frame))
        assert all(s == stored[0] for s in stored), name  # same bytes with either kernels
        codec_used, frame = stored[0]
        assert codec_used == (CODEC_SHUFFLE_ZSTD if size == 1 else CODEC_PLANES), name
        if name == "sampled_wrong" and level == 1:
            n = len(raw) // 4
            assert codec.worth_compressing(raw, 4, zstd.planes) == [False, False, True, True]
            sizes = struct.unpack_from("<4I", frame)
            assert sizes[2] < n and sizes[3] == n  # tried, then stored raw after all
