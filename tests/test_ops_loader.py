"""fsdpx.ops._loader: cache reuse, prebuilt preference, stale-lock recovery, fallback with one
warning. Subprocesses get their own FSDPX_OPS_CACHE (or only read the shared one), so no test
rebuilds or clobbers the cache the rest of the suite uses. The one test that compiles the
library from scratch (kill a build mid-way, build again) is marked slow."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdpx.ops import _loader
from fsdpx.ops._loader import LOCK_NAME, TORCH_BATON, load_ops

REPO = Path(__file__).resolve().parent.parent

# Loads the ops in a fresh interpreter and prints one JSON line: the status, the seconds
# load_ops took, its fsdpx warnings, and whether adam_step (native or reference) still gives
# the reference's bits.
_PROBE = textwrap.dedent(
    """
    import json, time, warnings
    from pathlib import Path
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torch
        import fsdpx.ops._loader as L
        {setup}
        t = time.perf_counter()
        s = L.load_ops()
        seconds = time.perf_counter() - t
        assert L.load_ops() is s
        from fsdpx.ops import adam_step, adam_step_reference
        a = [torch.randn(1000), torch.randn(1000), torch.zeros(1000), torch.zeros(1000)]
        b = [t.clone() for t in a]
        adam_step([a[0]], [a[1]], [a[2]], [a[3]], lr=0.1, step=1)
        adam_step_reference([b[0]], [b[1]], [b[2]], [b[3]], [], [], lr=0.1, beta1=0.9,
                            beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
        same = all(torch.equal(x, y) for x, y in zip(a, b))
    print(json.dumps(dict(
        available=s.available, reason=s.reason, library_path=s.library_path,
        build_seconds=s.build_seconds, load_seconds=seconds, adam_ok=same,
        warnings=[str(w.message) for w in caught if "fsdpx" in str(w.message)],
    )))
    """
)


def _probe(env: dict[str, str], setup: str = "pass", timeout: float = 600) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(setup=setup)],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def built() -> str:
    """The library this process uses (built into the user's cache on first use)."""
    status = load_ops()
    assert status.available and status.library_path, status.reason
    return status.library_path


def test_second_process_reuses_the_cache(built: str) -> None:
    info = _probe({})
    assert info["available"] and info["adam_ok"], info
    assert info["library_path"] == built
    assert info["build_seconds"] is None  # loaded, not built
    assert info["warnings"] == []


def _fake_compiler(tmp_path: Path) -> Path:
    """A compiler that answers version queries like g++ but fails every compilation."""
    cc = tmp_path / "broken-c++"
    cc.write_text(
        '#!/bin/sh\ncase "$1" in --version|-dumpversion|-dumpfullversion|-v) exec g++ "$@";; esac\n'
        'echo "error: simulated compiler failure" >&2\nexit 1\n'
    )
    cc.chmod(0o755)
    return cc


@pytest.mark.parametrize("compiler", ["missing", "failing"])
def test_bad_compiler_falls_back_with_one_warning(tmp_path: Path, compiler: str) -> None:
    cache = tmp_path / "cache"
    cxx = "/nonexistent/c++" if compiler == "missing" else str(_fake_compiler(tmp_path))
    info = _probe({"FSDPX_OPS_CACHE": str(cache), "CXX": cxx})
    assert not info["available"] and info["library_path"] is None
    expected = (
        "'/nonexistent/c\\+\\+' \\(\\$CXX\\) was not found"
        if compiler == "missing"
        else "error: simulated compiler failure"
    )
    assert len(info["warnings"]) == 1, info["warnings"]
    warning = info["warnings"][0]
    assert re.search(expected, info["reason"]) and re.search(expected, warning), info
    assert "using the slower pure-PyTorch references" in warning
    assert "set CXX" in warning and "FSDPX_OPS_DISABLE=1" in warning
    assert info["adam_ok"]  # the reference ran instead


def test_cuda_ops_need_a_device(recwarn: Any) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    status = _loader.load_cuda_ops()
    assert not status.available and "no CUDA device" in (status.reason or "")
    assert not [w for w in recwarn if "fsdpx" in str(w.message)]  # not a failure: no warning


def test_disabled_by_env_without_warning(monkeypatch: pytest.MonkeyPatch, recwarn: Any) -> None:
    monkeypatch.setenv("FSDPX_OPS_DISABLE", "1")
    status = _loader._load_or_warn("cpu")
    assert status == _loader.OpsStatus(False, "FSDPX_OPS_DISABLE=1", None, None)
    assert not [w for w in recwarn if "fsdpx" in str(w.message)]


def test_refuses_a_cache_others_can_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("FSDPX_OPS_CACHE", str(shared))
    with pytest.warns(
        RuntimeWarning, match="others\\s+cannot write .* Set FSDPX_OPS_CACHE to a private directory"
    ):
        status = _loader._load_or_warn("cpu")
    assert not status.available and "PermissionError" in (status.reason or "")


def test_cache_root_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FSDPX_OPS_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _loader.cache_root() == tmp_path / "home" / ".cache" / "fsdpx" / "ops"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _loader.cache_root() == tmp_path / "xdg" / "fsdpx" / "ops"
    monkeypatch.setenv("FSDPX_OPS_CACHE", str(tmp_path / "mine"))
    assert _loader.cache_root() == tmp_path / "mine"


def test_build_key_follows_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    csrc = tmp_path / "csrc"
    shutil.copytree(_loader.CSRC, csrc)
    monkeypatch.setattr(_loader, "CSRC", csrc)
    before = _loader.build_key("cpu")
    (csrc / "adam_common.h").write_text((csrc / "adam_common.h").read_text() + "\n// edit\n")
    assert _loader.build_key("cpu") != before  # a header counts too
    monkeypatch.setenv("CXX", "clang++")
    assert len({before, _loader.build_key("cpu")}) == 2


def test_lock_held_by_a_live_builder_times_out_with_advice(tmp_path: Path) -> None:
    fd = os.open(tmp_path / LOCK_NAME, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, b"4242", 0)
        start = time.monotonic()
        with (
            pytest.raises(
                RuntimeError,
                match=r"waited 0.3 s for process 4242 building the fsdpx ops in .*delete that directory",
            ),
            _loader._build_lock(tmp_path, timeout_s=0.3),
        ):
            pass
        assert time.monotonic() - start < 60  # gave up (the lock is held for ever)
    finally:
        os.close(fd)


def test_stale_torch_lock_and_partial_build_are_cleared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a killed build leaves - torch's FileBaton `lock` (which makes cpp_extension.load
    wait forever) and half the objects - is removed under our flock before building again;
    the finished directory is then loaded without building. The compiler is stood in for by a
    stub that links an empty library (test_killed_build_recovers does it for real)."""
    monkeypatch.setenv("FSDPX_OPS_CACHE", str(tmp_path / "cache"))
    build_dir = _loader.cache_root() / f"cpu-{torch.__version__}-{_loader.build_key('cpu')}"
    build_dir.mkdir(parents=True, mode=0o700)
    (build_dir / TORCH_BATON).write_text("")
    (build_dir / "adam.o").write_bytes(b"half an object")
    calls = []

    def fake_load(*, name: str, build_directory: str, **kw: Any) -> str:
        left = sorted(p.name for p in Path(build_directory).iterdir())
        calls.append(left)
        lib = Path(build_directory) / f"{name}.so"
        empty = Path(build_directory) / "empty.c"
        empty.write_text("int fsdpx_test_symbol;\n")
        subprocess.run(["cc", "-shared", "-fPIC", str(empty), "-o", str(lib)], check=True)
        return str(lib)

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    first = _loader._load("cpu")
    assert calls == [[LOCK_NAME]]  # only our (released-by-the-kernel) lock file survived
    assert first.available and first.build_seconds is not None
    second = _loader._load("cpu")
    assert len(calls) == 1 and second.build_seconds is None
    assert second.library_path == first.library_path


def test_prebuilt_library_is_preferred(built: str, tmp_path: Path) -> None:
    """A library next to the package with a matching sidecar is loaded as is; one built for
    another torch or other sources is skipped with a warning saying how to rebuild it."""
    lib = tmp_path / "_fsdpx_ops_cpu.cpython-311-x86_64-linux-gnu.so"
    shutil.copy(built, lib)
    sidecar = tmp_path / "_fsdpx_ops_cpu.json"
    setup = f"L.PACKAGE_DIR = Path({str(tmp_path)!r})"
    sidecar.write_text(json.dumps({"torch": torch.__version__, "key": _loader.build_key("cpu")}))
    info = _probe({}, setup)
    assert info["available"] and info["adam_ok"] and info["warnings"] == [], info
    assert info["library_path"] == str(lib) and info["build_seconds"] is None

    sidecar.write_text(json.dumps({"torch": "0.0", "key": _loader.build_key("cpu")}))
    info = _probe({}, setup)
    assert info["available"] and info["library_path"] == built, info
    assert len(info["warnings"]) == 1
    assert "was built for torch 0.0" in info["warnings"][0]
    assert "FSDPX_BUILD_OPS=1 pip install --no-build-isolation" in info["warnings"][0]


@pytest.mark.slow
def test_killed_build_recovers(tmp_path: Path) -> None:
    """Kill a real JIT build mid-way (process group: python, ninja, compilers): torch's stale
    `lock` stays behind. The next load must not hang on it: it rebuilds, and a third process
    reuses that build."""
    cache = tmp_path / "cache"
    env = {**os.environ, "FSDPX_OPS_CACHE": str(cache)}
    proc = subprocess.Popen(
        [sys.executable, "-c", "from fsdpx.ops import load_ops; load_ops()"],
        cwd=REPO,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not list(cache.glob(f"cpu-*/{TORCH_BATON}")):
            assert proc.poll() is None, "the build ended before it could be killed"
            assert time.monotonic() < deadline, "the build never started"
            time.sleep(0.1)
        time.sleep(2.0)  # let ninja start the compilers
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    (build_dir,) = cache.glob("cpu-*")
    assert (build_dir / TORCH_BATON).exists()
    assert not (build_dir / _loader.COMPLETE_MARKER).exists()

    rebuilt = _probe({"FSDPX_OPS_CACHE": str(cache)}, timeout=900)
    assert rebuilt["available"] and rebuilt["adam_ok"] and rebuilt["warnings"] == [], rebuilt
    assert rebuilt["build_seconds"] is not None
    reused = _probe({"FSDPX_OPS_CACHE": str(cache)})
    assert reused["build_seconds"] is None and reused["library_path"] == rebuilt["library_path"]
    print(
        f"build after a killed build: {rebuilt['build_seconds']:.1f} s; "
        f"load from the cache in a new process: {reused['load_seconds']:.2f} s"
    )
