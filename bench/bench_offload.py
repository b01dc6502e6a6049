"""Optimizer-state offload on CPU: peak RSS and step time, NVMe and host tiers against in-memory.

    python -m pytest bench/bench_offload.py --benchmark-only -s

A 60M-parameter fp32 MLP (8 layers of 2736 x 2736, world size 1, stage 2), 6 steps per run.
Each configuration runs in a fresh process (peak RSS is per process: ru_maxrss), and the
configurations alternate (none, nvme, cpu, none, nvme, cpu, ...; three rounds), so drift hits them alike; each
figure is the median over its runs of the median step time. The optimizer state in memory is 8 bytes
per parameter (exp_avg, exp_avg_sq: fp32 parameters at stage 2 are their own master; offloaded, the tiers
keep a 4-byte master too); the acceptance: NVMe offload lowers peak
RSS by at least 70% of it, at no more than 1.5x the in-memory step time. ``nvme_direct`` streams the
state files with O_DIRECT: no page cache, so every step reads and writes the whole state from the
disk and its time is the disk's; FUSED_ZERO_BENCH_DIRECT=1 adds it to the rotation (its disk traffic
then slows the runs after it: measure the acceptance without it).
FUSED_ZERO_OFFLOAD_DIR picks the folder for the NVMe files (default: a temporary folder).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

import pytest

WIDTH, LAYERS, STEPS, ROUNDS = 2736, 8, 6, 3
# nvme_direct only on request: its disk traffic (1.4 GB a step here) slows the runs that follow it
CONFIGS = ("none", "nvme", "cpu") + (("nvme_direct",) if os.environ.get("FUSED_ZERO_BENCH_DIRECT") == "1" else ())

_CHILD = r"""
import json, resource, sys, time, torch
from fused_zero import ShardedOptimizer
torch.manual_seed(0)
width, layers, steps, tier, folder = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
kw = {} if tier == "none" else {"offload_optimizer": tier.split("_")[0]}
if tier.startswith("nvme"):
    kw.update(nvme_path=folder, nvme_direct=tier == "nvme_direct")
opt = ShardedOptimizer(model.parameters(), lr=1e-4, stage=2, **kw)
x = torch.randn(16, width)
times = []
for _ in range(steps):
    t = time.perf_counter()
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    times.append(time.perf_counter() - t)
params = sum(p.numel() for p in model.parameters())
print(json.dumps({"step_s": sorted(times[1:])[len(times[1:]) // 2], "peak_rss": resource.getrusage(
    resource.RUSAGE_SELF).ru_maxrss * 1024, "params": params, "mem": opt.memory_bytes()}))
opt.close()
"""


def _run(tier: str, folder: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(WIDTH), str(LAYERS), str(STEPS), tier, folder],
                         capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def _state_bytes(res: dict) -> int:
    """The in-memory run's optimizer state as memory_bytes() reports it (fp32 parameters at stages 1-2 keep no
    separate master: 8 bytes a parameter, not 12)."""
    mem = res["none"]["mem"]
    return mem["master"] + mem["exp_avg"] + mem["exp_avg_sq"]


@pytest.fixture(scope="module")
def offload_results():
    folder = os.environ.get("FUSED_ZERO_OFFLOAD_DIR") or tempfile.mkdtemp()
    runs = {c: [] for c in CONFIGS}
    load_before = os.getloadavg()[0]  # a shared machine: the figures are only as steady as its load
    for _ in range(ROUNDS):
        for c in CONFIGS:
            runs[c].append(_run(c, folder))
    load_after = os.getloadavg()[0]
    res = {c: {"step_s": statistics.median(r["step_s"] for r in rs), "peak_rss": min(r["peak_rss"] for r in rs),
               "params": rs[0]["params"], "mem": rs[0]["mem"]} for c, rs in runs.items()}
    state = _state_bytes(res)
    print(f"\noffload, CPU, world 1, {res['none']['params'] / 1e6:.1f}M fp32 params, in-memory optimizer "
          f"state {state / 2**20:.0f} MiB; {ROUNDS} alternating rounds of {STEPS} steps; 1-minute load average "
          f"{load_before:.1f} before, {load_after:.1f} after, on {os.cpu_count()} CPUs")
    for c in CONFIGS:
        r = res[c]
        saved = res["none"]["peak_rss"] - r["peak_rss"]
        print(f"  {c:5s} step {r['step_s']:.3f} s ({r['step_s'] / res['none']['step_s']:.2f}x)  peak RSS "
              f"{r['peak_rss'] / 2**20:.0f} MiB (saved {saved / 2**20:.0f} MiB = {saved / state:.0%} of the state)")
    return res


@pytest.mark.parametrize("tier", ("none", "nvme", "cpu", "nvme_direct"))
def test_offload_step(benchmark, offload_results, tier):
    if tier not in offload_results:
        pytest.skip("set FUSED_ZERO_BENCH_DIRECT=1 to time nvme_direct=True")
    r = offload_results[tier]
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)  # the figures come from the child processes
    state = _state_bytes(offload_results)
    benchmark.extra_info.update(tier=tier, step_s=r["step_s"], peak_rss=r["peak_rss"], params=r["params"],
                                step_ratio=r["step_s"] / offload_results["none"]["step_s"],
                                rss_saved_of_state=(offload_results["none"]["peak_rss"] - r["peak_rss"]) / state)
