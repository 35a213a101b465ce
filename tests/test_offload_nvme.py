"""fsdpx.offload.nvme: NvmeStore streaming, file life cycle, and its error messages."""

from __future__ import annotations

import errno
import gc
import json
import os
import pickle
import random
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from fsdpx.offload import nvme
from fsdpx.offload.nvme import (
    BufferSet,
    NvmeOffloadError,
    NvmeOffloadIOError,
    NvmeStore,
    check_nvme_path,
)
from tests.cuda_host import page_locked

REPO = Path(__file__).resolve().parent.parent
KIB = 1024


def make(path: Path, **kw: Any) -> NvmeStore:
    """A store with small defaults: 3 regions, chunk_numel 2048 (3 sets x 2048 x 12 bytes)."""
    args: dict[str, Any] = dict(
        rank=0, numel=10_000, regions=3, buffer_bytes=3 * 2048 * 12, extra_dtypes={}
    )
    args.update(kw)
    return NvmeStore(path, pin_memory=False, **args)


def swap_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def write_regions(store: NvmeStore, values: list[torch.Tensor]) -> None:
    for r, v in enumerate(values):
        view = store.view(r)
        view.copy_(v)
        del view
    store.flush()


def read_regions(store: NvmeStore) -> list[torch.Tensor]:
    return [store.view(r).clone() for r in range(store.regions)]


# -- correctness --------------------------------------------------------------------------


@pytest.mark.parametrize("sets", [2, 3, 4])
def test_stream_equals_whole_array_update(tmp_path: Path, sets: int) -> None:
    numel = 10_000  # not a multiple of chunk_numel (2048): the last chunk is short
    gen = torch.Generator().manual_seed(0)
    ref = [torch.randn(numel, generator=gen) for _ in range(3)]
    with make(
        tmp_path,
        numel=numel,
        sets=sets,
        buffer_bytes=sets * 2048 * 14,
        extra_dtypes={"out": torch.bfloat16},
    ) as store:
        assert (store.chunk_numel, store.num_chunks) == (2048, 5)
        assert store.host_bytes == sets * 2048 * 14
        write_regions(store, ref)
        seen: list[tuple[int, int]] = []
        outs = torch.empty(numel, dtype=torch.bfloat16)

        def update(c: int, n: int, bufs: BufferSet) -> None:
            seen.append((c, n))
            m, g, v = bufs.regions
            assert all(b.data_ptr() % 4096 == 0 for b in bufs.regions)
            m[:n] += 0.5 * g[:n]
            v[:n] = m[:n] * g[:n]
            bufs.extra["out"][:n] = m[:n]
            outs[c * 2048 : c * 2048 + n] = bufs.extra["out"][:n]

        store.stream(range(store.num_chunks), update)
        assert seen == [(0, 2048), (1, 2048), (2, 2048), (3, 2048), (4, 10_000 - 4 * 2048)]
        ref[0] += 0.5 * ref[1]
        ref[2] = ref[0] * ref[1]
        for got, want in zip(read_regions(store), ref, strict=True):
            assert torch.equal(got, want)
        assert torch.equal(outs, ref[0].to(torch.bfloat16))


@pytest.mark.parametrize("sets", [2, 3])
def test_stream_repeated_and_reordered_chunks(tmp_path: Path, sets: int) -> None:
    # A chunk listed twice must see its first update (read-after-write through the pipeline).
    order = [0, 0, 3, 1, 0, 3, 2, 4, 4]
    with make(tmp_path, sets=sets, buffer_bytes=sets * 2048 * 12) as store:
        for r in range(3):
            store.fill(r, 0.0)

        def update(c: int, n: int, bufs: BufferSet) -> None:
            bufs.regions[1][:n] += 1

        store.stream(order, update)
        want = torch.zeros(10_000)
        for c in order:
            want[c * 2048 : (c + 1) * 2048] += 1
        assert torch.equal(store.view(1), want)
        assert torch.equal(store.view(0), torch.zeros(10_000))


class _LazyWrites:
    """A pool whose writes happen only when waited for: the slowest legal disk. A read that
    the store does not order after the write of the same chunk then sees stale data."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def read(self, path: Any, t: torch.Tensor, offset: int) -> Any:
        return self.pool.read(path, t, offset)

    def write(self, path: Any, t: torch.Tensor, offset: int) -> Any:
        pool = self.pool

        class Lazy:
            def wait(self) -> int:
                return int(pool.write(path, t, offset).wait())

        return Lazy()

    def wait_all(self) -> None:
        self.pool.wait_all()


def test_stream_random_orders_match_sequential_model(tmp_path: Path) -> None:
    # Random chunk lists (repeats included), set counts and read/write flags against a plain
    # sequential model: any read-ahead or write-behind hazard shows up as a difference.
    rng = random.Random(0)
    numel = 7 * 1024 + 300
    for case in range(24):
        sets = rng.choice([2, 3, 4, 5])
        read, write = rng.choice([(True, True), (True, False), (False, True)])
        order = [rng.randrange(8) for _ in range(rng.randrange(1, 20))]
        with make(tmp_path, numel=numel, regions=2, sets=sets, buffer_bytes=sets * 1024 * 8) as st:
            model = [torch.randn(numel), torch.randn(numel)]
            write_regions(st, model)
            if case % 2:
                st._pool = _LazyWrites(st._pool)  # type: ignore[assignment]
            for bs in st._sets:  # read=False must not depend on what the buffers held
                for t in bs.regions:
                    t.fill_(float("nan"))
            k = case + 1

            def update(c: int, n: int, bufs: BufferSet, k: int = k, read: bool = read) -> None:
                a, b = bufs.regions
                if not read:
                    a[:n] = k
                    b[:n] = c
                else:
                    a[:n] = a[:n] * 0.5 + b[:n] + k
                    b[:n] -= 1

            st.stream(order, update, read=read, write=write)
            for c in order if write else []:
                lo, hi = c * 1024, min(numel, (c + 1) * 1024)
                ma, mb = model[0][lo:hi], model[1][lo:hi]
                if not read:
                    ma.fill_(k)
                    mb.fill_(c)
                else:
                    ma.copy_(ma * 0.5 + mb + k)
                    mb.sub_(1)
            got = read_regions(st)
            assert torch.equal(got[0], model[0]) and torch.equal(got[1], model[1]), (
                f"case {case}: sets={sets} read={read} write={write} order={order}"
            )


class _Recorder:
    """Wraps the store's AioPool to log submissions and waits in one sequence."""

    def __init__(self, pool: Any, store: NvmeStore, log: list[str]) -> None:
        self.pool, self.store, self.log = pool, store, log

    def _chunk(self, offset: int) -> int:
        return (
            offset // 4 % (self.store.num_chunks * self.store.chunk_numel) // self.store.chunk_numel
        )

    def _wrap(self, kind: str, handle: Any, offset: int) -> Any:
        log, name = self.log, f"{kind}{self._chunk(offset)}"
        log.append(f"submit {name}")
        real_wait = handle.wait

        def wait() -> int:
            log.append(f"wait {name}")
            return real_wait()

        handle.wait = wait
        return handle

    def read(self, path: Any, t: torch.Tensor, offset: int) -> Any:
        return self._wrap("read", self.pool.read(path, t, offset), offset)

    def write(self, path: Any, t: torch.Tensor, offset: int) -> Any:
        return self._wrap("write", self.pool.write(path, t, offset), offset)

    def wait_all(self) -> None:
        self.pool.wait_all()


def _dedup(log: list[str]) -> list[str]:
    """One entry per (event, chunk): the store issues one request per region."""
    out: list[str] = []
    for e in log:
        if e not in out[-3:]:
            out.append(e)
    return out


def test_pipeline_order_three_sets(tmp_path: Path) -> None:
    with make(tmp_path, regions=1, buffer_bytes=3 * 1024 * 4, numel=4 * 1024) as store:
        log: list[str] = []
        store._pool = _Recorder(store._pool, store, log)  # type: ignore[assignment]
        store.stream(range(4), lambda c, n, b: log.append(f"update{c}"))
        # read i+1 is in flight during update i, and write i-1 is only waited for when its
        # set is needed again (for the read of i+2), so it overlaps update i.
        assert _dedup(log) == [
            "submit read0", "submit read1", "wait read0", "update0", "submit write0",
            "submit read2", "wait read1", "update1", "submit write1",
            "wait write0", "submit read3", "wait read2", "update2", "submit write2",
            "wait read3", "update3", "submit write3",
            "wait write1", "wait write2", "wait write3",
        ]  # fmt: skip


def test_pipeline_order_two_sets(tmp_path: Path) -> None:
    with make(tmp_path, regions=1, buffer_bytes=2 * 1024 * 4, numel=3 * 1024, sets=2) as store:
        log: list[str] = []
        store._pool = _Recorder(store._pool, store, log)  # type: ignore[assignment]
        store.stream(range(3), lambda c, n, b: log.append(f"update{c}"))
        assert _dedup(log) == [
            "submit read0", "submit read1", "wait read0", "update0", "submit write0",
            "wait write0", "submit read2", "wait read1", "update1", "submit write1",
            "wait read2", "update2", "submit write2", "wait write1", "wait write2",
        ]  # fmt: skip


def test_fences_called_before_set_reuse_and_at_end(tmp_path: Path) -> None:
    with make(tmp_path, numel=8 * 2048) as store:
        pending: dict[int, int] = {}  # buffer address -> chunk whose fence is outstanding
        fenced: list[int] = []

        def update(c: int, n: int, bufs: BufferSet) -> Any:
            key = bufs.regions[0].data_ptr()
            assert key not in pending, f"set of chunk {pending.get(key)} reused before its fence"
            pending[key] = c

            def fence() -> None:
                fenced.append(c)
                del pending[key]

            return fence

        store.stream(range(8), update, write=False)
        assert sorted(fenced) == list(range(8)) and not pending
        store.stream(range(8), update)
        assert sorted(fenced) == sorted(list(range(8)) * 2) and not pending


def test_write_false_leaves_file_unchanged(tmp_path: Path) -> None:
    with make(tmp_path) as store:
        store.fill(0, 3.0)
        store.stream(range(store.num_chunks), lambda c, n, b: b.regions[0].fill_(-1), write=False)
        assert torch.equal(store.view(0), torch.full((10_000,), 3.0))


def test_read_false_only_writes(tmp_path: Path) -> None:
    with make(tmp_path, regions=1, buffer_bytes=3 * 1024 * 4, numel=3000) as store:
        store.fill(0, 5.0)
        log: list[str] = []
        store._pool = _Recorder(store._pool, store, log)  # type: ignore[assignment]

        def update(c: int, n: int, bufs: BufferSet) -> None:
            bufs.regions[0][:n] = c

        store.stream(range(store.num_chunks), update, read=False)
        assert not [e for e in log if "read" in e]
        assert torch.equal(store.view(0), torch.arange(3000, dtype=torch.float32) // 1024)


def test_fill_and_view_round_trip(tmp_path: Path) -> None:
    with make(tmp_path) as store:
        store.fill(1, 2.5)
        assert torch.equal(store.view(1), torch.full((10_000,), 2.5))
        # view -> stream: writes through the mapping are what stream reads.
        data = torch.arange(10_000, dtype=torch.float32)
        write_regions(store, [data, data * 2, data * 3])
        got = torch.empty(10_000)

        def collect(c: int, n: int, bufs: BufferSet) -> None:
            got[c * 2048 : c * 2048 + n] = bufs.regions[2][:n]
            bufs.regions[0][:n] = -bufs.regions[0][:n]

        store.stream(range(store.num_chunks), collect)
        assert torch.equal(got, data * 3)
        # stream -> view: what stream wrote is what a new mapping shows.
        assert torch.equal(store.view(0), -data)


def test_update_error_propagates_and_store_stays_usable(tmp_path: Path) -> None:
    with make(tmp_path) as store:
        store.fill(0, 1.0)

        def boom(c: int, n: int, bufs: BufferSet) -> None:
            if c == 2:
                raise RuntimeError("update failed")
            bufs.regions[0][:n] += 1

        with pytest.raises(RuntimeError, match="update failed"):
            store.stream(range(store.num_chunks), boom)
        store.stream(range(store.num_chunks), lambda c, n, b: b.regions[0][:n].mul_(10))
        want = torch.full((10_000,), 10.0)
        want[: 2 * 2048] = 20.0
        assert torch.equal(store.view(0), want)


# -- file life cycle ----------------------------------------------------------------------


def test_file_size_sidecar_and_close(tmp_path: Path) -> None:
    store = make(tmp_path, rank=3)
    assert store.path == tmp_path.resolve() / "fsdpx-offload-rank3.swap"
    assert swap_files(tmp_path) == ["fsdpx-offload-rank3.swap", "fsdpx-offload-rank3.swap.meta"]
    assert store.file_bytes == 3 * 5 * 2048 * 4 == store.path.stat().st_size
    assert store.path.stat().st_blocks * 512 >= store.file_bytes  # preallocated, not sparse
    meta = msgpack.unpackb(Path(str(store.path) + ".meta").read_bytes())
    assert meta == {
        "format": nvme.FORMAT_VERSION, "numel": 10_000, "regions": 3,
        "chunk_numel": 2048, "file_bytes": store.file_bytes,
    }  # fmt: skip
    assert not store.reused
    store.close()
    assert swap_files(tmp_path) == []
    store.close()  # idempotent
    with pytest.raises(ValueError, match="is closed; create a new store"):
        store.stream([0], lambda c, n, b: None)


def test_garbage_collection_removes_files(tmp_path: Path) -> None:
    store = make(tmp_path)
    assert swap_files(tmp_path)
    del store
    gc.collect()
    assert swap_files(tmp_path) == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_does_not_remove_parent_files(tmp_path: Path) -> None:
    with make(tmp_path) as store:
        store.fill(0, 1.0)
        pid = os.fork()
        if pid == 0:  # child: what its atexit finalizer would do
            store.close()
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert len(swap_files(tmp_path)) == 2
        store.fill(0, 2.0)  # lock and I/O threads still work in the parent
        with pytest.raises(NvmeOffloadError, match="in use by"):
            make(tmp_path)
        assert torch.equal(store.view(0), torch.full((10_000,), 2.0))
    assert swap_files(tmp_path) == []


def test_reuse_after_validation(tmp_path: Path) -> None:
    store = make(tmp_path)
    data = torch.randn(10_000)
    write_regions(store, [data, data + 1, data + 2])
    store.close(remove=False)
    store = make(tmp_path)
    assert store.reused
    assert torch.equal(store.view(2), data + 2)
    store.close()


@pytest.mark.parametrize(
    "mismatch", ["numel", "chunk_numel", "format", "corrupt", "missing", "file_size", "regions"]
)
def test_recreate_on_mismatch(tmp_path: Path, mismatch: str) -> None:
    store = make(tmp_path)
    store.fill(0, 7.0)
    store.close(remove=False)
    meta_path = tmp_path / "fsdpx-offload-rank0.swap.meta"
    swap_path = tmp_path / "fsdpx-offload-rank0.swap"
    kw: dict[str, Any] = {}
    if mismatch == "numel":
        kw = {"numel": 9_000}
    elif mismatch == "chunk_numel":
        kw = {"buffer_bytes": 3 * 1024 * 12}
    elif mismatch == "regions":
        kw = {"regions": 2}
    elif mismatch == "format":
        meta = msgpack.unpackb(meta_path.read_bytes())
        meta_path.write_bytes(msgpack.packb({**meta, "format": 0}))
    elif mismatch == "corrupt":
        meta_path.write_bytes(b"\xc1garbage")
    elif mismatch == "missing":
        meta_path.unlink()
    elif mismatch == "file_size":
        os.truncate(swap_path, 4096)
    store = make(tmp_path, **kw)
    assert not store.reused
    assert store.path.stat().st_size == store.file_bytes
    assert msgpack.unpackb(meta_path.read_bytes())["numel"] == store.numel
    assert not torch.equal(store.view(0)[:100], torch.full((100,), 7.0))  # contents dropped
    store.close()


def test_second_store_same_file_is_refused(tmp_path: Path) -> None:
    with make(tmp_path):
        with pytest.raises(NvmeOffloadError, match=r"fsdpx-offload-rank0\.swap' is in use by"):
            make(tmp_path)
        with make(tmp_path, rank=1):  # another rank's file is fine
            pass
        assert swap_files(tmp_path) == ["fsdpx-offload-rank0.swap", "fsdpx-offload-rank0.swap.meta"]


_HOLDER = """
import sys, torch
from fsdpx.offload.nvme import NvmeStore
s = NvmeStore(sys.argv[1], rank=0, numel=10_000, regions=3, buffer_bytes=3 * 2048 * 12,
              extra_dtypes={}, pin_memory=False)
s.fill(1, 4.0)
print("ready", flush=True)
sys.stdin.read()
"""


def test_other_process_lock_then_reuse_after_kill_9(tmp_path: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        with pytest.raises(NvmeOffloadError, match="in use by another process or engine"):
            make(tmp_path)
    finally:
        child.kill()  # SIGKILL: no cleanup runs, the files stay behind
        child.wait()
    with make(tmp_path) as store:  # the lock died with the process; the layout validates
        assert store.reused
        assert torch.equal(store.view(1), torch.full((10_000,), 4.0))


# -- errors -------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(NvmeOffloadError, match=r"nvme_path '.*nope' does not exist; create it"):
        make(tmp_path / "nope")


def test_path_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(NvmeOffloadError, match="is not a directory"):
        check_nvme_path(tmp_path / "f", 0)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_not_writable_chmod(tmp_path: Path) -> None:
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.raises(NvmeOffloadError, match="is not writable by this process"):
            make(d)
    finally:
        d.chmod(0o700)


def test_not_writable_access(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Same check as above, also under root (which the chmod test must skip).
    real = os.access
    monkeypatch.setattr(
        os, "access", lambda p, m, **kw: False if Path(p) == tmp_path else real(p, m, **kw)
    )
    with pytest.raises(NvmeOffloadError, match=r"is not writable by this process \(uid \d+\); fix"):
        make(tmp_path)
    assert swap_files(tmp_path) == []


def test_not_enough_space_before_allocating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.statvfs

    def small(p: Any) -> Any:
        st = real(p)

        class Fake:
            f_frsize = 4096
            f_bavail = 10  # 40960 bytes free
            f_blocks = st.f_blocks

        return Fake()

    monkeypatch.setattr(os, "statvfs", small)
    with pytest.raises(
        NvmeOffloadError,
        match=r"needs 122880 bytes \(0\.1 MiB\) but only 40960 bytes \(0\.0 MiB\) are free",
    ):
        make(tmp_path)
    assert swap_files(tmp_path) == []  # nothing was created


def test_fallocate_failure_and_unsupported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def enospc(fd: int, off: int, n: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", enospc)
    with pytest.raises(NvmeOffloadError, match=r"could not reserve 122880 bytes .*errno 28"):
        make(tmp_path)
    assert swap_files(tmp_path) == []

    def unsupported(fd: int, off: int, n: int) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    with make(tmp_path) as store:  # falls back to ftruncate: right size, works
        assert store.path.stat().st_size == store.file_bytes
        store.fill(2, 1.0)
        assert torch.equal(store.view(2), torch.ones(10_000))


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"buffer_bytes=1000 is too small: 3 buffer sets .* need "
        r"36864 bytes; raise offload buffer_mb to at least 1",
    ):
        make(tmp_path, buffer_bytes=1000)
    with pytest.raises(ValueError, match="sets must be an int >= 2, got 1"):
        make(tmp_path, sets=1)
    with pytest.raises(ValueError, match="numel must be an int >= 0"):
        make(tmp_path, numel=-1)
    with make(tmp_path) as store:
        with pytest.raises(ValueError, match=r"chunk indices must be ints in \[0, 5\), got 5"):
            store.stream([5], lambda c, n, b: None)
        with pytest.raises(ValueError, match=r"region must be an int in \[0, 3\), got 3"):
            store.view(3)
    assert swap_files(tmp_path) == []


def test_empty_store(tmp_path: Path) -> None:
    with make(tmp_path, numel=0) as store:
        assert store.num_chunks == 0 and store.file_bytes == 0
        store.stream(range(0), lambda c, n, b: None)
        store.fill(0, 1.0)
        assert store.view(0).numel() == 0


def test_no_o_direct_warns_once_and_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # tmpfs before Linux 6.6 has no O_DIRECT; where /dev/shm has it, the probe is forced.
    base = tmp_path
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        base = Path(tempfile.mkdtemp(dir=shm))
        (base / "probe").write_bytes(bytes(4096))
        if nvme._probe_o_direct(base / "probe"):
            monkeypatch.setattr(nvme, "_probe_o_direct", lambda p: False)
        (base / "probe").unlink()
    else:
        monkeypatch.setattr(nvme, "_probe_o_direct", lambda p: False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with make(base) as store:
                assert not store.o_direct
                store.fill(0, 1.0)
                store.stream(range(store.num_chunks), lambda c, n, b: b.regions[0][:n].add_(1))
                assert torch.equal(store.view(0), torch.full((10_000,), 2.0))
        msgs = [str(w.message) for w in caught]
        assert len(msgs) == 1, msgs
        assert "does not support O_DIRECT" in msgs[0] and "buffered I/O" in msgs[0]
    finally:
        if base != tmp_path:
            for p in base.iterdir():
                p.unlink()
            base.rmdir()


def test_o_direct_on_real_disk(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    probe.write_bytes(bytes(4096))
    if not nvme._probe_o_direct(probe):
        pytest.skip(f"the file system of {tmp_path} has no O_DIRECT")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with make(tmp_path) as store:
            assert store.o_direct


_DISK_FULL = """
import json, resource, signal, sys
from fsdpx.offload.nvme import NvmeOffloadIOError, NvmeStore
s = NvmeStore(sys.argv[1], rank=0, numel=100_000, regions=3, buffer_bytes=3 * 8192 * 12,
              extra_dtypes={}, pin_memory=False)
s.fill(0, 1.0)
# Writes at offsets past the limit fail with EFBIG (SIGXFSZ ignored): the same code path as
# ENOSPC on a full disk. Only this child process is limited.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (6 * 32768, resource.RLIM_INFINITY))
try:
    s.stream(range(s.num_chunks), lambda c, n, b: b.regions[0][:n].add_(1))
except NvmeOffloadIOError as e:
    print(json.dumps({"errno": e.errno, "filename": e.filename, "offset": e.offset,
                      "message": str(e), "isoserror": isinstance(e, OSError)}))
s.close()
"""


def test_disk_full_during_stream(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _DISK_FULL, str(tmp_path)],
        capture_output=True, cwd=REPO, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    err = json.loads(out.stdout)
    assert err["errno"] == errno.EFBIG and err["isoserror"]
    swap = str(tmp_path.resolve() / "fsdpx-offload-rank0.swap")
    assert err["filename"] == swap
    assert err["offset"] >= 6 * 32768 and err["offset"] % 4096 == 0
    assert f"writing 32768 bytes at offset {err['offset']} of '{swap}' failed: " in err["message"]
    assert f"(errno {errno.EFBIG}); the disk (or a file-size limit) is full" in err["message"]
    assert swap_files(tmp_path) == []  # close() still cleaned up


def test_io_error_pickles() -> None:
    e = NvmeOffloadIOError("writing failed", errno.ENOSPC, "/x.swap", 4096)
    f = pickle.loads(pickle.dumps(e))
    assert (str(f), f.errno, f.filename, f.offset) == ("writing failed", 28, "/x.swap", 4096)


# -- memory bound -------------------------------------------------------------------------


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * KIB
    raise AssertionError("no VmRSS in /proc/self/status")


RSS_SLACK = 8 << 20
"""Allowance on top of buffer_bytes: allocator pages for the update's temporaries, pipeline
bookkeeping, /proc reads. Not proportional to numel (the state is 24x buffer_bytes here)."""


def _rss_update(peak: list[int]) -> Any:
    def update(c: int, n: int, bufs: BufferSet) -> None:
        m, g, v = bufs.regions
        m[:n] += 1
        g[:n] = m[:n]
        v[:n] = 2 * m[:n]
        peak[0] = max(peak[0], _rss_bytes())

    return update


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_rss_bounded_by_buffer_bytes(tmp_path: Path) -> None:
    # 3 regions x 64 MiB of state (24x buffer_bytes), on the real disk under tmp_path: tmpfs
    # pages would not show in this process's RSS anyway, and O_DIRECT skips the page cache.
    numel, buffer_bytes = 16 << 20, 8 << 20
    # Warm-up with a small store: loading the native library, starting the I/O and OpenMP
    # threads and the allocator's first arenas are one-time costs, not the swapper's memory.
    with make(tmp_path, numel=1 << 20, buffer_bytes=buffer_bytes) as small:
        small.stream(range(small.num_chunks), _rss_update([0]))
    gc.collect()
    base = _rss_bytes()
    peak = [base]
    with make(tmp_path, numel=numel, buffer_bytes=buffer_bytes) as store:
        assert store.host_bytes <= buffer_bytes
        store.fill(0, 1.0)
        store.stream(range(store.num_chunks), _rss_update(peak))
        store.stream(range(store.num_chunks), _rss_update(peak))
        peak[0] = max(peak[0], _rss_bytes())
        checked = store.view(2)[:: 1 << 16].clone()  # a sparse check keeps RSS low
    assert torch.equal(checked, torch.full_like(checked, 6.0))
    growth = peak[0] - base
    print(f"RSS growth {growth / 2**20:.1f} MiB (buffers {store.host_bytes / 2**20:.1f} MiB)")
    assert growth <= buffer_bytes + RSS_SLACK, (
        f"RSS grew by {growth / 2**20:.1f} MiB streaming {3 * numel * 4 / 2**20:.0f} MiB of "
        f"state through {buffer_bytes / 2**20:.0f} MiB of buffers (+{RSS_SLACK >> 20} MiB slack)"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_buffers_with_gpu_copy_fence(tmp_path: Path) -> None:
    # The lead's pattern: update writes a 16-bit copy into bufs.extra, starts a non-blocking
    # host-to-device copy and returns a fence that waits for it before the set is reused.
    numel = 5 * 2048 + 7
    out = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
    with NvmeStore(
        tmp_path, rank=0, numel=numel, regions=3, buffer_bytes=3 * 2048 * 14,
        extra_dtypes={"p16": torch.bfloat16}, pin_memory=True,
    ) as store:  # fmt: skip
        # page_lock_ registers the buffers with CUDA (torch's is_pinned() only knows its own
        # allocator's blocks).
        for s in store._sets:
            assert page_locked(s.regions[0])
        data = torch.randn(numel)
        write_regions(store, [data, data, data])
        stream = torch.cuda.Stream()

        def update(c: int, n: int, bufs: BufferSet) -> Any:
            m = bufs.regions[0][:n]
            m.mul_(2)
            bufs.extra["p16"][:n] = m
            with torch.cuda.stream(stream):
                out[c * 2048 : c * 2048 + n].copy_(bufs.extra["p16"][:n], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            return event.synchronize

        store.stream(range(store.num_chunks), update)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), (data * 2).to(torch.bfloat16))
        assert torch.equal(store.view(0), data * 2)
