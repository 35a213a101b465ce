#!/usr/bin/env bash
# Create .venv (Python >= 3.10) with the CPU build of torch and fsdpx installed editable
# with its dev tools and the monitor's dependencies. Idempotent: a second run reuses .venv and skips pip while
# pyproject.toml is unchanged.
#
# TORCH_SPEC picks the torch requirement (default torch==2.13.0; it is installed first so
# that pip does not pull a CUDA build of torch as a dependency). TORCH_PIP_ARGS adds pip
# arguments for that step only, e.g. an index URL that serves CPU wheels.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
stamp=.venv/.fsdpx-setup
want="$(cat pyproject.toml; echo "$TORCH_SPEC")"

if [[ ! -x .venv/bin/python ]]; then
    "$PYTHON" -m venv .venv
fi
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && .venv/bin/python -c "import fsdpx" 2>/dev/null; then
    echo "setup: .venv is up to date"
    exit 0
fi
# shellcheck disable=SC2086  # TORCH_PIP_ARGS is a list of arguments
.venv/bin/pip install --quiet "$TORCH_SPEC" ${TORCH_PIP_ARGS:-}
.venv/bin/pip install --quiet -e '.[dev,monitor,hf]'
printf '%s' "$want" > "$stamp"
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
