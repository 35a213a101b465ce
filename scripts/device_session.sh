#!/usr/bin/env bash
# Everything a lent GPU machine (one GPU, 16 cores) is used for in one call, its 16 cores
# split so the CPU benchmarks run quiet beside the GPU work:
#
#   cores 0-3    the `gpu` tests, then the GPU benchmark rows (scripts/gpu_checks.sh,
#                scripts/gpu_benchmarks.sh), then the monitor following 4,096 simulated ranks
#   cores 4-7    checkpoint save / load against DCP (scripts/quiet_benchmarks.sh's runs),
#                then the long-sequence per-token step times (4 ranks, 1 core each)
#   cores 8-15   0/1 Adam against Adam (two runs at once, 4 single-threaded gloo ranks each)
#
#   bash scripts/device_session.sh OUT_DIR
#
# Each part has its own timeout and logs, so one failure loses nothing else; the logs
# are packed into OUT_DIR/results.tar.gz (the device tool brings back few files).
set -u
out=${1:-${OUT:-/tmp/device_session}}
mkdir -p "$out/logs"
logs=$out/logs
export PYTHONUNBUFFERED=1
# The wheels into /tmp/site, PYTHONPATH set (once: scripts/gpu_env.sh).
source scripts/gpu_env.sh
quiet() {  # cores, log name, timeout, command... (CPU only, pinned)
    local cores=$1 name=$2 limit=$3
    shift 3
    CUDA_VISIBLE_DEVICES="" timeout "$limit" taskset -c "$cores" "$@" 2>&1 \
        | grep -v "^W1\|OMP_NUM_THREADS\|^\*\*\*" > "$logs/$name.log"
    echo "$name rc=${PIPESTATUS[0]}" >> "$logs/rc.txt"
}

gpu_part() {
    taskset -c 0-3 env GPU_VS_DS_OPTIMIZERS="${GPU_VS_DS_OPTIMIZERS:-none}" \
        bash scripts/gpu_checks.sh "$logs/gpu" >/dev/null 2>&1
    taskset -c 0-3 env GPU_BENCH_STEPS="${GPU_BENCH_STEPS:-long_context zeropp moe_train moe_grouped}" \
        bash scripts/gpu_benchmarks.sh "$logs/gpu" >/dev/null 2>&1
    # The monitor following 4,096 simulated ranks live (relay, publishers and TUI on 4 cores).
    quiet 0-3 monitor_cpu "${MONITOR_TIMEOUT:-120}" python3 benchmarks/monitor_cpu.py \
        --ranks 4096 --tables line --frames columnar --seconds 15 --repeat 2
}

checkpoint_part() {
    local scratch
    scratch=$(mktemp -d)
    for spec in "one_rank_two_threads 4-5 1 2 fp32" "two_ranks_two_cores 4-7 2 2 fp32" \
        "one_rank_two_threads_bf16 4-5 1 2 bf16" "two_ranks_one_core 4-5 2 1 fp32"; do
        set -- $spec
        quiet "$2" "checkpoint_$1" "${CKPT_TIMEOUT:-150}" python3 -m torch.distributed.run \
            --standalone --nproc_per_node="$3" --master_port=$((29600 + RANDOM % 300)) \
            benchmarks/checkpoint.py --params-m "${PARAMS_M:-300}" --threads "$4" --dtype "$5" \
            --dir "$scratch/$1"
        rm -rf "${scratch:?}/$1"
    done
    rm -rf "$scratch"
    # Long-sequence step time per token at sp 1, 2, 4 (4 single-core gloo ranks).
    quiet 4-7 long_context_cpu "${LONG_CPU_TIMEOUT:-90}" python3 -m torch.distributed.run \
        --standalone --nproc_per_node=4 --master_port=29960 benchmarks/long_context.py \
        --seq 1024 --budget-mib 16 --sweep 512 1024 2048 --steps 3
}

cpu_part() {
    # The two sides of the 1-bit comparison at once, 4 single-threaded ranks each.
    local onebit="--steps ${ONEBIT_STEPS:-800} --freeze-step ${ONEBIT_FREEZE:-160}"
    quiet 8-11 onebit_adam "${ONEBIT_TIMEOUT:-420}" python3 -m torch.distributed.run \
        --standalone --nproc_per_node=4 --master_port=29950 benchmarks/onebit.py $onebit \
        --only adam &
    quiet 12-15 onebit_zero_one_adam "${ONEBIT_TIMEOUT:-420}" python3 -m torch.distributed.run \
        --standalone --nproc_per_node=4 --master_port=29951 benchmarks/onebit.py $onebit \
        --only compressed --optimizer zero_one_adam \
        --var-update-scaler "${ONEBIT_VAR_UPDATE_SCALER:-64}" &
    wait
}

pack() { tar -czf "$out/results.tmp.tar.gz" -C "$out" logs && mv "$out/results.tmp.tar.gz" "$out/results.tar.gz"; }
nproc > "$logs/host.txt"
gpu_part &
checkpoint_part &
cpu_part &
# Packs what exists every 20 s, so a call cut off by its time limit still brings logs back.
while sleep 20; do pack; done &
packer=$!
wait %1 %2 %3
kill "$packer"
pack
