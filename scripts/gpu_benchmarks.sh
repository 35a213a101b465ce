#!/usr/bin/env bash
# The GPU rows of the benchmarks, as one short script for a lent GPU machine (one GPU):
# grouped expert compute (MoE), the MoE training table's single-GPU rows, long-sequence step
# time and memory, ZeRO++ step time on NCCL. Run after scripts/gpu_checks.sh has installed the wheels (or with PYTHONPATH set).
#
#   bash scripts/gpu_benchmarks.sh [OUT_DIR]
#
# Every step has its own timeout and log under OUT_DIR, so one failure loses nothing else.
set -u
out=${1:-${OUT:-/tmp/gpu_benchmarks}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
step() {  # name, timeout, command...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" 2>&1 | grep -v "^W1\|OMP_NUM_THREADS\|^\*\*\*" | tee "$out/$name.log"
    echo "$name rc=${PIPESTATUS[0]}" | tee -a "$out/benchmarks.txt"
}
want() {  # GPU_BENCH_STEPS="long_context zeropp ..." runs only those (default: all, in order)
    [ "${GPU_BENCH_STEPS:-all}" = all ] || [[ " $GPU_BENCH_STEPS " == *" $1 "* ]]
}
want long_context && step long_context ${LONG_TIMEOUT:-150} python3 -m torch.distributed.run \
    --standalone --nproc_per_node=1 benchmarks/long_context.py --device cuda --dim 1024 \
    --autocast bf16 --mlp-tile 4096 --seq 4096 --budget-mib 4096 \
    --sweep 8192 16384 32768 65536 131072 --steps 3
# One GPU: no bytes move (ratios print as NaN); the step time shows what the quantize /
# dequantize kernels cost next to plain ZeRO-3.
want zeropp && step zeropp ${ZEROPP_TIMEOUT:-150} python3 -m torch.distributed.run --standalone \
    --nproc_per_node=1 benchmarks/zeropp.py --device cuda --steps 50 --val-batches 4 \
    --cases zero3,qwz,qwz_qgz
# One GPU: the replicated layouts of the MoE training table (ep2 / ep4 skipped, printed).
want moe_train && step moe_train ${MOE_TRAIN_TIMEOUT:-150} python3 -m torch.distributed.run \
    --standalone --nproc_per_node=1 benchmarks/moe.py --device cuda --steps 20 --warmup 3
want moe_grouped && step moe_grouped ${MOE_TIMEOUT:-60} python3 benchmarks/moe_grouped.py \
    --device cuda --repeat 30
want moe_grouped_mixtral && step moe_grouped_mixtral ${MOE_TIMEOUT:-90} python3 \
    benchmarks/moe_grouped.py --device cuda --hidden 4096 --ffn 14336 --tokens 8192 --repeat 10
