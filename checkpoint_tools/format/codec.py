"""One chunk's bytes <-> its stored frame (FORMAT.md §3): raw, shuffle+zstd, byte planes.

[Note: byte shuffle] Tensor bytes are regrouped by byte position within the element
(all first bytes, then all second bytes, ...) before zstd. Exponent and high mantissa
bytes of neighbouring weights are similar, so the shuffled planes compress much better
than interleaved bytes (~17% smaller fp32, ~31% bf16 at zstd level 1).

[Note: byte-plane coding] After the shuffle the planes differ: for trained-like fp32
weights and Adam moments the sign/exponent plane compresses to ~0.37 at zstd level 1,
the three lower planes to 1.00 (measured, benchmarks/checkpoint.py's model); for bf16 the
exponent plane is half the data. Running zstd over incompressible planes costs most of
the compression time and buys nothing, so codec 2 (format 1.1) decides per chunk and per
plane: a sample of each plane (4 x 1024 elements, spread over the chunk, taken from the
unshuffled bytes) is compressed, and only planes whose sample shrinks below 80% are
compressed whole; the others are stored raw (no codec call at all, and their CRC comes
out of the shuffle pass). A chunk where no plane is worth it is stored raw without
shuffling. The decision depends only on the data, never on the kernels, so every writer
of the same bytes writes the same file. Why 80%: a compressed plane costs the same CPU
whatever it saves, and zstd costs several times what writing the bytes it saves would
(~1.4 against ~0.3 ns per byte on one core, the profile). The exponent planes save
60-70%; the one plane measured between 80% and 90% is bf16 exp_avg_sq's low byte
(exponent bit and mantissa: 0.875), where a 90% bar spent a quarter of a bf16 save's
zstd time on 2% of its bytes (benchmarks/checkpoint_profile.py).

[Note: plane compressor] What zstd sees in a compressed plane is a sign/exponent byte
stream with few distinct values and few long repeats: nearly all of its output is
Huffman-coded literals. At level 1 most of the time went to the match finder's hash
table (2^14 entries for a 1 MiB plane: a cache miss per position) for matches that
barely exist. Byte planes are therefore compressed at level 1 with the smallest table
zstd allows (hash_log 6), measured on the benchmark model's AdamW state (4 MiB chunks,
the compressed planes of weights, exp_avg and exp_avg_sq, one core): fp32 0.338 -> 0.351
of the planes' bytes at 290 -> 700 MB/s, bf16 0.471 -> 0.482 at 350 -> 750 MB/s; that is
zstd's own literal-only speed (level -50 with literal compression forced on: 0.357 at
610 MB/s). Negative levels are no alternative: they also turn off literal compression
(level -1: 0.62 instead of 0.34). Other planes lose nothing measurable: whole chunks of
int64 arange, int32 token ids, 90%-zero fp32 and fp16 weights stored the same or smaller.
What the small table gives up are long repeats: Adam moments after one step on a batch of
2 (the benchmark's state) are a rank-2 outer product, so their exponent planes repeat
row by row, which level 1's table finds (exponent plane 0.10 at 2M parameters, width
408) and this one does not (0.38). On that state a whole save stores 0.798 -> 0.841 of
the raw bytes at 2M parameters, 0.813 -> 0.843 at 10M, 0.830 -> 0.840 at 20M, unchanged
(0.838 of DCP) at 100M; after 10 steps on batches of 64 (10M) the gap is 0.828 -> 0.833,
and weights' planes come out smaller (0.368 -> 0.340: fewer short matches interrupting
the Huffman-coded literals). One-byte elements (codec 1: the chunk itself, which may
well hold long repeats) and levels other than 1 (asked for explicitly, for their ratio)
get zstd's own parameters.

[Note: checksum choice] CRC-32 (zlib's polynomial) over the *stored* bytes, so `verify`
never has to decompress. It detects accidental damage (bit rot, truncation, torn writes);
it is not a defence against a deliberate attacker, which is why every size is also
bounds-checked before use. Writing codec 2, the frame's CRC is combined from the CRCs of
its parts (`crc32_combine`), so raw planes are checksummed in the pass that shuffles
them. Reading, the whole frame is checked first (it must be, before any zstd plane is
decompressed; the native CRC runs at ~20 GB/s, measured in benchmarks/checkpoint_codec.py),
then the zstd planes are decompressed and all planes unshuffled in one pass.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zstandard

from checkpoint_tools.format.errors import CheckpointCorruptError
from checkpoint_tools.format.kernels import Buffer, Kernels
from checkpoint_tools.format.layout import CODEC_PLANES, CODEC_RAW, CODEC_SHUFFLE_ZSTD

_ZSTD_UNKNOWN = zstandard.CONTENTSIZE_UNKNOWN
SAMPLE_SEGMENTS = 4
SAMPLE_ELEMENTS = 1024  # per segment
WORTH_RATIO = 0.8  # compress a plane only when its sample shrinks below this


PLANE_HASH_LOG = 6  # [Note: plane compressor]


@dataclass(frozen=True)
class Compressors:
    """One thread's zstd contexts (a ZstdCompressor must not be used by two threads at
    once): `planes` for byte planes of elements of 2 bytes or more, `whole` for chunks of
    one-byte elements ([Note: plane compressor])."""

    planes: zstandard.ZstdCompressor
    whole: zstandard.ZstdCompressor


def compressors(level: int) -> Compressors:
    """Fresh contexts for zstd `level` (no zstd checksum: the chunk CRC covers the frame;
    the content size is always declared, FORMAT.md §3.1)."""
    whole = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
    if level != 1:
        return Compressors(whole, whole)
    params = zstandard.ZstdCompressionParameters.from_level(
        level, hash_log=PLANE_HASH_LOG, write_content_size=True, write_checksum=False
    )
    return Compressors(zstandard.ZstdCompressor(compression_params=params), whole)


@dataclass(frozen=True)
class Encoded:
    """One stored frame: its codec, its bytes as parts written back to back, their total
    size and the CRC-32 of their concatenation. Parts may be views of the input chunk or
    of the scratch buffer passed to `encode`: write them before either changes."""

    codec: int
    parts: list[bytes | memoryview]
    size: int
    crc: int


def _raw(raw: np.ndarray, kernels: Kernels) -> Encoded:
    return Encoded(CODEC_RAW, [raw.data], len(raw), kernels.crc32(raw.data))


def worth_compressing(raw: np.ndarray, size: int, cctx: zstandard.ZstdCompressor) -> list[bool]:
    """Per byte plane: does a sample of it shrink below WORTH_RATIO under `cctx`?"""
    n = len(raw) // size
    rows = raw.reshape(n, size)
    seg = SAMPLE_ELEMENTS
    if n > SAMPLE_SEGMENTS * seg:
        starts = np.linspace(0, n - seg, SAMPLE_SEGMENTS).astype(np.int64)
        rows = np.concatenate([rows[a : a + seg] for a in starts])
    out = []
    for k in range(size):
        sample = np.ascontiguousarray(rows[:, k])
        out.append(len(cctx.compress(sample.data)) < WORTH_RATIO * len(sample))
    return out


def _keep(frame: bytes, space: np.ndarray) -> np.ndarray:
    """`frame` copied to the start of `space` (writable, at least as long). Why: zstd
    returns read-only `bytes`, which the native CRC cannot take without a copy (torch
    refuses read-only buffers), so zlib's CRC ran on every frame at a fifth of the native
    speed; a copy of the frame while it is in cache and the native CRC cost less. The
    writer writes the copy, so the `bytes` are freed at once."""
    stored = space[: len(frame)]
    stored[...] = np.frombuffer(frame, dtype=np.uint8)
    return stored


def encode(
    raw: np.ndarray,
    size: int,
    zstd: Compressors | None,
    kernels: Kernels,
    scratch: np.ndarray,
) -> Encoded:
    """Encode one chunk (uint8, a whole number of `size`-byte elements). `zstd` None means
    compression "none" (always raw); `scratch` holds the shuffled planes (len(raw) bytes).
    Falls back to raw when coding does not make the chunk smaller."""
    if zstd is None or len(raw) == 0:
        return _raw(raw, kernels)
    cctx = zstd.whole if size == 1 else zstd.planes
    worth = worth_compressing(raw, size, cctx)
    if not any(worth):
        return _raw(raw, kernels)
    if size == 1:  # one plane: the data itself (codec 1; its shuffle is the identity)
        frame = cctx.compress(raw.data)
        if len(frame) < len(raw):
            stored = _keep(frame, scratch)
            return Encoded(CODEC_SHUFFLE_ZSTD, [stored.data], len(frame), kernels.crc32(stored))
        return _raw(raw, kernels)
    n = len(raw) // size
    plane_crcs = kernels.shuffle_crc(raw, size, scratch, [not w for w in worth])
    parts: list[bytes | memoryview] = []
    crcs: list[int] = []
    for k in range(size):
        plane = scratch[k * n : (k + 1) * n]
        if worth[k]:
            frame = cctx.compress(plane.data)
            if len(frame) < n:
                stored = _keep(frame, plane)  # the raw plane is not needed any more
                parts.append(stored.data)
                crcs.append(kernels.crc32(stored))
                continue
            plane_crcs[k] = kernels.crc32(plane.data)  # sampled wrong: stored raw after all
        parts.append(plane.data)
        crcs.append(plane_crcs[k])
    header = struct.pack(f"<{size}I", *(len(p) for p in parts))
    total = len(header) + sum(len(p) for p in parts)
    if total >= len(raw):
        return _raw(raw, kernels)
    crc = kernels.crc32(header)
    for part, part_crc in zip(parts, crcs, strict=True):
        crc = kernels.crc32_combine(crc, part_crc, len(part))
    return Encoded(CODEC_PLANES, [header, *parts], total, crc)


def decode_into(
    stored: memoryview,
    codec: int,
    size: int,
    dst: np.ndarray,
    planes: np.ndarray,
    *,
    kernels: Kernels,
    expected_crc: int | None,
    path: Path,
    tensor: str,
    offset: int,
) -> None:
    """Decode one stored frame into `dst`, whose length is the raw size the index
    declares; `planes` is scratch space of the same length. With `expected_crc` the frame
    is checked first; None means the caller already checked it.
    A zstd frame must declare exactly its expected content size before anything is
    decompressed, so a frame claiming terabytes is refused up front, and output never
    exceeds `dst`."""

    def corrupt(message: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(message, path=path, tensor=tensor, offset=offset)

    def check(crc: int) -> None:
        if expected_crc is not None and crc != expected_crc:
            raise corrupt(
                f"chunk of {len(stored)} bytes fails its CRC-32 check (expected "
                f"{expected_crc:#010x}): the data file is damaged; verify older checkpoints"
            )

    if codec == CODEC_PLANES:
        _decode_planes(stored, size, dst, planes, kernels, expected_crc, check, corrupt)
        return
    if expected_crc is not None:
        check(kernels.crc32(stored))
    if codec == CODEC_RAW:
        if len(stored) != len(dst):
            raise corrupt(f"raw chunk has {len(stored)} bytes, the index declares {len(dst)}")
        dst[...] = np.frombuffer(stored, dtype=np.uint8)
        return
    if codec != CODEC_SHUFFLE_ZSTD:  # the index schema already refuses other codecs
        raise AssertionError(f"unknown codec {codec}")
    target = dst if size == 1 else planes
    _decompress(stored, target, corrupt)
    if size > 1:
        n = len(dst) // size
        kernels.unshuffle_crc([planes[k * n : (k + 1) * n] for k in range(size)], dst, False)


def _decode_planes(
    stored: memoryview,
    size: int,
    dst: np.ndarray,
    planes: np.ndarray,
    kernels: Kernels,
    expected_crc: int | None,
    check: Callable[[int], None],
    corrupt: Callable[[str], CheckpointCorruptError],
) -> None:
    n = len(dst) // size
    head = 4 * size
    sizes = list(struct.unpack_from(f"<{size}I", stored)) if len(stored) >= head else []
    if len(sizes) != size or any(not 0 < s <= n for s in sizes) or head + sum(sizes) != len(stored):
        if expected_crc is not None:
            check(kernels.crc32(stored))  # damage is reported as damage, not as a bad layout
        raise corrupt(
            f"byte-plane frame of {len(stored)} bytes declares plane sizes {sizes}; expected "
            f"{size} sizes in (0, {n}] that add up to {len(stored) - head}"
        )
    parts, at = [], head
    for s in sizes:
        parts.append(stored[at : at + s])
        at += s
    if expected_crc is not None:
        # The whole frame is checked before any zstd plane is decompressed (FORMAT.md §6).
        # A fused unshuffle+CRC would have to unshuffle the zstd planes before their
        # check; the CRC alone runs at ~20 GB/s natively, so checking first costs little.
        check(kernels.crc32(stored))
    given: list[Buffer | None] = []
    for k, part in enumerate(parts):
        if len(part) == n:
            given.append(part)
            continue
        plane = planes[k * n : (k + 1) * n]
        _decompress(part, plane, corrupt)
        given.append(plane)
    kernels.unshuffle_crc(given, dst, False)  # all planes at once: whole-element stores


_local = threading.local()


def _dctx() -> zstandard.ZstdDecompressor:
    """This thread's decompressor (one may not be used by two threads at once); reused,
    so each plane does not allocate a fresh decompression context."""
    dctx: zstandard.ZstdDecompressor | None = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def _decompress(
    frame: memoryview, target: np.ndarray, corrupt: Callable[[str], CheckpointCorruptError]
) -> None:
    """Decompress one zstd frame into exactly `target`, refusing any other size."""
    try:
        declared = zstandard.get_frame_parameters(frame).content_size
    except zstandard.ZstdError as exc:
        raise corrupt(f"zstd frame header is invalid ({exc})") from None
    if declared == _ZSTD_UNKNOWN or declared != len(target):
        shown = "no size" if declared == _ZSTD_UNKNOWN else f"{declared} bytes"
        raise corrupt(f"zstd frame declares {shown} of content, the index declares {len(target)}")
    got = 0
    try:
        with _dctx().stream_reader(frame, read_size=len(frame)) as r:
            view = target.data
            while got < len(target):
                k = r.readinto(view[got:])
                if k == 0:
                    break
                got += k
            extra = r.read(1)  # reaching the frame end makes zstd check the declared size
    except zstandard.ZstdError as exc:
        raise corrupt(f"zstd frame does not decompress ({exc})") from None
    if got != len(target) or extra:
        held = "more than" if extra else got
        raise corrupt(f"zstd frame holds {held} bytes, the index declares {len(target)}")
