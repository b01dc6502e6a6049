"""Whole training step (forward + backward + optimizer step) of a GPT, against torch's options.

    python -m pytest bench/bench_step.py --benchmark-only        # add -s to see the table
    FUSED_ZERO_BENCH_STEPS=3 python -m pytest bench/bench_step.py --benchmark-only   # quick
    python bench/bench_step.py                                     # the CPU table, no pytest

CPU, world size 2 (gloo): a GPT of d=512, 8 layers, 8 heads, vocab 8192 (untied head), seq 128,
batch 8 per rank, fp32: 33.7M parameters. Variants: DDP + torch AdamW(fused=True) (the
baseline; DDP with default settings); torch's ZeroRedundancyOptimizer(AdamW, fused=True) under
DDP; FSDP2 (fully_shard per block and root) + torch AdamW; ShardedOptimizer stages 1, 2 and 3 (no DDP;
stage 3 takes the model, its units are the GPT's blocks), and stages 1-2 built with the model and
update_behind=True ("gather behind": the all-gather of the updated parameters runs behind step(), each
block's next forward waiting for its own buckets; its "step() s" then leaves the gather out).

How the numbers are measured: ONE torch.multiprocessing spawn of 2 ranks and one process group
runs every variant. Each variant gets its own model built from the same seed and the same
per-rank batches. The variants run interleaved, one step each per round (ABCD ABCD ...), so
drift on a shared machine hits all of them alike; the first FUSED_ZERO_BENCH_WARMUP rounds
(default 2) are discarded and FUSED_ZERO_BENCH_STEPS rounds (default 6) are kept. A step is
timed on each rank from a barrier to a barrier (zero_grad, forward, backward, step), and
the step's time is the max over ranks ("step() s": the median of the part spent inside
opt.step(), max over ranks; for ShardedOptimizer it includes waiting for its reductions,
which DDP does inside backward). pytest-benchmark then replays those step times: its
timer is a replay clock that each benchmark round advances by one measured step, so its
min/median/IQR/max columns are the in-rank figures, not the parent's. extra_info also holds
the median, its ratio to DDP, the spread, the bytes per rank and the final losses (equal
across variants up to reduction order: a check that every variant trains the same model).
Each rank uses cpu_count // 2 threads. On a shared 2-core box step times spread about 2x
from min to max: read a ratio as a difference only where the IQRs do not overlap.

With CUDA: world-size-1 steps of ShardedOptimizer and torch AdamW(fused=True), timed in
process by pytest-benchmark with a synchronize at the end of each step (skipped without CUDA).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402
from _replay import ReplayClock, finish, replay, same_model, shown, spawn, summarize  # noqa: E402

try:
    from fused_zero import ShardedOptimizer
except ImportError as e:  # the suite still measures torch's variants
    ShardedOptimizer, _IMPORT_ERROR = None, repr(e)

WORLD = 2
CFG = GPTConfig(vocab=8192, d_model=512, n_layer=8, n_head=8, seq_len=128, tie_weights=False)
BATCH = 8
STEPS = int(os.environ.get("FUSED_ZERO_BENCH_STEPS", "6"))
WARMUP = int(os.environ.get("FUSED_ZERO_BENCH_WARMUP", "2"))
HPARAMS = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
# ShardedOptimizer's bucket size in elements (FUSED_ZERO_BENCH_BUCKET; default: the library's).
BUCKET = {"bucket_numel": int(os.environ["FUSED_ZERO_BENCH_BUCKET"])} if os.environ.get("FUSED_ZERO_BENCH_BUCKET") else {}
BASELINE = "ddp_adamw"


class Skip(Exception):
    """A variant that cannot run here; the reason is reported as the test's skip."""


# ----------------------------------------------------------------------------- variants
# Each builder takes a fresh CPU model and returns (module to call, optimizer). Add a variant
# by adding a builder here: the CPU run, the table and the tests pick it up.

def _ddp_adamw(model):
    model = torch.nn.parallel.DistributedDataParallel(model)
    return model, torch.optim.AdamW(model.parameters(), fused=True, **HPARAMS)


def _zero_torch(model):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    model = torch.nn.parallel.DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                  fused=True, **HPARAMS)
    return model, opt


def _fsdp2(model):
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    except ImportError as e:
        raise Skip(f"FSDP2 unavailable: {e!r}") from e
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), foreach=True, **HPARAMS)


def _sharded(stage, behind=False):
    """``behind``: stages 1-2 built with the model and update_behind=True: the all-gather of the updated
    parameters runs behind step(), each module's next forward waiting for its own buckets."""
    def build(model):
        if ShardedOptimizer is None:
            raise Skip(f"fused_zero.ShardedOptimizer unavailable: {_IMPORT_ERROR}")
        extra = dict(update_behind=True) if behind else {}
        try:  # stage 3 takes the module; stages 1-2 take the parameters, as torch.optim does
            opt = ShardedOptimizer(model if stage == 3 or behind else model.parameters(), stage=stage, **HPARAMS,
                                   **BUCKET, **extra)
        except NotImplementedError as e:
            raise Skip(f"ShardedOptimizer stage {stage}: {e}") from e
        return model, opt
    return build


VARIANTS = {
    "ddp_adamw": ("DDP + torch AdamW(fused)", _ddp_adamw),
    "zero_torch": ("DDP + torch ZeroRedundancyOptimizer", _zero_torch),
    "fsdp2": ("FSDP2 fully_shard + torch AdamW", _fsdp2),
    "sharded_s1": ("ShardedOptimizer stage 1", _sharded(1)),
    "sharded_s2": ("ShardedOptimizer stage 2", _sharded(2)),
    "sharded_s1_behind": ("ShardedOptimizer stage 1, gather behind", _sharded(1, behind=True)),
    "sharded_s2_behind": ("ShardedOptimizer stage 2, gather behind", _sharded(2, behind=True)),
    "sharded_s3": ("ShardedOptimizer stage 3", _sharded(3)),
}


def _selected() -> list[str]:
    names = os.environ.get("FUSED_ZERO_BENCH_VARIANTS")
    names = [n.strip() for n in names.split(",")] if names else list(VARIANTS)
    return [BASELINE] + [n for n in names if n != BASELINE and n in VARIANTS]


# ----------------------------------------------------------------------------- the ranks

def _state_bytes(model, opt) -> int:
    """Bytes of params + grads + optimizer state on this rank (comm buffers excluded)."""
    if hasattr(opt, "memory_bytes"):
        return sum(v for k, v in opt.memory_bytes().items() if k != "buffers")

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t
    tensors = [local(p) for p in model.parameters()]
    tensors += [local(p.grad) for p in model.parameters() if p.grad is not None]
    state = getattr(opt, "optim", opt).state  # ZeroRedundancyOptimizer keeps its shard in .optim
    tensors += [local(v) for s in state.values() for v in s.values()
                if torch.is_tensor(v) and v.numel() > 1]
    return sum(t.numel() * t.element_size() for t in tensors)


def _timed_step(model, opt, x, y) -> tuple[float, float, float]:
    """(whole step s, of which inside opt.step() s, loss), barrier to barrier on this rank."""
    dist.barrier()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    t1 = time.perf_counter()
    opt.step()
    t2 = time.perf_counter()
    dist.barrier()
    return time.perf_counter() - t0, t2 - t1, loss.item()


def _worker(rank: int, port: int, names: list[str], cfg: GPTConfig, steps: int, warmup: int,
            out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or WORLD) // WORLD))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    runs, skipped = {}, {}
    for name in names:
        try:
            runs[name] = VARIANTS[name][1](GPT(cfg, seed=0))
            err = None
        except Skip as e:
            err = str(e)
        errs = [None] * WORLD
        dist.all_gather_object(errs, err)  # a variant runs only if it built on every rank
        if any(errs):
            runs.pop(name, None)
            skipped[name] = next(e for e in errs if e)
    times = {n: [] for n in runs}
    opt_times = {n: [] for n in runs}
    losses = {n: [] for n in runs}
    for r in range(warmup + steps):
        x, y = synthetic_batch(cfg, BATCH, step=r, rank=rank, seed=0)
        for name, (model, opt) in runs.items():
            dt, dt_opt, loss = _timed_step(model, opt, x, y)
            if r >= warmup:
                times[name].append(dt)
                opt_times[name].append(dt_opt)
            losses[name].append(loss)
    result = {}
    for name, (model, opt) in runs.items():
        per_rank = [None] * WORLD
        dist.all_gather_object(per_rank, (times[name], losses[name][-1], _state_bytes(model, opt),
                                          opt_times[name]))
        result[name] = {
            "times": [max(ts) for ts in zip(*(p[0] for p in per_rank))],
            "opt_step_s": statistics.median(max(ts) for ts in zip(*(p[3] for p in per_rank))),
            "final_loss": sum(p[1] for p in per_rank) / WORLD,
            "state_bytes": max(p[2] for p in per_rank),
            "comm_bytes": opt.comm_bytes() if hasattr(opt, "comm_bytes") else None,
        }
    result.update({n: {"skipped": why} for n, why in skipped.items()})
    finish(rank, result, out)


def run_cpu(names=None, cfg: GPTConfig = CFG, steps: int = STEPS, warmup: int = WARMUP) -> dict:
    """Spawn the ranks once, run every variant; per variant the step times (s) and figures."""
    names = names or _selected()
    result = spawn(_worker, (names, cfg, steps, warmup), WORLD)
    summarize(result, BASELINE, "ratio_to_ddp")
    return {n: result[n] for n in names}


def format_table(result: dict, cfg: GPTConfig = CFG, steps: int = STEPS, warmup: int = WARMUP) -> str:
    head = (f"{'variant':38s} {'median s':>9s} {'x DDP':>6s} {'min':>7s} {'q1':>7s} {'q3':>7s} "
            f"{'max':>7s} {'step() s':>8s} {'state MB/rank':>14s} {'final loss':>10s}")
    lines = [f"whole step, CPU gloo world {WORLD}, {cfg.d_model}d x {cfg.n_layer}L, vocab {cfg.vocab}, "
             f"seq {cfg.seq_len}, batch {BATCH}/rank, fp32; {steps} kept rounds after {warmup} warm-up",
             head, "-" * len(head)]
    for name, res in result.items():
        label = VARIANTS[name][0]
        if "skipped" in res:
            lines.append(f"{label:38s} skipped: {res['skipped'][:70]}")
            continue
        lines.append(f"{label:38s} {res['median_s']:9.3f} {res['ratio_to_ddp']:6.3f} {res['min_s']:7.3f} "
                     f"{res['q1_s']:7.3f} {res['q3_s']:7.3f} {res['max_s']:7.3f} {res['opt_step_s']:8.3f} "
                     f"{res['state_bytes'] / 2**20:14.1f} {res['final_loss']:10.5f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- pytest

CLOCK = ReplayClock()


@pytest.fixture(scope="module")
def cpu_results(request):
    return shown(request, run_cpu(), format_table)


@pytest.mark.benchmark(group="step-cpu-world2", timer=CLOCK)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_step_cpu_world2(benchmark, cpu_results, variant):
    if variant not in cpu_results:
        pytest.skip("not in FUSED_ZERO_BENCH_VARIANTS")
    res = cpu_results[variant]
    if "skipped" in res:
        pytest.skip(res["skipped"])
    replay(benchmark, CLOCK, res, ("median_s", "ratio_to_ddp", "min_s", "q1_s", "q3_s", "max_s", "opt_step_s",
                                   "state_bytes", "comm_bytes", "final_loss"),
           world_size=WORLD, params=GPT(CFG).num_params(),
           measured="in-rank, barrier to barrier, max over ranks; replayed into pytest-benchmark")
    same_model(cpu_results, BASELINE, variant)


# ----------------------------------------------------------------------------- CUDA, world 1

GPU_CFG = GPTConfig(vocab=32768, d_model=1024, n_layer=12, n_head=16, seq_len=512, tie_weights=False)
GPU_BATCH = 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.benchmark(group="step-cuda-world1")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["torch_fused_adamw", "sharded", "sharded_capturable"])
def test_step_cuda_world1(benchmark, variant, dtype):
    """One process, no process group: torch AdamW(fused=True) against ShardedOptimizer (its
    fused Triton step), and with capturable=True (step()'s device work replayed as one CUDA graph
    after two warm-up steps). fp32 params run the forward under bf16 autocast (AMP); bf16 params run
    in bf16, where torch updates bf16 in place while ShardedOptimizer keeps an fp32 master, so
    it does more work: fp32 is the like-for-like pair. extra_info adds opt.step() alone (CUDA
    events)."""
    if variant.startswith("sharded") and ShardedOptimizer is None:
        pytest.skip(f"fused_zero.ShardedOptimizer unavailable: {_IMPORT_ERROR}")
    dev = torch.device("cuda")
    model = GPT(GPU_CFG, seed=0).to(dev, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    if variant.startswith("sharded"):
        opt = ShardedOptimizer(model.parameters(), stage=2, capturable=variant == "sharded_capturable", **HPARAMS)
    else:
        opt = torch.optim.AdamW(model.parameters(), fused=True, **HPARAMS)
    x, y = synthetic_batch(GPU_CFG, GPU_BATCH, step=0, device=dev)

    opt_ms = []

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16, enabled=dtype == "fp32"):
            _, loss = model(x, y)
        loss.backward()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.step()
        end.record()
        torch.cuda.synchronize()
        opt_ms.append(start.elapsed_time(end))

    benchmark.pedantic(step, rounds=20, warmup_rounds=3, iterations=1)
    opt_ms = sorted(opt_ms[3:])  # the timed rounds only
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), dtype=dtype,
                                optimizer_step_ms_median=opt_ms[len(opt_ms) // 2],
                                optimizer_step_ms_min_max=(opt_ms[0], opt_ms[-1]),
                                params=model.num_params(), tokens=GPU_BATCH * GPU_CFG.seq_len,
                                peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9)


if __name__ == "__main__":
    print(format_table(run_cpu()))
