"""ZeRO-Infinity NVMe store: optimizer state in one swap file per rank, streamed in chunks.

`NvmeStore` keeps ``regions`` fp32 arrays of ``numel`` elements each (the lead's
`OffloadedAdamW` uses three: master params, exp_avg, exp_avg_sq) in a file under
``nvme_path`` and hands them to an update function chunk by chunk through a small, fixed set
of host buffers, so host memory is bounded by ``buffer_bytes`` whatever ``numel`` is.

[Note: pipeline] With ``sets`` buffer sets (default 3) `NvmeStore.stream` reads chunk i+1
while ``update(i)`` runs while chunk i-1 is being written: chunk k always uses set
``k % sets``; before reading into a set, the writes of the chunk that used it last are
waited for and its fence is called. With 2 sets the write of i-1 finishes before the read of
i+1 starts (read-ahead still overlaps the update). A chunk listed twice is read again only
after its first update has been written. ``stream(..., read=False)`` is a write-only pass
(initialisation), ``write=False`` a read-only one (copying masters out).

[Note: file layout] Region r occupies bytes ``[r * padded * 4, (r + 1) * padded * 4)`` with
``padded = num_chunks * chunk_numel``. ``chunk_numel`` is a multiple of 1024 elements
(4096 bytes), so every chunk transfer starts and ends on the O_DIRECT alignment and reads
whole chunks (the padding past ``numel`` is scratch space). A msgpack sidecar
``<swap>.meta`` records the format version and layout; an existing file is reused only when
the sidecar matches and the file has the expected size, anything else is recreated.

Example:
    >>> store = NvmeStore("/mnt/nvme", rank=0, numel=10_000_000, regions=3,
    ...                   buffer_bytes=64 << 20, extra_dtypes={}, pin_memory=False)
    >>> store.fill(1, 0.0); store.fill(2, 0.0)
    >>> def update(c, n, bufs):
    ...     bufs.regions[0][:n] -= 0.1 * bufs.regions[1][:n]
    >>> store.stream(range(store.num_chunks), update)
    >>> store.close()
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import torch
from torch import Tensor

from fsdpx.errors import NvmeOffloadError, NvmeOffloadIOError
from fsdpx.ops.aio import (
    DIRECT_IO_ALIGNMENT,
    AioError,
    AioHandle,
    AioPool,
    aligned_empty,
    page_lock_,
)

__all__ = [
    "FORMAT_VERSION",
    "BufferSet",
    "NvmeOffloadError",
    "NvmeOffloadIOError",
    "NvmeStore",
    "check_nvme_path",
]

FORMAT_VERSION = 1
"""Version of the swap file layout recorded in the sidecar; a mismatch recreates the file."""

_QUANTUM = DIRECT_IO_ALIGNMENT // 4  # fp32 elements per O_DIRECT block
_MAX_SIDECAR_BYTES = 4096
_FP32 = 4


def _human(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.1f} MiB"


def check_nvme_path(nvme_path: str | os.PathLike[str], bytes_needed: int) -> Path:
    """Check that ``nvme_path`` can hold ``bytes_needed`` more bytes of swap files.

    Args:
        nvme_path: the directory (``zero.offload_optimizer.nvme_path``).
        bytes_needed: bytes that will be allocated there (0 to check only the directory).

    Returns:
        The resolved directory.

    Raises:
        NvmeOffloadError: the path does not exist, is not a directory, is not writable, or
            its file system has fewer than ``bytes_needed`` bytes free (both in the message).

    Example:
        >>> check_nvme_path("/mnt/nvme", 3 * 4 * 1_000_000)
        PosixPath('/mnt/nvme')
    """
    path = Path(nvme_path).expanduser()
    if not path.exists():
        raise NvmeOffloadError(
            f"offload nvme_path '{path}' does not exist; create it (mkdir -p '{path}'), "
            "preferably on a local NVMe disk, or point nvme_path at an existing directory"
        )
    if not path.is_dir():
        raise NvmeOffloadError(
            f"offload nvme_path '{path}' is not a directory; nvme_path must be a directory "
            "that will hold one swap file per rank"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise NvmeOffloadError(
            f"offload nvme_path '{path}' is not writable by this process (uid {os.getuid()}); "
            "fix its permissions or choose a directory you can write to"
        )
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if bytes_needed > free:
        raise NvmeOffloadError(
            f"offload nvme_path '{path}' has not enough free space: the optimizer state needs "
            f"{bytes_needed} bytes ({_human(bytes_needed)}) but only {free} bytes "
            f"({_human(free)}) are free; free some space, choose another nvme_path, or "
            "offload to 'cpu'"
        )
    return path.resolve()


@dataclass(frozen=True)
class BufferSet:
    """One set of host buffers: what ``update`` receives for one chunk.

    ``regions[r]`` holds chunk c of region r (fp32, ``chunk_numel`` elements, 4096-byte
    aligned); ``extra[name]`` is scratch of ``chunk_numel`` elements of the requested dtype
    (never read from or written to the file).
    """

    regions: list[Tensor]
    extra: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class _Io:
    handle: AioHandle
    write: bool
    offset: int
    nbytes: int


@dataclass
class _SetState:
    chunk: int = -1  # chunk whose writes are in `writes`
    writes: list[_Io] = field(default_factory=list)
    fence: Callable[[], None] | None = None


class _Files:
    """What `NvmeStore.close` and its finalizer release; holds no reference to the store."""

    def __init__(self, swap: Path, meta: Path, fd: int) -> None:
        self.swap = swap
        self.meta = meta
        self.fd = fd
        self.pool: AioPool | None = None
        self.locked: list[tuple[Tensor, Callable[[], None]]] = []
        """Page-locked buffers and their unlock; unlocked once no I/O can touch them."""
        self.closed = False
        self.owner = os.getpid()

    def release(self, remove: bool) -> None:
        if self.closed:
            return
        self.closed = True
        if os.getpid() != self.owner:
            # A forked child that exits normally runs the atexit finalizer too: the files and
            # the I/O threads (which do not exist in the child) belong to the parent.
            os.close(self.fd)  # the parent's descriptor keeps the flock
            return
        if self.pool is not None:
            self.pool.close()  # waits for requests still in flight
            self.pool = None
        for _, unlock in self.locked:
            unlock()
        self.locked = []
        if remove:
            # The sidecar goes first: a swap file without one is never reused.
            for p in (self.meta, self.swap):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
        os.close(self.fd)  # also drops the flock


def _open_locked(swap: Path) -> int:
    """Open (creating if needed) and exclusively flock the swap file."""
    for _ in range(10):
        try:
            fd = os.open(swap, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise NvmeOffloadError(
                f"cannot open the NVMe offload swap file '{swap}': {os.strerror(e.errno or 0)} "
                f"(errno {e.errno}); check the permissions of its directory"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise NvmeOffloadError(
                f"the NVMe offload swap file '{swap}' is in use by another process or engine "
                "(it holds a lock on it); give each job its own nvme_path, or stop the other "
                "process (or close() its engine) first"
            ) from None
        # The previous owner may have unlinked the file between our open and flock: then we
        # hold a lock on a deleted inode and must open the path again.
        try:
            same = os.stat(swap).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
    raise NvmeOffloadError(f"could not lock the NVMe offload swap file '{swap}': it keeps changing")


def _probe_o_direct(swap: Path) -> bool:
    """True when the file system of ``swap`` serves an aligned O_DIRECT read."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fd = os.open(swap, os.O_RDONLY | os.O_CLOEXEC | flag)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    try:
        buf = mmap.mmap(-1, DIRECT_IO_ALIGNMENT)  # anonymous mmap: page-aligned memory
        try:
            os.preadv(fd, [buf], 0)
        except OSError as e:
            if e.errno == errno.EINVAL:
                return False
            raise
        finally:
            buf.close()
    finally:
        os.close(fd)
    return True


class NvmeStore:
    """``regions`` fp32 arrays of ``numel`` elements in a swap file, streamed in chunks.

    Args:
        nvme_path: existing writable directory; the file is
            ``<nvme_path>/fsdpx-offload-rank<rank>.swap`` (+ ``.swap.meta``).
        rank: rank owning the file (one file per rank).
        numel: elements per region.
        regions: number of fp32 arrays.
        buffer_bytes: bound on the host memory of all buffer sets.
        extra_dtypes: per-chunk scratch buffers ``name -> dtype`` in every `BufferSet`.
        pin_memory: page-lock the buffers (needs an accelerator).
        io_threads: I/O threads.
        sets: buffer sets (>= 2; 3 overlaps read, update and write).

    ``chunk_numel`` is the largest multiple of 1024 with ``sets * chunk_numel *
    (4 * regions + sum(extra itemsizes)) <= buffer_bytes``, capped at ``numel`` rounded up
    to 1024 (larger buffers would only hold padding).

    Raises:
        ValueError: a bad argument, or ``buffer_bytes`` below the minimum (in the message).
        NvmeOffloadError: see `check_nvme_path`; the file is locked by another process.

    Example:
        >>> with NvmeStore("/mnt/nvme", rank=0, numel=1 << 20, regions=3,
        ...                buffer_bytes=8 << 20, extra_dtypes={}, pin_memory=False) as s:
        ...     s.fill(0, 1.0)
    """

    def __init__(
        self,
        nvme_path: str | os.PathLike[str],
        *,
        rank: int,
        numel: int,
        regions: int,
        buffer_bytes: int,
        extra_dtypes: dict[str, torch.dtype],
        pin_memory: bool,
        io_threads: int = 4,
        sets: int = 3,
    ) -> None:
        for name, value, low in (
            ("rank", rank, 0),
            ("numel", numel, 0),
            ("regions", regions, 1),
            ("buffer_bytes", buffer_bytes, 1),
            ("io_threads", io_threads, 1),
            ("sets", sets, 2),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"NvmeStore: {name} must be an int >= {low}, got {value!r}")
        itemsizes = {k: torch.empty((), dtype=d).element_size() for k, d in extra_dtypes.items()}
        per_elem = _FP32 * regions + sum(itemsizes.values())
        fit = buffer_bytes // (sets * per_elem) // _QUANTUM * _QUANTUM
        if fit < _QUANTUM:
            minimum = sets * _QUANTUM * per_elem
            raise ValueError(
                f"NvmeStore: buffer_bytes={buffer_bytes} is too small: {sets} buffer sets of "
                f"at least {_QUANTUM} elements x {per_elem} bytes need {minimum} bytes; raise "
                f"offload buffer_mb to at least {-(-minimum // (1 << 20))}"
            )
        self.numel = numel
        self.regions = regions
        self.chunk_numel = min(fit, -(-max(numel, 1) // _QUANTUM) * _QUANTUM)
        self.num_chunks = -(-numel // self.chunk_numel)
        self._padded = self.num_chunks * self.chunk_numel
        self.file_bytes = regions * self._padded * _FP32
        self.host_bytes = sets * self.chunk_numel * per_elem
        self._num_sets = sets

        swap = Path(nvme_path).expanduser() / f"fsdpx-offload-rank{rank}.swap"
        try:  # an existing swap file is reused or replaced: its blocks count as available
            have = os.stat(swap).st_blocks * 512
        except OSError:
            have = 0
        directory = check_nvme_path(nvme_path, max(0, self.file_bytes - have))
        self.path = directory / swap.name
        self._meta = directory / (swap.name + ".meta")
        fd = _open_locked(self.path)
        files = _Files(self.path, self._meta, fd)
        self._locked = files.locked
        try:
            self.reused = self._reuse_or_recreate(fd)
            self.o_direct = self.file_bytes > 0 and _probe_o_direct(self.path)
            self._sets = [self._alloc_set(itemsizes, extra_dtypes, pin_memory) for _ in range(sets)]
            pool = files.pool = AioPool(
                threads=io_threads,
                queue_depth=max(8, 2 * sets * regions),
                o_direct=self.o_direct,
                chunk_bytes=1 << 20,  # several threads serve one chunk transfer
            )
        except BaseException:
            files.release(remove=True)
            raise
        if not self.o_direct and self.file_bytes > 0:
            warnings.warn(
                f"NVMe offload: the file system of '{directory}' does not support O_DIRECT "
                "(tmpfs, overlay and some network file systems); using buffered I/O through "
                "the page cache, which is slower and uses (reclaimable) host memory beyond "
                "buffer_mb. Put nvme_path on a local ext4/xfs disk for direct I/O.",
                stacklevel=2,
            )
        self._pool = pool
        self._files = files
        self._finalizer = weakref.finalize(self, files.release, True)

    # -- creation ---------------------------------------------------------------------------

    def _layout(self) -> dict[str, int]:
        return {
            "format": FORMAT_VERSION,
            "numel": self.numel,
            "regions": self.regions,
            "chunk_numel": self.chunk_numel,
            "file_bytes": self.file_bytes,
        }

    def _read_sidecar(self) -> object:
        try:
            with open(self._meta, "rb") as f:
                raw = f.read(_MAX_SIDECAR_BYTES + 1)
            if len(raw) > _MAX_SIDECAR_BYTES:
                return None
            return msgpack.unpackb(raw, raw=False)
        except Exception:  # missing, unreadable or corrupt: all mean "recreate"
            return None

    def _reuse_or_recreate(self, fd: int) -> bool:
        if self._read_sidecar() == self._layout() and os.fstat(fd).st_size == self.file_bytes:
            return True
        # Drop the sidecar first so a crash while recreating never leaves a valid-looking pair.
        with contextlib.suppress(FileNotFoundError):
            self._meta.unlink()
        os.ftruncate(fd, 0)
        self._allocate(fd)
        tmp = self._meta.with_name(self._meta.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(msgpack.packb(self._layout()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._meta)
        return False

    def _allocate(self, fd: int) -> None:
        if self.file_bytes == 0:
            return
        try:
            os.posix_fallocate(fd, 0, self.file_bytes)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                # The file system cannot preallocate. ftruncate sets the size but reserves no
                # blocks (a sparse file), so running out of space shows up later, during a
                # step, as NvmeOffloadIOError (ENOSPC) instead of here.
                os.ftruncate(fd, self.file_bytes)
                return
            raise NvmeOffloadError(
                f"could not reserve {self.file_bytes} bytes ({_human(self.file_bytes)}) for the "
                f"NVMe offload swap file '{self.path}': {os.strerror(e.errno or 0)} "
                f"(errno {e.errno}); free space or choose another nvme_path"
            ) from None

    def _alloc_set(
        self, itemsizes: dict[str, int], dtypes: dict[str, torch.dtype], pin: bool
    ) -> BufferSet:
        c = self.chunk_numel
        raw = aligned_empty((self.host_bytes // self._num_sets,))
        if pin:
            # Page-locked in place, at exactly its size (see page_lock_): the buffers are
            # the host-memory bound this store promises.
            self._locked.append((raw, page_lock_(raw)))
        regions = [
            raw[r * c * _FP32 : (r + 1) * c * _FP32].view(torch.float32)
            for r in range(self.regions)
        ]
        extra: dict[str, Tensor] = {}
        off = self.regions * c * _FP32
        # Every extra buffer is a multiple of 1024 bytes long, so each view stays aligned.
        for name, size in itemsizes.items():
            extra[name] = raw[off : off + c * size].view(dtypes[name])
            off += c * size
        return BufferSet(regions=regions, extra=extra)

    # -- streaming --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._files.closed:
            raise ValueError(f"NvmeStore '{self.path}' is closed; create a new store")

    def _check_region(self, region: int) -> None:
        if (
            isinstance(region, bool)
            or not isinstance(region, int)
            or not 0 <= region < self.regions
        ):
            raise ValueError(
                f"NvmeStore: region must be an int in [0, {self.regions}), got {region!r}"
            )

    def _submit(self, write: bool, bufs: BufferSet, chunk: int) -> list[_Io]:
        ios = []
        for r, buf in enumerate(bufs.regions):
            offset = (r * self._padded + chunk * self.chunk_numel) * _FP32
            if write:
                handle = self._pool.write(self.path, buf, offset)
            else:
                handle = self._pool.read(self.path, buf, offset)
            ios.append(_Io(handle, write, offset, buf.nbytes))
        return ios

    def _wait(self, ios: list[_Io]) -> None:
        for io in ios:
            try:
                io.handle.wait()
            except AioError as e:
                op = "writing" if io.write else "reading"
                hint = (
                    "; the disk (or a file-size limit) is full: free space or choose another "
                    "nvme_path"
                    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
                    else ""
                )
                raise NvmeOffloadIOError(
                    f"NVMe offload: {op} {io.nbytes} bytes at offset {io.offset} of "
                    f"'{self.path}' failed: "
                    f"{os.strerror(e.errno) + f' (errno {e.errno})' if e.errno else e}{hint}",
                    e.errno,
                    str(self.path),
                    io.offset,
                ) from e

    def _drain(self, states: list[_SetState]) -> None:
        """Error path: let every request in flight finish (the buffers are theirs until
        then) and call the remaining fences, without hiding the error being raised."""
        with contextlib.suppress(AioError):
            self._pool.wait_all()
        for st in states:
            fence, st.fence, st.writes = st.fence, None, []
            if fence is not None:
                with contextlib.suppress(Exception):
                    fence()

    def _reclaim(self, st: _SetState) -> None:
        writes, st.writes, st.chunk = st.writes, [], -1
        self._wait(writes)
        fence, st.fence = st.fence, None
        if fence is not None:
            fence()

    def stream(
        self,
        chunks: Iterable[int],
        update: Callable[[int, int, BufferSet], object],
        *,
        read: bool = True,
        write: bool = True,
    ) -> None:
        """Run ``update(c, n, bufs)`` on each chunk ``c`` of ``chunks`` in order (module note).

        Args:
            chunks: chunk indices in ``[0, num_chunks)``.
            update: gets the chunk index, its valid element count ``n`` (the last chunk may
                be short; only ``[:n]`` of each buffer matters) and the `BufferSet` holding
                the chunk of every region; may return a fence (a callable), called before
                the set is reused and, for the last sets, before `stream` returns; any other
                return value is ignored.
            read: read the regions before ``update`` (False: a write-only pass; the buffers
                hold leftovers and ``update`` must set every element it wants written).
            write: write the regions back after ``update`` (False: read-only pass).

        Raises:
            NvmeOffloadIOError: a read or write failed (after everything in flight ended).
            ValueError: a chunk index out of range, or the store is closed.

        Example:
            >>> store.stream(range(store.num_chunks), lambda c, n, b: b.regions[0][:n].mul_(2))
        """
        self._check_open()
        order = list(chunks)
        for c in order:
            if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < self.num_chunks:
                raise ValueError(
                    f"NvmeStore.stream: chunk indices must be ints in [0, {self.num_chunks}), "
                    f"got {c!r}"
                )
        nsets = len(self._sets)
        # How far reads run ahead: with write-back, one set stays for the write of the
        # previous chunk (the pipeline note); a read-only pass can use every other set.
        depth = max(1, nsets - 2) if write else nsets - 1
        states = [_SetState() for _ in range(nsets)]
        reads: dict[int, list[_Io]] = {}
        issued = 0
        try:
            for pos, c in enumerate(order):
                while issued < len(order) and issued <= pos + depth:
                    if write and order[issued] in order[pos:issued]:
                        break  # a repeated chunk is read only after its update is written
                    self._reclaim(states[issued % nsets])
                    for other in states:  # a chunk listed twice: read it after its write
                        if other.chunk == order[issued]:
                            self._wait(other.writes)
                            other.writes = []
                    bufs = self._sets[issued % nsets]
                    reads[issued] = self._submit(False, bufs, order[issued]) if read else []
                    issued += 1
                self._wait(reads.pop(pos))
                st = states[pos % nsets]
                bufs = self._sets[pos % nsets]
                fence = update(c, min(self.chunk_numel, self.numel - c * self.chunk_numel), bufs)
                # Only a callable is a fence: in-place tensor ops in a lambda return tensors.
                st.fence = fence if callable(fence) else None
                if write:
                    st.chunk, st.writes = c, self._submit(True, bufs, c)
            for k in range(nsets):  # oldest first
                self._reclaim(states[(len(order) + k) % nsets])
        except BaseException:
            self._drain(states)
            raise

    def fill(self, region: int, value: float) -> None:
        """Set every element of ``region`` to ``value`` (streamed; nothing is read).

        Example:
            >>> store.fill(1, 0.0)  # zero exp_avg
        """
        self._check_open()
        self._check_region(region)
        buf = self._sets[0].regions[region]
        buf.fill_(value)
        ios = []
        try:
            for c in range(self.num_chunks):
                offset = (region * self._padded + c * self.chunk_numel) * _FP32
                ios.append(_Io(self._pool.write(self.path, buf, offset), True, offset, buf.nbytes))
            self._wait(ios)
        except BaseException:
            self._drain([])
            raise

    def view(self, region: int) -> Tensor:
        """``region`` as an fp32 tensor of ``numel`` elements mapped from the file (shared).

        Reads see what `stream` wrote; writes reach the file (call `flush` after writing,
        before the next `stream`). Drop the tensor before streaming again: a mapping kept
        across O_DIRECT writes may show stale pages.

        Example:
            >>> master = store.view(0); master.copy_(params); del master; store.flush()
        """
        self._check_open()
        self._check_region(region)
        if self.numel == 0:
            return torch.empty(0, dtype=torch.float32)
        mm = mmap.mmap(
            self._files.fd,
            self.numel * _FP32,
            flags=mmap.MAP_SHARED,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
            offset=region * self._padded * _FP32,  # a multiple of 4096: mmap needs pages
        )
        # The tensor keeps `mm` alive; the mapping ends when the tensor is freed.
        return torch.frombuffer(mm, dtype=torch.float32)

    def flush(self) -> None:
        """fsync the swap file so that writes made through `view` are on disk.

        Example:
            >>> store.flush()
        """
        self._check_open()
        os.fsync(self._files.fd)

    def close(self, remove: bool = True) -> None:
        """Wait for I/O in flight, release the lock, and (``remove``) delete the file and
        sidecar. Idempotent; also run by garbage collection and at interpreter exit.

        Args:
            remove: False keeps the file and sidecar for reuse by the next store.

        Example:
            >>> store.close()
        """
        self._finalizer.detach()
        self._files.release(remove)

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()
