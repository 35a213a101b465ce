#!/usr/bin/env bash
# Compile fsdpx's CUDA sources against the CUDA build of torch, without needing a GPU.
#
# The project's .venv holds the CPU build of torch, which cannot compile .cu files (it has no
# CUDA headers or libtorch_cuda). This script keeps a side virtual environment OUTSIDE the
# repository with the CUDA build (torch==2.14.1, installed from the local wheel mirror),
# created once and reused, then JIT-compiles every fsdpx/ops/csrc/cuda/*.cu together with
# fsdpx/ops/csrc/*.cpp (the schemas live there) into one extension with
# torch.utils.cpp_extension, loads it and checks that every fsdpx op has a CUDA kernel.
#
# Usage:  scripts/check_cuda_build.sh            # prints build time and "OK", exit 0
# Env:    FSDPX_CUDA_VENV        side venv (default ~/.cache/fsdpx/cuda-build-venv)
#         FSDPX_CUDA_TORCH       torch requirement (default torch==2.14.1)
#         PYTHON                 interpreter that creates the venv (default python3.11)
#         TORCH_CUDA_ARCH_LIST   GPU architectures to build (default 9.0: one arch keeps it fast)
#         CUDA_HOME              toolkit (default /usr/local/cuda)
#         MAX_JOBS               parallel compile jobs (default 2)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${FSDPX_CUDA_VENV:-$HOME/.cache/fsdpx/cuda-build-venv}"
torch_spec="${FSDPX_CUDA_TORCH:-torch==2.14.1}"
python="${PYTHON:-python3.11}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-2}"
stamp="$venv/.fsdpx-ready"

if [[ ! -x "$CUDA_HOME/bin/nvcc" ]]; then
    echo "check_cuda_build: no nvcc at $CUDA_HOME/bin/nvcc; set CUDA_HOME to a CUDA toolkit" >&2
    exit 2
fi

# The stamp is written only after a complete install, so an interrupted install (killed pip,
# full disk) is redone from scratch instead of leaving a half-populated venv in use.
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$torch_spec" ]]; then
    echo "check_cuda_build: creating $venv with $torch_spec (one-time, several GB)"
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install --quiet "$torch_spec" ninja setuptools
    "$venv/bin/python" -c \
        "import torch, sys; sys.exit(0 if torch.version.cuda else 'torch has no CUDA')"
    printf '%s' "$torch_spec" > "$stamp"
fi

build_dir="$(mktemp -d "${TMPDIR:-/tmp}/fsdpx-cuda-build.XXXXXX")"
trap 'rm -rf "$build_dir"' EXIT

cd "$repo"
"$venv/bin/python" -W "ignore:Failed to initialize NumPy" - "$build_dir" <<'EOF'
import importlib.util
import os
import sys
import time

import torch
from torch.utils import cpp_extension

# The loader's own source lists and flags (loaded by path: importing the fsdpx package would
# need its dependencies in this venv), so this checks what a CUDA machine will build.
spec = importlib.util.spec_from_file_location("fsdpx_loader", "fsdpx/ops/_loader.py")
loader = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = loader  # dataclasses look their module up while it executes
spec.loader.exec_module(loader)

build_dir = sys.argv[1]
cpp = [str(p) for p in loader.cpu_sources()]
cu = [str(p) for p in loader.cuda_sources()]
if not any(s.endswith(".cu") for s in cu):
    sys.exit("check_cuda_build: no fsdpx/ops/csrc/cuda/*.cu found")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST')}")
print("sources:", " ".join(p.split("fsdpx/ops/csrc/")[-1] for p in cpp + cu))
start = time.perf_counter()
cpp_extension.load(
    name="fsdpx_cuda_build_check",
    sources=cpp + cu,
    build_directory=build_dir,
    extra_cflags=loader.CPU_CFLAGS,
    extra_cuda_cflags=loader.CUDA_CFLAGS,
    extra_ldflags=loader.CPU_LDFLAGS,
    extra_include_paths=[str(loader.CSRC)],
    with_cuda=True,
    is_python_module=False,
    verbose=False,
)
elapsed = time.perf_counter() - start
# Loading the library ran the static registrations (a missing symbol or a schema mismatch
# fails here, not only at compile time). List which ops got a CUDA kernel.
ops = sorted(
    name for name in torch._C._dispatch_get_all_op_names() if name.startswith("fsdpx::")
)
cuda = [n for n in ops if torch._C._dispatch_has_kernel_for_dispatch_key(n, "CUDA")]
print(f"ops with a CUDA kernel: {' '.join(cuda) or 'none'}")
print(f"ops without one: {' '.join(sorted(set(ops) - set(cuda))) or 'none'}")
print(f"check_cuda_build: OK, compiled {len(cpp) + len(cu)} sources in {elapsed:.1f} s")
EOF
