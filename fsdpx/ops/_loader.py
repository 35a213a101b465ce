"""Loading the native fsdpx ops: a prebuilt library if installed, else a JIT build.

`load_ops()` (CPU) and `load_cuda_ops()` (CUDA) each run at most once per process and never
raise: they return an `OpsStatus`; when the native library cannot be had they warn once,
saying why and how to fix it, and the Python wrappers in `fsdpx.ops` use their pure-PyTorch
references instead.

[Note: how one library is found or built]
1. `FSDPX_OPS_DISABLE=1` -> unavailable, no warning (the user chose the references).
2. A prebuilt library next to this file (`pip install` with `FSDPX_BUILD_OPS=1`, see
   setup.py) is used when its sidecar JSON names this torch version and these sources.
3. Otherwise the build directory `<cache>/<kind>-<torch version>-<hash>` is used, where the
   hash covers the sources, flags, compiler and Python version, so a finished directory is
   never rebuilt and never changes. `<cache>` is `$FSDPX_OPS_CACHE`, else
   `$XDG_CACHE_HOME/fsdpx/ops`, else `~/.cache/fsdpx/ops`; directories are created 0700 and a
   directory owned by someone else or writable by others is refused (loading a library from
   it would run their code).
4. A finished directory holds `fsdpx-complete.json` (written last, atomically): load at once.
5. Else take `fsdpx-build.lock` with `fcntl.flock`. The kernel drops that lock when its holder
   dies, so a build killed mid-way never blocks the next one - unlike torch's own `lock` file
   (FileBaton), which a killed build leaves behind and which makes `cpp_extension.load` wait
   forever. Holding our lock, any such file is stale: it is deleted together with the
   unfinished objects, and torch builds from scratch with ninja.

[Note: runtime CPU dispatch]
The binary is not tied to the build machine (`-march=native` is never used): the kernels carry
GCC `target_clones("avx512f", "avx2", "default")`, so one translation unit holds three copies
and the loader (ifunc) picks one for the running CPU. `-ffp-contract=off` keeps every clone
free of FMA contraction, which the bitwise comparisons with the references rely on.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

PACKAGE_DIR = Path(__file__).resolve().parent
"""Where a prebuilt library (setup.py with FSDPX_BUILD_OPS=1) and its sidecar JSON live."""
CSRC = PACKAGE_DIR / "csrc"
"""The C++ sources: `csrc/*.cpp` form the CPU library, `csrc/cuda/*.{cu,cpp}` the CUDA one."""

CPU_NAME = "fsdpx_ops_cpu"
CUDA_NAME = "fsdpx_ops_cuda"

CPU_CFLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-Wall"]
"""-ffp-contract=off: no FMA contraction (bitwise equality with the references).
-fno-math-errno: lets sqrtf vectorise (errno is never read; results are unchanged).
-fopenmp: at::parallel_for runs on torch's own OpenMP pool (libgomp.so.1 is already loaded by
torch, so the extension shares that runtime and obeys torch.set_num_threads)."""
CPU_LDFLAGS = ["-fopenmp"]
CUDA_CFLAGS = ["-O3", "--fmad=false", "-lineinfo"]
"""--fmad=false: nvcc contracts a*b+c into FMA by default, which would break bitwise
equality with the CPU references."""

COMPLETE_MARKER = "fsdpx-complete.json"
LOCK_NAME = "fsdpx-build.lock"
TORCH_BATON = "lock"  # torch.utils.cpp_extension's FileBaton file inside the build directory
LOCK_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class OpsStatus:
    """The outcome of loading one native library."""

    available: bool
    """True when the native ops are registered under torch.ops.fsdpx."""
    reason: str | None
    """Why they are not available (None when they are)."""
    library_path: str | None
    """The shared library that was loaded."""
    build_seconds: float | None
    """Seconds this process spent building it (None: loaded prebuilt or from the cache)."""


def cpu_sources() -> list[Path]:
    """The sources of the CPU library, sorted (so the build key is stable)."""
    return sorted(CSRC.glob("*.cpp"))


def cuda_sources() -> list[Path]:
    """The sources of the CUDA library (its schemas come from the CPU library)."""
    cuda = CSRC / "cuda"
    return sorted([*cuda.glob("*.cu"), *cuda.glob("*.cpp")])


def build_key(kind: str) -> str:
    """A hash of everything the built library depends on: sources (and headers), flags,
    compiler, torch and Python versions. Used for the cache directory and the prebuilt
    sidecar, so a changed source is never served from an old build.

    Args:
        kind: "cpu" or "cuda".
    Returns:
        16 hex digits.
    """
    h = hashlib.sha256()
    files = cpu_sources() if kind == "cpu" else cuda_sources()
    headers = sorted(CSRC.rglob("*.h"))
    for path in [*files, *headers]:
        h.update(str(path.relative_to(CSRC)).encode())
        h.update(path.read_bytes())
    flags = CPU_CFLAGS + CPU_LDFLAGS + (CUDA_CFLAGS if kind == "cuda" else [])
    compiler = os.environ.get("CXX", "c++")
    for part in (
        kind,
        " ".join(flags),
        compiler,
        torch.__version__,
        str(torch.version.git_version),
        str(torch.version.cuda),
        f"{sys.version_info.major}.{sys.version_info.minor}",
    ):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def cache_root() -> Path:
    """Where JIT builds live: $FSDPX_OPS_CACHE, else $XDG_CACHE_HOME/fsdpx/ops, else
    ~/.cache/fsdpx/ops."""
    override = os.environ.get("FSDPX_OPS_CACHE")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "fsdpx" / "ops"


def _private_dir(path: Path) -> None:
    """Create `path` (0700) and check that it belongs to this user and no one else can write
    it; raises PermissionError otherwise."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise PermissionError(
            f"the ops cache directory {path} is owned by uid {st.st_uid} with mode "
            f"{oct(st.st_mode & 0o777)}; expected one owned by uid {os.geteuid()} that others "
            "cannot write (loading a library from it would run their code). Set "
            "FSDPX_OPS_CACHE to a private directory"
        )


@contextmanager
def _build_lock(build_dir: Path, timeout_s: float) -> Iterator[None]:
    """Hold an exclusive flock on build_dir/fsdpx-build.lock; the kernel releases it when the
    holder exits or is killed, so a dead builder never blocks us. Times out (RuntimeError)
    only while a live process keeps building."""
    lock_path = build_dir / LOCK_NAME
    fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
                    raise RuntimeError(
                        f"waited {timeout_s:g} s for process {holder or '?'} building the "
                        f"fsdpx ops in {build_dir}; if it is stuck, end it (or delete that "
                        "directory) and retry"
                    ) from None
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the flock


def _clear_unfinished(build_dir: Path) -> None:
    """Delete what a killed or failed build left (torch's stale `lock` included), keeping our
    lock file; called only while holding that lock."""
    for entry in build_dir.iterdir():
        if entry.name == LOCK_NAME:
            continue
        if entry.is_dir() and not entry.is_symlink():
            for sub in sorted(entry.rglob("*"), reverse=True):
                sub.rmdir() if sub.is_dir() and not sub.is_symlink() else sub.unlink()
            entry.rmdir()
        else:
            entry.unlink()


def _prebuilt(name: str, kind: str) -> tuple[Path | None, str | None]:
    """The prebuilt library for `name` and, when one exists but does not fit, why."""
    here = PACKAGE_DIR
    libs = sorted(here.glob(f"_{name}*.so"))
    if not libs:
        return None, None
    sidecar = here / f"_{name}.json"
    try:
        info = json.loads(sidecar.read_text())
    except (OSError, ValueError):
        return None, f"prebuilt {libs[0]} has no readable {sidecar.name}"
    if info.get("torch") != torch.__version__ or info.get("key") != build_key(kind):
        return None, (
            f"prebuilt {libs[0]} was built for torch {info.get('torch')} and sources "
            f"{info.get('key')}, this is torch {torch.__version__} with sources "
            f"{build_key(kind)}; rebuild it (FSDPX_BUILD_OPS=1 pip install "
            "--no-build-isolation -e .) or delete it"
        )
    return libs[0], None


def _check_tools() -> None:
    """Fail fast, with a clear reason, when the compiler or ninja is missing (torch would
    otherwise log a page about compiler compatibility and then fail inside ninja)."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        source = "$CXX" if "CXX" in os.environ else "the default C++ compiler"
        raise RuntimeError(f"the C++ compiler {compiler!r} ({source}) was not found")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja was not found (pip install ninja)")


def _short(message: str) -> str:
    """The informative lines of a build log: compiler errors first, else its last lines."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"error|not found|fatal", ln, re.IGNORECASE)]
    picked = (errors or lines)[-4:]
    return " | ".join(ln if len(ln) <= 300 else ln[:297] + "..." for ln in picked)


def _load(kind: str) -> OpsStatus:
    from torch.utils import cpp_extension

    if os.environ.get("FSDPX_OPS_DISABLE") == "1":
        return OpsStatus(False, "FSDPX_OPS_DISABLE=1", None, None)
    name = CPU_NAME if kind == "cpu" else CUDA_NAME
    sources = cpu_sources() if kind == "cpu" else cuda_sources()
    if not sources:
        return OpsStatus(False, f"no {kind} sources under {CSRC}", None, None)
    prebuilt, mismatch = _prebuilt(name, kind)
    if prebuilt is not None:
        torch.ops.load_library(str(prebuilt))
        return OpsStatus(True, None, str(prebuilt), None)
    if mismatch is not None:
        warnings.warn(f"fsdpx ops: {mismatch}; building them instead", stacklevel=3)

    root = cache_root()
    build_dir = root / f"{kind}-{torch.__version__}-{build_key(kind)}"
    _private_dir(root)
    _private_dir(build_dir)
    library = build_dir / f"{name}.so"
    if (build_dir / COMPLETE_MARKER).exists():
        torch.ops.load_library(str(library))
        return OpsStatus(True, None, str(library), None)

    _check_tools()
    with _build_lock(build_dir, LOCK_TIMEOUT_S):
        if not (build_dir / COMPLETE_MARKER).exists():  # another process may have finished
            _clear_unfinished(build_dir)
            start = time.perf_counter()
            # torch warns on its own about a compiler it cannot run; keep that inside our one
            # warning (as part of the reason) when the build fails, pass it on when it works.
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    cpp_extension.load(
                        name=name,
                        sources=[str(s) for s in sources],
                        extra_cflags=CPU_CFLAGS,
                        extra_cuda_cflags=CUDA_CFLAGS if kind == "cuda" else None,
                        extra_ldflags=CPU_LDFLAGS,
                        extra_include_paths=[str(CSRC)],
                        build_directory=str(build_dir),
                        with_cuda=kind == "cuda",
                        is_python_module=False,
                        verbose=False,
                    )
                except Exception as e:
                    said = " ".join(str(w.message).strip() for w in caught)
                    raise RuntimeError(f"{e}\n(torch said: {said})" if said else str(e)) from e
            for w in caught:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            seconds = time.perf_counter() - start
            marker = build_dir / (COMPLETE_MARKER + ".tmp")
            marker.write_text(json.dumps({"build_seconds": seconds, "key": build_key(kind)}))
            marker.replace(build_dir / COMPLETE_MARKER)
            return OpsStatus(True, None, str(library), seconds)
    torch.ops.load_library(str(library))
    return OpsStatus(True, None, str(library), None)


def _load_or_warn(kind: str) -> OpsStatus:
    try:
        return _load(kind)
    except Exception as e:  # any failure means: use the references, and say why once
        reason = f"{type(e).__name__}: {_short(str(e)) or 'no message'}"
        warnings.warn(
            f"fsdpx {kind.upper()} ops could not be built or loaded, using the slower "
            f"pure-PyTorch references instead. Reason: {reason}. To fix: install a C++ "
            "compiler (g++ >= 9; set CXX to use another) and ninja"
            + (
                ", and the CUDA toolkit matching torch.version.cuda (CUDA_HOME)"
                if kind == "cuda"
                else ""
            )
            + f"; to rebuild from scratch delete {cache_root()}; to use the references "
            "without this warning set FSDPX_OPS_DISABLE=1.",
            RuntimeWarning,
            stacklevel=3,
        )
        return OpsStatus(False, reason, None, None)


@functools.cache
def load_ops() -> OpsStatus:
    """Load (building once if needed) the CPU library with every op schema and CPU kernel.

    Returns:
        The status; `available` False means the references are used (a warning said why).

    Example::

        if load_ops().available:
            torch.ops.fsdpx.adam_step(...)
    """
    return _load_or_warn("cpu")


@functools.cache
def load_cuda_ops() -> OpsStatus:
    """Load (building once if needed) the CUDA kernels; only where a CUDA device is present
    and the CPU library (which defines the schemas) loaded.

    Returns:
        The status; without a CUDA device it is unavailable, with no warning.

    Example::

        if load_cuda_ops().available:
            torch.ops.fsdpx.adam_step(...)   # on CUDA tensors
    """
    if not torch.cuda.is_available():
        return OpsStatus(False, "no CUDA device (torch.cuda.is_available() is False)", None, None)
    cpu = load_ops()
    if not cpu.available:
        return OpsStatus(
            False, f"the CPU library with the schemas is unavailable ({cpu.reason})", None, None
        )
    return _load_or_warn("cuda")
