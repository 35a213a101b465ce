#!/usr/bin/env bash
# The GPU checks of a session, as one short script for a lent GPU machine (see README
# "Tests"): the `gpu`-marked tests, then fsdpx vs DeepSpeed step time on one model.
#
#   bash scripts/gpu_checks.sh [OUT_DIR] [pytest args...]
#
# The machine's image has torch, pytest, hypothesis, msgpack, numpy, ninja and nvcc; what it
# lacks (zstandard; deepspeed and its pydantic/hjson for the comparison) comes as wheels in
# .whl/ (built or downloaded on the dev machine; `pip wheel --no-deps deepspeed==X` with
# DS_BUILD_OPS=0 gives a pure-Python wheel, DS_ACCELERATOR=cuda picks CUDA at run time).
# Every step has its own timeout and log under OUT_DIR, so one failure loses nothing else.
set -u
out=${1:-${OUT:-/tmp/gpu_checks}}
shift || true
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# The wheels into /tmp/site, PYTHONPATH set (once: scripts/gpu_env.sh).
source scripts/gpu_env.sh
nvidia-smi -L | tee "$out/device.txt"
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())' \
    | tee -a "$out/device.txt"

timeout "${GPU_PYTEST_TIMEOUT:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors "$@" tests \
    2>&1 | tee "$out/pytest_gpu.log"
echo "pytest -m gpu rc=${PIPESTATUS[0]}" | tee -a "$out/device.txt"

if python3 -c 'import deepspeed' 2>/dev/null; then
    for opt in ${GPU_VS_DS_OPTIMIZERS:-torch}; do
        [ "$opt" = none ] && continue  # GPU_VS_DS_OPTIMIZERS=none: tests only
        # DeepSpeed's JIT op builder cannot parse the image's "9.0a" arch entry.
        TORCH_CUDA_ARCH_LIST=9.0 DS_ACCELERATOR=cuda timeout "${GPU_VS_DS_TIMEOUT:-150}" python3 benchmarks/vs_deepspeed.py \
            --stages 1 2 3 --steps 15 --warmup 3 --optimizer "$opt" \
            2>&1 | tee "$out/vs_deepspeed_$opt.log"
        echo "vs_deepspeed $opt rc=${PIPESTATUS[0]}" | tee -a "$out/device.txt"
    done
fi
