#!/usr/bin/env bash
# CPU benchmarks on a quiet host with spare cores (a lent GPU machine has 16): checkpoint
# save / load against DCP (issue 22) and the DeepSpeed import against zero_to_fp32 (issue
# 17). On the shared 2-core dev machine their wall times swing 2-3x with load; here each
# run is pinned with taskset to exactly the cores it is said to use.
#
#   bash scripts/quiet_benchmarks.sh [OUT_DIR]     (PARAMS_M: checkpoint model size, 150)
#
# Needs what scripts/gpu_checks.sh installs (zstandard; deepspeed for zero_to_fp32, else
# that column is skipped). Every step has its own timeout and log under OUT_DIR.
set -u
out=${1:-${OUT:-/tmp/quiet_benchmarks}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# CPU benchmarks: on a GPU host the checkpoint benchmark would otherwise pick NCCL.
export CUDA_VISIBLE_DEVICES=""
params=${PARAMS_M:-150}
scratch=$(mktemp -d)
nproc | tee "$out/host.txt"
ckpt() {  # name, cores, ranks, extra args...
    local name=$1 cores=$2 ranks=$3
    shift 3
    timeout "${CKPT_TIMEOUT:-150}" taskset -c "$cores" python3 -m torch.distributed.run \
        --standalone --nproc_per_node="$ranks" benchmarks/checkpoint.py --params-m "$params" \
        --dir "$scratch/$name" "$@" 2>&1 | grep -v "^W1\|OMP_NUM_THREADS\|^\*\*\*" | tee "$out/checkpoint_$name.log"
    echo "checkpoint $name rc=${PIPESTATUS[0]}" | tee -a "$out/host.txt"
    rm -rf "${scratch:?}/$name"
}
timeout "${IMPORT_TIMEOUT:-150}" taskset -c 0-1 python3 benchmarks/deepspeed_import.py \
    --repeat 3 --deepspeed-python python3 2>&1 | tee "$out/deepspeed_import.log"
echo "deepspeed_import rc=${PIPESTATUS[0]}" | tee -a "$out/host.txt"
ckpt two_cores_per_rank 0-3 2 --threads 2
ckpt one_core_per_rank 0-1 2 --threads 1
ckpt bf16_two_cores_per_rank 0-3 2 --threads 2 --dtype bf16
rm -rf "$scratch"
