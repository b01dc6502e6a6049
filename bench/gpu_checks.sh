#!/bin/bash
# Every GPU check of the open issues in one call on a lent GPU (the device tool's `run`): tests that need
# CUDA, the kernels' benchmarks, the step against torch, the offload step, and a profiler summary of one
# step. Outputs go to $OUT (the device tool brings back at most 8 files): env.txt, cuda_tests.log, bench.json
# + bench.log, offload.log, profile.txt (+ capacity.log). On the H200 on 2026-11-26 parts 1-4 took about
# 420 s; the capacity search (FUSED_ZERO_GPU_CAPACITY=SECONDS) needs more than the rest of a 600 s call for
# its offload tiers (each trial builds a model of billions of parameters in host memory): give it a call of
# its own, or what a 15-minute lease leaves after a shorter first call.
#
#     run(command="bash bench/gpu_checks.sh", timeout_s=600)
#     run(command="FUSED_ZERO_GPU_CAPACITY=540 FUSED_ZERO_GPU_CAPACITY_ONLY=1 bash bench/gpu_checks.sh", timeout_s=600)
#
# A step figure that moved between two GPU runs: bench/gpu_ab.sh measures this tree and an earlier commit's in
# one call (its header says how to carry the earlier tree).
#
# Each part has its own time box, so one that hangs or runs long leaves the others their time; a part
# that ran past its box says so in its log ("TIMED OUT"). Commit what comes back under
# bench/results/<device>_<date>_*, name the device, and put the figures in the README.
set -u
OUT=${OUT:-/tmp/fused_zero_gpu}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
box() {  # box SECONDS LOG COMMAND...: run COMMAND with its output in LOG, marked if it ran past SECONDS
    local seconds=$1 log=$2; shift 2
    echo "\$ $*" >>"$log"
    timeout "$seconds" "$@" >>"$log" 2>&1
    local rc=$?
    [ $rc -eq 124 ] && echo "TIMED OUT after ${seconds}s" >>"$log"
    echo "exit $rc" >>"$log"
}
T0=$(date +%s)
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1  # (offline: no build isolation)
    python -c "import pytest_benchmark" 2>/dev/null || pip install -q pytest pytest-benchmark 2>&1 | tail -1
} >"$OUT/env.txt" 2>&1
# Where the editable install cannot build offline, the package imports from the tree: fused_zero.kernels is
# the top-level kernels/ folder (setup.py's package_dir), linked in place.
if ! python -c "import fused_zero.kernels" 2>/dev/null; then
    [ -e fused_zero/kernels ] || ln -s ../kernels fused_zero/kernels
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
python -c "import fused_zero.kernels, fused_zero; print('fused_zero from', fused_zero.__file__)" >>"$OUT/env.txt" 2>&1

if [ -z "${FUSED_ZERO_GPU_CAPACITY_ONLY:-}" ]; then  # parts 1-4 (FUSED_ZERO_GPU_CAPACITY_ONLY=1: the search alone)
# 1. The tests with CUDA paths (kernels against their twins, the sync-free step under
#    set_sync_debug_mode("error"), offload's CUDA paths, the transfers, capturable=True's CUDA graph),
#    then the GPU acceptance benches.
box 180 "$OUT/cuda_tests.log" python -m pytest -q -p no:cacheprovider tests/test_offload_cuda.py \
    tests/test_transfer.py tests/test_host_reads.py tests/test_quant.py tests/test_pack.py tests/test_cast.py \
    tests/test_norm.py tests/test_adamw.py tests/test_habits_contract.py tests/test_step_graph_cuda.py
# 2. Kernels (GB/s and % of measured copy bandwidth) and the whole step against torch's fused AdamW.
box 170 "$OUT/bench.log" python -m pytest -q -p no:cacheprovider bench/bench_pack.py bench/bench_quant.py \
    bench/bench_adamw.py bench/bench_step.py -k "cuda or pack or quant or adamw" --benchmark-only \
    --benchmark-json="$OUT/bench.json" -s
# 3. Offload on one GPU: the 1B GPT in bf16, "cpu" (update inside step()) and "cpu-behind" (the update behind
#    step(), the optimizer built with the model) against no offload; 125 s on the H200 with three tiers
#    (the capacity search is part 5).
box 200 "$OUT/offload.log" python -m pytest -q -p no:cacheprovider bench/bench_offload_gpu.py --benchmark-only -s
#    and the host update per million elements on this machine's CPU against its fp32 copy (what bounds "cpu")
box 30 "$OUT/offload.log" python -m pytest -q -p no:cacheprovider bench/bench_host_update.py --benchmark-only \
    --benchmark-columns=min,median,iqr
# 4. Where one step spends its time: the GPT at stages 2 and 3, and the host-bound residual blocks.
for args in "--stage 2 --cprofile 3" "--stage 3" "--stage 2 --blocks 200 --dtype fp32"; do
    box 50 "$OUT/profile.txt" python bench/profile_step.py $args --top 12
done
fi
# 5. With FUSED_ZERO_GPU_CAPACITY=SECONDS: the capacity table (largest GPT per tier against the planner), one
#    micro-batch of 1024 tokens per step so that each trial is short; tiers in order none, cpu, cpu+params.
if [ -n "${FUSED_ZERO_GPU_CAPACITY:-}" ]; then
    FUSED_ZERO_BENCH_LARGEST=1 FUSED_ZERO_BENCH_MICRO=1 FUSED_ZERO_BENCH_ACCUM=1 box "$FUSED_ZERO_GPU_CAPACITY" \
        "$OUT/capacity.log" python -m pytest -q -p no:cacheprovider bench/bench_offload_gpu.py -k largest \
        --benchmark-only -s
fi
echo "total $(( $(date +%s) - T0 )) s" >>"$OUT/env.txt"
