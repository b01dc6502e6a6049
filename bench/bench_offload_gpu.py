"""Optimizer-state offload on one GPU: the step of a 1B-parameter GPT in bf16 with the states on the host,
against the same step without offload, and the largest GPT each tier trains (skipped without CUDA).

    python -m pytest bench/bench_offload_gpu.py --benchmark-only -s
    FUSED_ZERO_BENCH_LARGEST=1 python -m pytest bench/bench_offload_gpu.py --benchmark-only -s   # + the search
    FUSED_ZERO_BENCH_TIERS=cpu FUSED_ZERO_BENCH_ROUNDS=1 python -m pytest ...   # none and cpu, one round

The model: examples/gpt.py with d_model 2048, 16 heads, vocab 32000 (tied), seq 1024; 20 layers is
1.07B parameters. World size 1, stage 2 (stage 3 for offload_params), bf16 parameters with fp32
masters. A step is FUSED_ZERO_BENCH_ACCUM micro-batches (default 4) of FUSED_ZERO_BENCH_MICRO
sequences (default 8), then step(): 32k tokens per step. The host update starts at step() (it needs the
whole step's norm and overflow verdict first: tiers/store_host.py says why). "cpu" builds the optimizer over
model.parameters(), so the update stays inside step(); "cpu-behind" builds it with the model and update_behind=True, so
the update runs behind step() bucket by bucket and the next forward waits per module for its own buckets
(behind_buckets.py). The ratio depends on how long the forward and backward run against the host's AdamW over
the shard: the tokens per step are printed with it.

Each configuration runs in a fresh process (peak device memory is per process); none and cpu
(and nvme, where FUSED_ZERO_OFFLOAD_DIR names a folder on a local disk) alternate over two rounds;
a figure is the median over its runs of the median step after two warm-up steps, timed from a
synchronize to a synchronize. Under each tier, where the host spent that step (medians, first round): until
the last backward returned, inside step(), and waiting for the GPU after it (what the host ran ahead of). The largest-model search starts at the planner's largest n_layer and
steps by a quarter until a step fails (CUDA out of memory, or the plan says the host cannot hold it), then
bisects; each trial is one process running two steps. Beside each tier's result it prints the planner's
largest n_layer for this machine
(fused_zero.plan.estimate on the model built on meta: device bytes within the GPU's memory, host bytes within
MemAvailable) and the planner's device and host bytes for the model that was measured. Each tier also prints
the host memory fused_zero page-locked (``transfer.locked_bytes()``) against the planner's ``host_pinned``,
and what torch's own pinned allocator held (small buffers; where the torch build reports it).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HERE = os.path.dirname(os.path.abspath(__file__))
MICRO = int(os.environ.get("FUSED_ZERO_BENCH_MICRO", "8"))
ACCUM = int(os.environ.get("FUSED_ZERO_BENCH_ACCUM", "4"))
STEPS, LAYERS_1B = 6, 20
ROUNDS = int(os.environ.get("FUSED_ZERO_BENCH_ROUNDS", "2"))
FOLDER = os.environ.get("FUSED_ZERO_OFFLOAD_DIR")
TIERS = {"none": dict(stage=2), "cpu": dict(stage=2, offload_optimizer="cpu"),
         "cpu-behind": dict(stage=2, offload_optimizer="cpu", update_behind=True),
         "cpu+params": dict(stage=3, offload_optimizer="cpu", offload_params="cpu"),
         "nvme": dict(stage=2, offload_optimizer="nvme")}

_CHILD = r"""
import json, resource, statistics, sys, time, torch
sys.path.insert(0, sys.argv[1])
from gpt import GPT, GPTConfig, synthetic_batch
from fused_zero import ShardedOptimizer
from fused_zero.tiers.transfer import locked_bytes
def _torch_pinned():
    stats = getattr(torch.cuda, "host_memory_stats", None)  # torch's pinned allocator (not all versions)
    try:
        return int(stats()["allocated_bytes.all.current"]) if stats else None
    except Exception:
        return None
layers, steps, micro, accum, kw = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), json.loads(sys.argv[6])
cfg = GPTConfig(vocab=32000, d_model=2048, n_layer=layers, n_head=16, seq_len=1024, tie_weights=True)
GPT.reset_parameters = lambda self, seed: None  # drawn on the device below: the CPU draw of billions is slow
try:
    with torch.device("cuda"):
        model = GPT(cfg).to(torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    params = model.num_params()  # before stage 3 releases them
    with_model = kw.get("update_behind", False) or kw["stage"] == 3  # stages 1-2: the update behind step()
    opt = ShardedOptimizer(model if with_model else model.parameters(), lr=1e-4, **kw)
    batches = [synthetic_batch(cfg, micro, step=0, rank=m, device="cuda") for m in range(accum)]  # made once
    times, parts = [], []
    for t in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.zero_grad()
        for idx, tgt in batches:
            _, loss = model(idx, tgt)
            (loss / accum).backward()
        backward_host = time.perf_counter()  # the host's view, no sync: where step() begins
        opt.step()
        stepped = time.perf_counter()
        torch.cuda.synchronize()
        end = time.perf_counter()
        times.append(end - start)
        parts.append((backward_host - start, stepped - backward_host, end - stepped))
    keep = parts[2:] or parts[-1:]
    out = {"ok": True, "step_s": statistics.median(times[2:]) if len(times) > 2 else times[-1],
           "phases": [statistics.median(p[i] for p in keep) for i in range(3)],
           "params": params, "peak_device": torch.cuda.max_memory_allocated(),
           "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "mem": opt.memory_bytes(),
           "pinned": locked_bytes(), "torch_pinned": _torch_pinned(),
           "loss": loss.item()}
    opt.close()
except torch.OutOfMemoryError as e:
    out = {"ok": False, "why": "CUDA out of memory"}
print(json.dumps(out))
"""


def _run(tier: str, layers: int, steps: int) -> dict:
    kw = dict(TIERS[tier])
    if tier == "nvme":
        kw["nvme_path"] = FOLDER
    argv = [sys.executable, "-c", _CHILD, os.path.join(HERE, "..", "examples"), str(layers), str(steps), str(MICRO),
            str(ACCUM), json.dumps(kw)]
    done = subprocess.run(argv, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return {"ok": False, "why": (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1]}
    return json.loads(lines[-1])


def _timed_tiers() -> list[str]:
    """FUSED_ZERO_BENCH_TIERS (comma-separated, "none" always first) picks some; default every tier."""
    picked = os.environ.get("FUSED_ZERO_BENCH_TIERS")
    if picked:
        return ["none"] + [t for t in picked.split(",") if t in TIERS and t != "none"]
    return ["none", "cpu", "cpu-behind"] + (["nvme"] if FOLDER else [])


@pytest.fixture(scope="module")
def step_results():
    runs = {t: [] for t in _timed_tiers()}
    for _ in range(ROUNDS):
        for t in runs:
            runs[t].append(_run(t, LAYERS_1B, STEPS))
    for t, rs in runs.items():
        bad = [r for r in rs if not r["ok"]]
        assert not bad, (t, bad)
    res = {t: dict(rs[0], step_s=statistics.median(r["step_s"] for r in rs)) for t, rs in runs.items()}
    tokens = MICRO * ACCUM * 1024
    print(f"\noffload on {torch.cuda.get_device_name()}: GPT {res['none']['params'] / 1e9:.2f}B bf16, world 1, "
          f"{tokens} tokens per step ({ACCUM} x {MICRO} x 1024)")
    for t, r in res.items():
        planned = _planned(t, LAYERS_1B).detail["host_pinned"] if t in PLANNED else None
        pinned = "" if planned is None else (f"  page-locked {r['pinned'] / 2**30:.2f} GiB (planned "
                                             f"{planned / 2**30:.2f}; torch's pinned allocator "
                                             f"{(r['torch_pinned'] or 0) / 2**20:.1f} MiB)")
        print(f"  {t:10s} step {r['step_s']:.3f} s ({r['step_s'] / res['none']['step_s']:.2f}x)  peak device "
              f"{r['peak_device'] / 2**30:.1f} GiB  peak host RSS {r['peak_rss'] / 2**30:.1f} GiB{pinned}")
        fb, st, tail = r["phases"]
        print(f"  {'':10s} host: forward+backward {fb:.3f} s, step() {st:.3f} s, then the GPU's tail {tail:.3f} s")
    return res


@pytest.mark.parametrize("tier", ["none", "cpu", "cpu-behind", "nvme"])
def test_offload_step_gpu(benchmark, step_results, tier):
    if tier not in step_results:
        pytest.skip("not timed in this run (FUSED_ZERO_BENCH_TIERS picks tiers; nvme needs FUSED_ZERO_OFFLOAD_DIR)")
    r = step_results[tier]
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)  # the figures come from the child processes
    benchmark.extra_info.update(tier=tier, device=torch.cuda.get_device_name(), step_s=r["step_s"],
                                step_ratio=r["step_s"] / step_results["none"]["step_s"], params=r["params"],
                                peak_device=r["peak_device"], peak_rss=r["peak_rss"],
                                tokens_per_step=MICRO * ACCUM * 1024, host_phases_s=r["phases"])


def _largest(tier: str) -> tuple[int, dict]:
    """The most layers (and that run's figures) with which ``tier`` trains two steps. The search starts at the
    planner's largest for this machine and steps by a quarter from there (a handful of trials, each a process
    building a model of billions of parameters), then bisects to within ~6%. A size whose planned host bytes
    exceed the host memory available counts as failing without being run: a host out of memory can take the
    machine down with it, not just the trial."""
    host = _host_memory()

    def trial(n):
        if _planned(tier, n).host > host:
            return {"ok": False, "why": "planned host bytes exceed MemAvailable"}
        return _run(tier, n, 2)
    fits, fails, best = 0, None, {}
    layers = max(1, _planned_largest(tier))
    while fails is None:
        r = trial(layers)
        if r["ok"]:
            fits, best, layers = layers, r, max(layers + 1, layers * 5 // 4)
        else:
            fails = layers
            if fits == 0 and layers > 1:  # the plan's size failed: step down until one fits
                layers = max(1, layers * 3 // 4)
                while fits == 0:
                    r = trial(layers)
                    if r["ok"]:
                        fits, best = layers, r
                    elif layers == 1:
                        return 0, r
                    else:
                        fails, layers = layers, max(1, layers * 3 // 4)
    while fails - fits > max(1, fits // 16):  # bisect to within ~6%
        mid = (fits + fails) // 2
        r = trial(mid)
        if r["ok"]:
            fits, best = mid, r
        else:
            fails = mid
    return fits, best


#: each timed tier as the planner names it: (stage, offload)
PLANNED = {"none": (2, "none"), "cpu": (2, "opt=cpu"), "cpu-behind": (2, "opt=cpu"),
           "cpu+params": (3, "opt=cpu,params=cpu"),
           "nvme": (2, "opt=nvme")}


def _host_memory() -> int:
    """Bytes of host memory available now (MemAvailable): what an offload tier may fill."""
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def _planned(tier: str, layers: int):
    """The planner's estimate of ``tier`` for the GPT of ``layers`` layers on this machine (built on meta)."""
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    from gpt import GPT, GPTConfig
    from fused_zero.plan import estimate

    cfg = GPTConfig(vocab=32000, d_model=2048, n_layer=layers, n_head=16, seq_len=1024, tie_weights=True)
    reset, GPT.reset_parameters = GPT.reset_parameters, lambda self, seed: None
    try:
        with torch.device("meta"):
            model = GPT(cfg).to(torch.bfloat16)
    finally:
        GPT.reset_parameters = reset
    plan = estimate(model=model, gpu_memory=torch.cuda.get_device_properties(0).total_memory, headroom=0.0,
                    seq_len=1024, micro_batch=MICRO, hidden=2048, layers=layers, heads=16)
    return plan.stage(*PLANNED[tier])


def _planned_largest(tier: str) -> int:
    """The most layers the planner says fit: device bytes within the GPU's memory, host bytes within what is
    available now (bisected as the measured search is)."""
    gpu, host = torch.cuda.get_device_properties(0).total_memory, _host_memory()

    def fits(n):
        s = _planned(tier, n)
        return s.total <= gpu and s.host <= host
    lo, hi = 0, 8
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@pytest.mark.skipif(os.environ.get("FUSED_ZERO_BENCH_LARGEST") != "1", reason="set FUSED_ZERO_BENCH_LARGEST=1")
@pytest.mark.parametrize("tier", [t for t in TIERS if t != "cpu-behind"])  # the same memory as "cpu"
def test_largest_model_per_tier(benchmark, tier):
    if tier == "nvme" and not FOLDER:
        pytest.skip("set FUSED_ZERO_OFFLOAD_DIR to a folder on a local disk")
    layers, r = _largest(tier)
    planned = _planned_largest(tier)
    plan = _planned(tier, layers)  # the planner's bytes for the model that was measured
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    print(f"\n  largest with {tier}: {layers} layers, {r.get('params', 0) / 1e9:.2f}B params; planner: {planned} "
          f"layers ({planned / max(layers, 1):.2f}x); peak device {r.get('peak_device', 0) / 2**30:.1f} GiB "
          f"(planned {plan.total / 2**30:.1f}), host {r.get('mem', {}).get('host', 0) / 2**30:.1f} GiB "
          f"(planned {plan.host / 2**30:.1f}), page-locked {r.get('pinned', 0) / 2**30:.1f} GiB (planned "
          f"{plan.detail['host_pinned'] / 2**30:.1f})")
    benchmark.extra_info.update(tier=tier, device=torch.cuda.get_device_name(), layers=layers,
                                planned_layers=planned, planned_device=plan.total, planned_host=plan.host, **r)
