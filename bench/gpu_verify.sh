#!/bin/bash
# A short GPU call (~2-3 minutes) after a change to the offload update or the step's host path: the CUDA
# offload tests, the 1B offload step ("none" and "cpu", one round) and where the host spends the bf16 GPT
# step (torch.profiler and cProfile). Outputs in $OUT: verify.log, profile.txt.
#
#     run(command="bash bench/gpu_verify.sh", timeout_s=200)
set -u
OUT=${OUT:-/tmp/fused_zero_gpu}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
[ -e fused_zero/kernels ] || ln -s ../kernels fused_zero/kernels
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
T0=$(date +%s)
{
    date -u; nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1 2>/dev/null
    timeout 55 python -m pytest -q -p no:cacheprovider tests/test_offload_cuda.py tests/test_transfer.py 2>&1 | tail -15
    echo "offload tests done at $(( $(date +%s) - T0 )) s"
    FUSED_ZERO_BENCH_TIERS=cpu FUSED_ZERO_BENCH_ROUNDS=1 timeout 70 python -m pytest -q -p no:cacheprovider \
        bench/bench_offload_gpu.py --benchmark-only -s 2>&1 | grep -E "offload on|step |passed|failed|Error"
    echo "offload bench done at $(( $(date +%s) - T0 )) s"
} >"$OUT/verify.log" 2>&1
timeout 40 python bench/profile_step.py --stage 2 --top 15 --cprofile 3 >"$OUT/profile.txt" 2>&1
echo "total $(( $(date +%s) - T0 )) s" >>"$OUT/verify.log"
