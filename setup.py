"""Opt-in ahead-of-time build of fsdpx's native ops (everything else is in pyproject.toml).

Without FSDPX_BUILD_OPS=1 this calls plain `setup()`, so `pip install -e .` and wheels are
pure Python exactly as before, and the ops are JIT-built on first use (fsdpx/ops/_loader.py).
With it, the same sources and flags the JIT build uses are compiled at install time into
fsdpx/ops/_fsdpx_ops_cpu*.so (and _fsdpx_ops_cuda*.so where torch has CUDA and nvcc is found),
each with a sidecar JSON naming the torch version and the sources' hash; the loader prefers
such a library when the sidecar matches and says so when it does not:

    FSDPX_BUILD_OPS=1 pip install --no-build-isolation -e .     # or without -e

--no-build-isolation is required: the build compiles against the torch you will run with,
which pip's isolated build environment does not contain.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from setuptools import setup

HERE = Path(__file__).resolve().parent


def _loader() -> Any:
    """fsdpx/ops/_loader.py, loaded by path (the package itself is not importable yet)."""
    spec = importlib.util.spec_from_file_location(
        "_fsdpx_ops_loader", HERE / "fsdpx/ops/_loader.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def _ops_build() -> dict[str, Any]:
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:
        raise SystemExit(
            "FSDPX_BUILD_OPS=1 compiles against the installed torch, which this build "
            f"environment cannot import ({e}). Install torch first, then run "
            "`FSDPX_BUILD_OPS=1 pip install --no-build-isolation .`"
        ) from e
    loader = _loader()

    def rel(paths: list[Path]) -> list[str]:
        return [os.path.relpath(p, HERE) for p in paths]

    ext_modules = [
        cpp_extension.CppExtension(
            f"fsdpx.ops._{loader.CPU_NAME}",
            rel(loader.cpu_sources()),
            include_dirs=[str(loader.CSRC)],
            # -g0: Python's own CFLAGS add -g (a 9.5 MB library instead of 0.6 MB).
            extra_compile_args={"cxx": [*loader.CPU_CFLAGS, "-g0"]},
            extra_link_args=loader.CPU_LDFLAGS,
        )
    ]
    keys = {f"_{loader.CPU_NAME}": loader.build_key("cpu")}
    if torch.version.cuda and cpp_extension.CUDA_HOME and loader.cuda_sources():
        # The CUDA library registers kernels only; its schemas come from the CPU library.
        ext_modules.append(
            cpp_extension.CUDAExtension(
                f"fsdpx.ops._{loader.CUDA_NAME}",
                rel(loader.cuda_sources()),
                include_dirs=[str(loader.CSRC)],
                extra_compile_args={"cxx": [*loader.CPU_CFLAGS, "-g0"], "nvcc": loader.CUDA_CFLAGS},
                extra_link_args=loader.CPU_LDFLAGS,
            )
        )
        keys[f"_{loader.CUDA_NAME}"] = loader.build_key("cuda")

    class BuildOps(cpp_extension.BuildExtension):  # type: ignore[misc]
        """Builds the libraries, then writes each one's sidecar next to it."""

        def run(self) -> None:
            super().run()
            for ext in self.extensions:
                stem = ext.name.rsplit(".", 1)[1]
                info = {"torch": torch.__version__, "key": keys[stem]}
                # Next to the library: in build/lib for a wheel, in the source tree for
                # an editable or --inplace build (setuptools copies the library there).
                target = Path(self.get_ext_fullpath(ext.name)).parent
                target.mkdir(parents=True, exist_ok=True)
                (target / f"{stem}.json").write_text(json.dumps(info))

    return {"ext_modules": ext_modules, "cmdclass": {"build_ext": BuildOps}}


setup(**(_ops_build() if os.environ.get("FSDPX_BUILD_OPS") == "1" else {}))
