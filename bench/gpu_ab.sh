#!/bin/bash
# The whole step at world size 1 on a lent GPU, this tree against an earlier commit's, in one call
# (~3 minutes): bench_step.py -k cuda (torch's fused AdamW and ShardedOptimizer, fp32 + autocast and bf16)
# run base, head, base, head, each in its own process, then a profile of the fp32 GPT step (torch.profiler
# and cProfile; this tree's bench/profile_step.py over each tree's package) in each tree. For a step figure
# that moved between two GPU runs: the same machine and the same call read both commits (one such call,
# bench/results/h200_2026-11-27b_*, showed the step's times moving by a third between processes). Outputs in $OUT: ab.log (the medians side by side), profile_base.txt,
# profile_head.txt, ab_runN.log (each run's pytest output).
#
# Here, before the call (the base tree travels as an ignored folder named in carry):
#     x=$(git rev-parse --git-path info/exclude); grep -qx '/.ab/' "$x" || echo /.ab/ >>"$x"
#     rm -rf .ab && mkdir -p .ab/base && git archive BASE_COMMIT | tar -x -C .ab/base
#     run(command="bash bench/gpu_ab.sh .ab/base", carry=[".ab"], timeout_s=420)
#     run(command="FUSED_ZERO_AB_RUNS='base head' bash bench/gpu_ab.sh .ab/base", carry=[".ab"], timeout_s=280)
# (about 35 s a run and 15 s a profile on an H200; each run is boxed at 70 s and each profile at 45 s)
set -u
BASE=${1:?usage: bench/gpu_ab.sh BASE_TREE (a git archive of the earlier commit)}
OUT=${OUT:-/tmp/fused_zero_gpu}
mkdir -p "$OUT"
BASE=$(cd "$BASE" 2>/dev/null && pwd) && [ -d "$BASE/fused_zero" ] || { echo "no fused_zero tree at $1" >&2; exit 1; }
cd "$(dirname "$0")/.."
HEAD_TREE=$PWD
[ "$BASE" != "$HEAD_TREE" ] || { echo "the base tree is this tree" >&2; exit 1; }
for tree in "$HEAD_TREE" "$BASE"; do  # fused_zero.kernels is the top-level kernels/ (setup.py's package_dir)
    [ -e "$tree/fused_zero/kernels" ] || { rm -f "$tree/fused_zero/kernels"; ln -s ../kernels "$tree/fused_zero/kernels"; }
done
python -c "import pytest_benchmark" 2>/dev/null || pip install -q pytest pytest-benchmark 2>&1 | tail -1
export PYTHONUNBUFFERED=1
T0=$(date +%s)
LOG="$OUT/ab.log"
{
    date -u; nvidia-smi --query-gpu=name --format=csv,noheader
    for tree in "$BASE" "$HEAD_TREE"; do
        (cd /tmp && PYTHONPATH="$tree" python -c "import fused_zero; print('fused_zero from', fused_zero.__file__)")
    done
} >"$LOG" 2>&1
if [ "$(grep -c "^fused_zero from $BASE/" "$LOG")" != 1 ]; then  # the base runs must import the base tree
    echo "the base tree's fused_zero does not import from $BASE" | tee -a "$LOG" >&2
    exit 1
fi
n=0
RUNS=${FUSED_ZERO_AB_RUNS:-base head base head}  # (base head: one of each, for a short lease)
for label in $RUNS; do
    n=$((n + 1))
    tree=$HEAD_TREE; [ "$label" = base ] && tree=$BASE
    (cd "$tree" && PYTHONPATH="$tree" timeout 70 python -m pytest -q -p no:cacheprovider bench/bench_step.py \
        -k "cuda and not capturable" --benchmark-only --benchmark-json="/tmp/ab_$n.json" >"$OUT/ab_run$n.log" 2>&1)
    rc=$?
    echo "run $n ($label) exit $rc$([ $rc = 124 ] && echo ' TIMED OUT') at $(( $(date +%s) - T0 )) s" >>"$LOG"
done
RUNS="$RUNS" python - "$LOG" <<'EOF' >>"$LOG" 2>&1
import json, os, sys
rows = {}
for n, label in enumerate(os.environ["RUNS"].split(), 1):
    path = f"/tmp/ab_{n}.json"
    if not os.path.exists(path):
        print(f"run {n} ({label}): no results (see ab_run{n}.log)")
        continue
    try:
        benches = json.load(open(path))["benchmarks"]
    except ValueError:
        benches = []
    if not benches:
        print(f"run {n} ({label}): no benchmark results (no CUDA, or timed out: see ab_run{n}.log)")
    for b in benches:
        name = b["param"] if b.get("param") else b["name"]
        s = b["stats"]
        rows.setdefault(name, []).append(
            f"{label} {s['median'] * 1e3:.2f} ms (min {s['min'] * 1e3:.2f}, step() {b['extra_info'].get('optimizer_step_ms_median', 0):.2f})")
for name, cells in sorted(rows.items()):
    print(f"{name:28s} " + " | ".join(cells))
EOF
for label in base head; do
    tree=$HEAD_TREE; [ "$label" = base ] && tree=$BASE
    (cd /tmp && PYTHONPATH="$tree" timeout 45 python "$HEAD_TREE/bench/profile_step.py" --stage 2 --dtype fp32 \
        --top 15 --cprofile 3 >"$OUT/profile_$label.txt" 2>&1)
done
echo "total $(( $(date +%s) - T0 )) s" >>"$LOG"
