"""Asynchronous reads and writes between files and CPU tensors (for NVMe offload).

`AioPool` submits ``read``/``write`` requests that copy a whole contiguous CPU tensor (any
dtype, pinned or not) from/to a byte range of a file and returns an `AioHandle` at once;
``handle.wait()`` blocks until it is done and returns the byte count. This lets a caller
stream chunks: read i+1 while computing on i while writing i-1.

Two implementations behind one API:

* **native** (``torch.classes.fsdpx.AioPool``, ``csrc/aio.cpp``): a pool of C++ threads
  doing pread/pwrite. With ``o_direct=True`` the aligned part of each request bypasses the
  page cache (O_DIRECT); unaligned heads/tails use buffered I/O and unaligned memory goes
  through an aligned bounce buffer; file systems without O_DIRECT (tmpfs...) silently use
  buffered I/O throughout. Each request is split into ``chunk_bytes`` pieces served in
  parallel by the threads.
* **python** (used when the native ops could not be built, or with ``backend="python"``):
  a ``ThreadPoolExecutor`` running ``os.preadv``/``os.pwrite`` on a view of the tensor's
  memory, one request per task, always buffered (``o_direct`` is not used).

Semantics shared by both:

* At most ``queue_depth`` requests are in flight; submitting more blocks until one finishes.
* Every error, a failed ``open`` included, is raised by ``wait()`` (or ``wait_all()``) as an
  `AioError` (an ``OSError``) whose message names the path, the operation and
  ``strerror (errno N)``; ``.errno`` and ``.filename`` are set. Reading past the end of the
  file is an error (``.errno`` is None), never a silent short read.
* Writes create the file if needed and never truncate it; ``fsync=True`` runs fdatasync
  before the request counts as done.
* The tensor must stay untouched until the request is done (the pool keeps a reference).

Example:
    >>> t = torch.arange(1000, dtype=torch.float32)
    >>> with AioPool(threads=2) as pool:
    ...     pool.write("/tmp/x.bin", t, offset=0).wait()
    ...     u = torch.empty_like(t)
    ...     pool.read("/tmp/x.bin", u, offset=0).wait()
    4000
    4000
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import torch
from torch import Tensor

from fsdpx.errors import AioError
from fsdpx.ops._loader import load_ops

__all__ = [
    "DIRECT_IO_ALIGNMENT",
    "AioError",
    "AioHandle",
    "AioPool",
    "aligned_empty",
    "page_lock_",
]

DIRECT_IO_ALIGNMENT = 4096
"""Alignment (bytes) of memory, file offsets and sizes that O_DIRECT transfers need."""


def aligned_empty(
    shape: tuple[int, ...] | list[int],
    *,
    dtype: torch.dtype = torch.uint8,
    pin_memory: bool = False,
) -> Tensor:
    """An uninitialised CPU tensor whose memory starts on a 4 KiB boundary.

    O_DIRECT reads/writes into such a buffer skip the bounce copy that an ordinary tensor
    (64-byte aligned) needs; use it for long-lived staging buffers.

    Args:
        shape: tensor shape.
        dtype: element type.
        pin_memory: allocate page-locked memory (needs an accelerator in torch).

    Returns:
        A contiguous tensor (a view into a slightly larger uint8 allocation).

    Example:
        >>> buf = aligned_empty((1 << 20,), dtype=torch.float32)
        >>> buf.data_ptr() % DIRECT_IO_ALIGNMENT
        0
    """
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + DIRECT_IO_ALIGNMENT, dtype=torch.uint8, pin_memory=pin_memory)
    start = -raw.data_ptr() % DIRECT_IO_ALIGNMENT
    return raw[start : start + nbytes].view(dtype).view(tuple(shape))


def page_lock_(t: Tensor) -> Callable[[], None]:
    """Page-lock a contiguous CPU tensor's memory in place (cudaHostRegister), so device
    copies from/to it run asynchronously. Returns `unlock` (idempotent): the caller keeps
    `t` alive and calls it before letting the memory go.

    Not `torch.empty(..., pin_memory=True)`: torch's pinned allocator rounds every
    allocation up to a power of two (CachingHostAllocator), up to twice the memory asked
    for, which would break the host-memory bound of offload buffers. (torch's `is_pinned()`
    does not report memory locked this way.)

    Example:
        >>> buf = torch.empty(1 << 20); unlock = page_lock_(buf); ...; unlock()
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "pinning host memory needs a CUDA device; set the offload's pin_memory to false"
        )
    if t.numel() == 0:
        return lambda: None
    cudart = torch.cuda.cudart()
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    err = int(cudart.cudaHostRegister(ptr, nbytes, 0))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed (CUDA error {err})")
    done = [False]

    def unlock() -> None:
        if not done[0]:
            done[0] = True
            cudart.cudaHostUnregister(ptr)

    return unlock


def _error(errno_: int | None, message: str, path: str) -> AioError:
    err = AioError(message)
    err.errno = errno_
    err.filename = path
    return err


def _errno_message(err: OSError) -> str:
    return f"{os.strerror(err.errno)} (errno {err.errno})" if err.errno else str(err)


class AioHandle:
    """One submitted request; ``wait()`` returns its byte count or raises `AioError`."""

    def __init__(
        self,
        pool: AioPool,
        path: str,
        native_id: int | None = None,
        future: Future[int] | None = None,
    ) -> None:
        self._pool = pool
        self._path = path
        self._id = native_id
        self._future = future
        self._result: int | None = None
        self._error: AioError | None = None

    @property
    def path(self) -> str:
        """The file this request reads or writes."""
        return self._path

    def done(self) -> bool:
        """True once the request has completed (successfully or not); never blocks."""
        if self._result is not None or self._error is not None:
            return True
        if self._future is not None:
            return self._future.done()
        return bool(self._pool._native.poll(self._id))

    def wait(self) -> int:
        """Block until the request completes.

        Returns:
            The number of bytes read or written (the tensor's size in bytes).

        Raises:
            AioError: the open, read, write or fdatasync failed, or a read ran past the end
                of the file. Calling ``wait()`` again raises the same error.

        Example:
            >>> n = pool.read("/tmp/x.bin", buf, offset=0).wait()
        """
        if self._error is not None:
            raise self._error
        if self._result is None:
            try:
                if self._future is not None:
                    self._result = self._future.result()
                else:
                    nbytes, err_no, message = self._pool._native.wait(self._id)
                    if message:
                        raise _error(err_no or None, message, self._path)
                    self._result = int(nbytes)
            except AioError as e:
                self._error = e
                raise
            finally:
                self._pool._forget(self)
        return self._result


class AioPool:
    """A pool of I/O threads moving bytes between files and CPU tensors (module docstring).

    Args:
        threads: worker threads (concurrent pread/pwrite calls).
        queue_depth: requests in flight before ``read``/``write`` block.
        o_direct: bypass the page cache where the file system allows (native backend only).
        chunk_bytes: native backend: a request is split into pieces of this size (rounded up
            to 4 KiB) that the threads serve in parallel.
        backend: ``"auto"`` (native if it builds, else python), ``"native"`` (raise if the
            native ops are unavailable) or ``"python"``.

    Example:
        >>> with AioPool(threads=4, queue_depth=8) as pool:
        ...     handles = [pool.write(f"/tmp/c{i}", chunk) for i, chunk in enumerate(chunks)]
        ...     pool.wait_all()
    """

    def __init__(
        self,
        *,
        threads: int = 4,
        queue_depth: int = 32,
        o_direct: bool = True,
        chunk_bytes: int = 8 << 20,
        backend: Literal["auto", "native", "python"] = "auto",
    ) -> None:
        for name, value in (
            ("threads", threads),
            ("queue_depth", queue_depth),
            ("chunk_bytes", chunk_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"AioPool: {name} must be a positive int, got {value!r}")
        if backend not in ("auto", "native", "python"):
            raise ValueError(
                f"AioPool: backend must be 'auto', 'native' or 'python', got {backend!r}"
            )
        self._native: Any = None
        self._executor: ThreadPoolExecutor | None = None
        self._slots = threading.BoundedSemaphore(queue_depth)
        self._lock = threading.Lock()
        self._pending: set[AioHandle] = set()
        if backend != "python":
            status = load_ops()
            if status.available:
                self._native = torch.classes.fsdpx.AioPool(
                    threads, queue_depth, o_direct, chunk_bytes
                )
            elif backend == "native":
                raise RuntimeError(
                    f"AioPool(backend='native'): the native fsdpx ops are unavailable "
                    f"({status.reason}); use backend='auto' to fall back to Python threads"
                )
        if self._native is None:
            self._executor = ThreadPoolExecutor(threads, thread_name_prefix="fsdpx-aio")
        self.o_direct = o_direct and self._native is not None
        """True when O_DIRECT is attempted (native backend and o_direct requested)."""

    @property
    def backend(self) -> Literal["native", "python"]:
        """Which implementation serves this pool."""
        return "native" if self._native is not None else "python"

    def stats(self) -> tuple[int, int, int]:
        """Bytes moved so far as (via O_DIRECT, of those via the bounce buffer, buffered).

        The python backend does not count: it returns (0, 0, 0).
        """
        if self._native is None:
            return (0, 0, 0)
        direct, bounce, buffered = self._native.stats()
        return int(direct), int(bounce), int(buffered)

    def read(self, path: str | os.PathLike[str], tensor: Tensor, offset: int = 0) -> AioHandle:
        """Fill ``tensor`` with ``tensor.nbytes`` bytes of ``path`` starting at byte ``offset``.

        Args:
            path: an existing file.
            tensor: contiguous CPU tensor to overwrite.
            offset: byte offset in the file.

        Returns:
            A handle; ``handle.wait()`` returns the byte count or raises `AioError`.

        Example:
            >>> pool.read("/tmp/x.bin", buf, offset=4096).wait()
        """
        return self._submit(os.fspath(path), tensor, offset, is_write=False, fsync=False)

    def write(
        self, path: str | os.PathLike[str], tensor: Tensor, offset: int = 0, *, fsync: bool = False
    ) -> AioHandle:
        """Write ``tensor``'s bytes to ``path`` at byte ``offset`` (created, never truncated).

        Args:
            path: target file.
            tensor: contiguous CPU tensor to write.
            offset: byte offset in the file.
            fsync: fdatasync the file before the request completes.

        Returns:
            A handle; ``handle.wait()`` returns the byte count or raises `AioError`.

        Example:
            >>> pool.write("/tmp/x.bin", t, offset=0, fsync=True).wait()
        """
        return self._submit(os.fspath(path), tensor, offset, is_write=True, fsync=fsync)

    def wait_all(self) -> None:
        """Wait for every request not yet waited; raise the first error among them.

        Example:
            >>> pool.wait_all()
        """
        with self._lock:
            handles = list(self._pending)
        first: AioError | None = None
        for h in handles:
            try:
                h.wait()
            except AioError as e:
                first = first or e
        if first is not None:
            raise first

    def close(self) -> None:
        """Finish pending requests (without raising their errors) and stop the threads."""
        with self._lock:
            handles = list(self._pending)
        for h in handles:
            with contextlib.suppress(AioError):  # close() is also the error path's cleanup
                h.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._executor = None
        self._native = None

    def __enter__(self) -> AioPool:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # Errors of unwaited requests surface here unless another exception is already
        # propagating (raising now would hide it).
        try:
            if exc_type is None:
                self.wait_all()
        finally:
            self.close()

    def _forget(self, handle: AioHandle) -> None:
        with self._lock:
            self._pending.discard(handle)

    def _submit(
        self, path: str, tensor: Tensor, offset: int, *, is_write: bool, fsync: bool
    ) -> AioHandle:
        if not isinstance(tensor, Tensor) or tensor.device.type != "cpu":
            raise ValueError(
                f"AioPool: expected a CPU tensor, got {type(tensor).__name__} on "
                f"{getattr(tensor, 'device', None)}"
            )
        if not tensor.is_contiguous():
            raise ValueError(
                "AioPool: expected a contiguous tensor; call .contiguous() first "
                "(and copy the result back after a read)"
            )
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"AioPool: offset must be an int >= 0, got {offset!r}")
        if self._native is not None:
            if is_write:
                rid = self._native.write(path, tensor, offset, fsync)
            else:
                rid = self._native.read(path, tensor, offset)
            handle = AioHandle(self, path, native_id=int(rid))
        elif self._executor is not None:
            self._slots.acquire()  # queue_depth back-pressure, released when the task ends
            future = self._executor.submit(_python_io, path, tensor, offset, is_write, fsync)
            future.add_done_callback(lambda _: self._slots.release())
            handle = AioHandle(self, path, future=future)
        else:
            raise ValueError("AioPool: the pool is closed; create a new one")  # like a closed file
        with self._lock:
            self._pending.add(handle)
        return handle


def _python_io(path: str, tensor: Tensor, offset: int, is_write: bool, fsync: bool) -> int:
    """The python backend's task: one whole request, buffered, same errors as the native one."""
    nbytes = tensor.numel() * tensor.element_size()
    # The tensor's own memory as a writable buffer, for any dtype (bfloat16 too) and without
    # numpy, which torch does not require.
    raw = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr()) if nbytes else bytearray()
    mem = memoryview(raw).cast("B")
    try:
        fd = os.open(path, (os.O_WRONLY | os.O_CREAT) if is_write else os.O_RDONLY, 0o644)
    except OSError as e:
        raise _error(
            e.errno,
            f"fsdpx.aio: cannot open '{path}' for "
            f"{'writing' if is_write else 'reading'}: {_errno_message(e)}",
            path,
        ) from None
    try:
        done = 0
        while done < nbytes:
            want = min(nbytes - done, 1 << 30)
            try:
                if is_write:
                    n = os.pwrite(fd, mem[done : done + want], offset + done)
                else:
                    n = os.preadv(fd, [mem[done : done + want]], offset + done)
            except OSError as e:
                op = "pwrite" if is_write else "pread"
                raise _error(
                    e.errno,
                    f"fsdpx.aio: {op} of {want} bytes at offset "
                    f"{offset + done} in '{path}' failed: {_errno_message(e)}",
                    path,
                ) from None
            if n == 0:
                size = os.fstat(fd).st_size
                raise _error(
                    None,
                    f"fsdpx.aio: read of {nbytes} bytes at offset {offset} from "
                    f"'{path}' runs past the end of the file (size {size} bytes); read "
                    "a smaller tensor or a lower offset",
                    path,
                )
            done += n
        if is_write and fsync:
            try:
                os.fdatasync(fd)
            except OSError as e:
                raise _error(
                    e.errno, f"fsdpx.aio: fdatasync of '{path}' failed: {_errno_message(e)}", path
                ) from None
        return nbytes
    finally:
        os.close(fd)
