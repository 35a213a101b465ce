"""fsdpx.ops.aio: round trips at odd sizes, offsets and alignments, the O_DIRECT, bounce and
buffered paths, concurrency with back-pressure, and the error messages; native and python
backends alike."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Literal, cast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpx.ops._loader import load_ops
from fsdpx.ops.aio import DIRECT_IO_ALIGNMENT, AioError, AioPool, aligned_empty

A = DIRECT_IO_ALIGNMENT


Backend = Literal["native", "python"]


@pytest.fixture(params=["native", "python"])
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "native" and not load_ops().available:
        pytest.skip(f"native fsdpx ops unavailable: {load_ops().reason}")
    return cast(Backend, request.param)


def _direct_io_supported(directory: Path) -> bool:
    probe = directory / ".odirect-probe"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return True


def _random_bytes(n: int, *, skew: int = 0, seed: int = 0) -> torch.Tensor:
    """n random bytes whose memory starts `skew` bytes after a 4 KiB boundary."""
    g = torch.Generator().manual_seed(seed)
    buf = aligned_empty((n + skew,))[skew:]
    buf.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
    return buf


# Sizes and offsets straddling the 4 KiB O_DIRECT granularity and the 8 KiB chunk size used
# below, so heads, tails, bounce chunks and multi-chunk requests all occur.
CASES = [(1, 0), (4095, 3), (4096, 4096), (3 * 8192 + 5, 4096 - 1), (100_003, 12_288), (0, 7)]


@pytest.mark.parametrize("o_direct", [True, False])
def test_round_trip_odd_sizes_offsets_and_alignment(
    backend: Backend, o_direct: bool, tmp_path: Path
) -> None:
    path = tmp_path / "data.bin"
    with AioPool(
        threads=3, queue_depth=4, o_direct=o_direct, chunk_bytes=8192, backend=backend
    ) as pool:
        for i, (n, offset) in enumerate(CASES):
            for skew in (0, 1, 64):
                src = _random_bytes(n, skew=skew, seed=i)
                assert pool.write(path, src, offset, fsync=i % 2 == 0).wait() == n
                dst = aligned_empty((n + 3,))[3 - (skew % 4) :][:n]  # another misalignment
                assert pool.read(path, dst, offset).wait() == n
                torch.testing.assert_close(dst, src, rtol=0, atol=0)
        assert pool.backend == backend


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(0, 3 * A + 17),
    offset=st.integers(0, 2 * A + 9),
    skew=st.integers(0, 70),
    o_direct=st.booleans(),
)
def test_round_trip_hypothesis(
    tmp_path_factory: pytest.TempPathFactory, n: int, offset: int, skew: int, o_direct: bool
) -> None:
    path = tmp_path_factory.mktemp("aio") / "h.bin"
    backend: Backend = "native" if load_ops().available else "python"
    with AioPool(threads=2, o_direct=o_direct, chunk_bytes=A, backend=backend) as pool:
        src = _random_bytes(n, skew=skew)
        pool.write(path, src, offset).wait()
        dst = torch.empty(n, dtype=torch.uint8)
        pool.read(path, dst, offset).wait()
    assert torch.equal(dst, src)
    assert path.stat().st_size == offset + n or n == 0


def test_dtypes_and_shapes_round_trip(backend: Backend, tmp_path: Path) -> None:
    with AioPool(threads=2, backend=backend) as pool:
        for k, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.int64]):
            src = torch.randn(37, 11).to(dtype)
            pool.write(tmp_path / f"{k}.bin", src).wait()
            dst = torch.empty_like(src)
            pool.read(tmp_path / f"{k}.bin", dst).wait()
            assert torch.equal(dst, src)


def test_o_direct_path_is_used_for_aligned_requests(tmp_path: Path) -> None:
    if not load_ops().available:
        pytest.skip("native fsdpx ops unavailable")
    if not _direct_io_supported(tmp_path):
        pytest.skip(f"{tmp_path} does not support O_DIRECT")
    n = 6 * A
    with AioPool(threads=2, chunk_bytes=2 * A, o_direct=True, backend="native") as pool:
        src = _random_bytes(n)
        pool.write(tmp_path / "d.bin", src, A).wait()
        dst = aligned_empty((n,))
        pool.read(tmp_path / "d.bin", dst, A).wait()
        assert torch.equal(dst, src)
        assert pool.stats() == (2 * n, 0, 0)  # all direct, no bounce, nothing buffered
        # Misaligned memory at an aligned offset: direct I/O through the bounce buffer.
        pool.read(tmp_path / "d.bin", _random_bytes(n, skew=8), A).wait()
        assert pool.stats() == (3 * n, n, 0)
        # Unaligned offset and size: a buffered head, direct middle, buffered tail.
        pool.read(tmp_path / "d.bin", _random_bytes(2 * A + 10), A + 100).wait()
        direct, _, buffered = pool.stats()
        assert (direct - 3 * n, buffered) == (A, A + 10)


def test_buffered_path_when_o_direct_is_off(tmp_path: Path) -> None:
    if not load_ops().available:
        pytest.skip("native fsdpx ops unavailable")
    with AioPool(threads=2, o_direct=False, backend="native") as pool:
        pool.write(tmp_path / "b.bin", _random_bytes(4 * A)).wait()
        assert pool.stats() == (0, 0, 4 * A)
        assert not pool.o_direct


def test_many_concurrent_requests_with_back_pressure(backend: Backend, tmp_path: Path) -> None:
    # 48 requests through a queue of 4: submission blocks and resumes; one shared file at
    # disjoint offsets plus separate files.
    shared = tmp_path / "shared.bin"
    sizes = [(k * 977) % 9000 + 1 for k in range(48)]
    offsets = [sum(sizes[:k]) for k in range(48)]
    srcs = [_random_bytes(s, skew=k % 5, seed=k) for k, s in enumerate(sizes)]
    with AioPool(threads=4, queue_depth=4, chunk_bytes=A, backend=backend) as pool:
        hs = [pool.write(shared, s, o) for s, o in zip(srcs, offsets, strict=True)]
        hs += [pool.write(tmp_path / f"f{k}.bin", s) for k, s in enumerate(srcs[:8])]
        pool.wait_all()
        assert all(h.done() for h in hs)
        dsts = [torch.empty(s, dtype=torch.uint8) for s in sizes]
        rs = [pool.read(shared, d, o) for d, o in zip(dsts, offsets, strict=True)]
        assert [r.wait() for r in rs] == sizes
    for d, s in zip(dsts, srcs, strict=True):
        assert torch.equal(d, s)
    assert shared.stat().st_size == sum(sizes)


def test_write_keeps_the_rest_of_the_file(backend: Backend, tmp_path: Path) -> None:
    path = tmp_path / "keep.bin"
    path.write_bytes(bytes(range(256)) * 64)
    with AioPool(backend=backend) as pool:
        pool.write(path, torch.full((10,), 7, dtype=torch.uint8), 100).wait()
    data = path.read_bytes()
    assert len(data) == 256 * 64 and data[100:110] == bytes([7] * 10)
    assert data[:100] == (bytes(range(256)) * 64)[:100]


def test_missing_path_raises_with_path_and_errno(backend: Backend, tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such.bin"
    with AioPool(backend=backend) as pool:
        h = pool.read(missing, torch.empty(3))
        with pytest.raises(
            AioError,
            match=r"cannot open '.*/no/such\.bin' for reading: No such "
            r"file or directory \(errno 2\)",
        ) as info:
            h.wait()
        assert info.value.errno == errno.ENOENT and info.value.filename == str(missing)
        with pytest.raises(AioError, match="cannot open"):
            h.wait()  # the same error again, not "unknown id"
        w = pool.write(missing, torch.empty(3))
        with pytest.raises(OSError, match=r"for writing: No such file or directory \(errno 2\)"):
            w.wait()


def test_read_past_end_of_file_is_an_error(backend: Backend, tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    with AioPool(backend=backend, chunk_bytes=A) as pool:
        for n, offset in [(101, 0), (10, 95), (3 * A, 0), (1, 100)]:
            with pytest.raises(
                AioError,
                match=rf"read of {n} bytes at offset {offset} from "
                r"'.*short\.bin' runs past the end of the file \(size 100 "
                r"bytes\)",
            ) as info:
                pool.read(path, torch.empty(n, dtype=torch.uint8), offset).wait()
            assert info.value.errno is None


def test_wait_all_and_context_exit_raise_the_first_error(backend: Backend, tmp_path: Path) -> None:
    pool = AioPool(backend=backend)
    ok = pool.write(tmp_path / "ok.bin", torch.ones(4))
    pool.read(tmp_path / "absent.bin", torch.empty(4))
    with pytest.raises(AioError, match="absent.bin"):
        pool.wait_all()
    assert ok.wait() == 16
    pool.close()
    with pytest.raises(AioError, match="absent.bin"), AioPool(backend=backend) as p2:
        p2.read(tmp_path / "absent.bin", torch.empty(4))


def test_bad_arguments_are_value_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="threads must be a positive int, got 0"):
        AioPool(threads=0)
    with pytest.raises(ValueError, match="queue_depth must be a positive int, got -1"):
        AioPool(queue_depth=-1)
    with pytest.raises(ValueError, match="backend must be 'auto', 'native' or 'python', got 'gpu'"):
        AioPool(backend="gpu")  # type: ignore[arg-type]
    with AioPool(backend="python") as pool:
        with pytest.raises(ValueError, match="expected a contiguous tensor"):
            pool.write(tmp_path / "x", torch.ones(4, 4).t())
        with pytest.raises(ValueError, match="expected a CPU tensor, got Tensor on meta"):
            pool.write(tmp_path / "x", torch.ones(4, device="meta"))
        with pytest.raises(ValueError, match="offset must be an int >= 0, got -5"):
            pool.read(tmp_path / "x", torch.ones(4), -5)
    with pytest.raises(ValueError, match="the pool is closed"):
        pool.read(tmp_path / "x", torch.ones(4))


def test_aligned_empty_is_page_aligned() -> None:
    for dtype in (torch.uint8, torch.bfloat16, torch.float32):
        t = aligned_empty((5, 7), dtype=dtype)
        assert t.shape == (5, 7) and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % A == 0


def test_page_lock_without_cuda_says_to_turn_pinning_off() -> None:
    from fsdpx.ops.aio import page_lock_

    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only message")
    with pytest.raises(RuntimeError, match=r"pinning host memory needs a CUDA device"):
        page_lock_(torch.empty(16))
