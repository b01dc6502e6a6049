"""Host cost of a training step where Python dominates: many small parameters.

    python -m pytest bench/bench_host.py --benchmark-only -s      # the tables
    python bench/bench_host.py                                     # the same, no pytest

The model: ``BLOCKS`` (default 200) residual blocks of Linear(64, 64) + LayerNorm(64): 800
parameters, 0.87M elements; batch 4, fp32, one thread. A step is zero_grad + forward +
backward + step. Every variant trains its own copy of the same model on the same batches,
and the variants run interleaved, one step each per round (ABCD ABCD ...), so drift on a
shared machine hits them alike; FUSED_ZERO_BENCH_WARMUP rounds (default 3) are discarded and
FUSED_ZERO_BENCH_STEPS (default 20) kept.

- world 1: this process, no process group: torch ``AdamW(fused=True)`` (the baseline) and
  ShardedOptimizer stages 1-3 (stage 3 takes the model: ``sharded_s3`` with the default units,
  the blocks merged into units of at least ``min_unit_numel`` elements, all 200 into one;
  ``s3_per_block`` one unit per block, ``min_unit_numel=0``).
- world 2: two gloo ranks, barrier to barrier, the max over ranks: DDP + ``AdamW(fused=True)``
  (the baseline) and stages 1-3 (no DDP).
- stage-3 scaling, world 1: 50, 200 and 800 blocks (both stage-3 variants); the step's
  microseconds per parameter show whether host cost grows linearly with the model.

Each table gives the median, its ratio to the baseline of the same run, the quartiles, and
the final losses (equal across variants: a check that every variant trains the same model).
pytest-benchmark replays the measured step times (``_replay.ReplayClock``).
"""
from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _replay import ReplayClock, finish, replay, same_model, shown, spawn, summarize  # noqa: E402

from fused_zero import ShardedOptimizer  # noqa: E402

BLOCKS = int(os.environ.get("FUSED_ZERO_BENCH_BLOCKS", "200"))
SCALING = (50, 200, 800)
WIDTH, BATCH = 64, 4
STEPS = int(os.environ.get("FUSED_ZERO_BENCH_STEPS", "20"))
WARMUP = int(os.environ.get("FUSED_ZERO_BENCH_WARMUP", "3"))
HPARAMS = dict(lr=1e-3, weight_decay=0.01)


class Blocks(nn.Module):
    """``n`` residual blocks of Linear + LayerNorm: many small parameters, little arithmetic."""

    def __init__(self, n: int, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH))
                                        for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x.square().mean()


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1000 * step + rank))


def _torch_fused(model):
    return model, torch.optim.AdamW(model.parameters(), fused=True, **HPARAMS)


def _ddp_fused(model):
    model = nn.parallel.DistributedDataParallel(model)
    return model, torch.optim.AdamW(model.parameters(), fused=True, **HPARAMS)


def _sharded(stage: int, **options):
    def build(model):
        return model, ShardedOptimizer(model if stage == 3 else model.parameters(), stage=stage, **HPARAMS, **options)
    return build


#: stage 3 as the defaults build it (the blocks merged into units of at least min_unit_numel elements)
#: and with one unit per block (min_unit_numel=0)
STAGE3 = {"sharded_s3": _sharded(3), "s3_per_block": _sharded(3, min_unit_numel=0)}
WORLD1 = {"torch_fused": _torch_fused, "sharded_s1": _sharded(1), "sharded_s2": _sharded(2), **STAGE3}
WORLD2 = {"ddp_fused": _ddp_fused, "sharded_s1": _sharded(1), "sharded_s2": _sharded(2), **STAGE3}


def _step(model, opt, x) -> float:
    opt.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward()
    opt.step()
    return loss.item()


def _interleaved(builders: dict, blocks: int, rank: int = 0, barrier=lambda: None) -> dict:
    """Per variant: the kept step times (s) and the last loss; rounds interleaved."""
    runs = {name: build(Blocks(blocks)) for name, build in builders.items()}
    times = {name: [] for name in runs}
    losses = {}
    for r in range(WARMUP + STEPS):
        x = _batch(r, rank)
        for name, (model, opt) in runs.items():
            barrier()
            t0 = time.perf_counter()
            losses[name] = _step(model, opt, x)
            barrier()
            if r >= WARMUP:
                times[name].append(time.perf_counter() - t0)
    return {name: {"times": times[name], "final_loss": losses[name]} for name in runs}


def run_world1(blocks: int = BLOCKS, builders: dict = WORLD1) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = _interleaved(builders, blocks)
    finally:
        torch.set_num_threads(threads)
    _summarize(result, next(iter(builders)), blocks)
    return result


def _summarize(result: dict, baseline: str, blocks: int) -> None:
    """Quartiles, the ratio to ``baseline``, and the step's microseconds per parameter."""
    summarize(result, baseline, "ratio")
    params = sum(1 for _ in Blocks(blocks).parameters())
    for res in result.values():
        res["us_per_param"] = res["median_s"] * 1e6 / params


def _worker(rank: int, port: int, blocks: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    result = _interleaved(WORLD2, blocks, rank, barrier=dist.barrier)
    gathered = [None, None]
    dist.all_gather_object(gathered, result)
    # a step's time is the slower rank's
    merged = {name: {"times": [max(a, b) for a, b in zip(res["times"], gathered[1][name]["times"])],
                     "final_loss": (res["final_loss"] + gathered[1][name]["final_loss"]) / 2}
              for name, res in gathered[0].items()}
    finish(rank, merged, out)


def run_world2(blocks: int = BLOCKS) -> dict:
    result = spawn(_worker, (blocks,), 2)
    _summarize(result, "ddp_fused", blocks)
    return result


def run_scaling() -> dict:
    """Stage 3 and its baseline at each size of SCALING, world 1."""
    builders = {"torch_fused": _torch_fused, **STAGE3}
    return {blocks: run_world1(blocks, builders) for blocks in SCALING}


def format_table(title: str, result: dict) -> str:
    head = (f"{'variant':14s} {'median ms':>9s} {'ratio':>6s} {'q1':>7s} {'q3':>7s} {'us/param':>8s} "
            f"{'final loss':>12s}")
    lines = [title, head, "-" * len(head)]
    for name, res in result.items():
        lines.append(f"{name:14s} {res['median_s'] * 1e3:9.2f} {res['ratio']:6.3f} {res['q1_s'] * 1e3:7.2f} "
                     f"{res['q3_s'] * 1e3:7.2f} {res['us_per_param']:8.2f} "
                     f"{res['final_loss']:12.6f}")
    return "\n".join(lines)


def _title(world: int, blocks: int) -> str:
    return (f"step host cost, CPU, world {world}, {blocks} blocks of Linear({WIDTH}, {WIDTH}) + LayerNorm "
            f"({4 * blocks} params), batch {BATCH}, 1 thread; {STEPS} kept rounds after {WARMUP} warm-up")


# ----------------------------------------------------------------------------- pytest

CLOCK = ReplayClock()


@pytest.fixture(scope="module")
def world1(request):
    return shown(request, run_world1(), lambda r: format_table(_title(1, BLOCKS), r))


@pytest.fixture(scope="module")
def world2(request):
    return shown(request, run_world2(), lambda r: format_table(_title(2, BLOCKS), r))


@pytest.fixture(scope="module")
def scaling(request):
    return shown(request, run_scaling(), lambda res: "\n\n".join(format_table(_title(1, b), r) for b, r in res.items()))


@pytest.mark.benchmark(group="host-world1", timer=CLOCK)
@pytest.mark.parametrize("variant", list(WORLD1))
def test_host_world1(benchmark, world1, variant):
    replay(benchmark, CLOCK, world1[variant], world_size=1, blocks=BLOCKS)
    same_model(world1, "torch_fused", variant, rtol=1e-5)


@pytest.mark.benchmark(group="host-world2", timer=CLOCK)
@pytest.mark.parametrize("variant", list(WORLD2))
def test_host_world2(benchmark, world2, variant):
    replay(benchmark, CLOCK, world2[variant], world_size=2, blocks=BLOCKS)
    same_model(world2, "ddp_fused", variant, rtol=1e-5)


@pytest.mark.benchmark(group="host-stage3-scaling", timer=CLOCK)
@pytest.mark.parametrize("blocks", SCALING)
@pytest.mark.parametrize("variant", ["torch_fused", *STAGE3])
def test_host_stage3_scaling(benchmark, scaling, blocks, variant):
    replay(benchmark, CLOCK, scaling[blocks][variant], world_size=1, blocks=blocks)
    same_model(scaling[blocks], "torch_fused", variant, rtol=1e-5)


if __name__ == "__main__":
    print(format_table(_title(1, BLOCKS), run_world1()))
    print(format_table(_title(2, BLOCKS), run_world2()))
    for b, r in run_scaling().items():
        print(format_table(_title(1, b), r))
