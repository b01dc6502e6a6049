"""Step time inside Lightning: ZeroStrategy stages 1-3 against Lightning's own DDP + torch AdamW(fused).

    python -m pytest bench/bench_lightning.py --benchmark-only -s     # -s prints the table
    FUSED_ZERO_BENCH_ROUNDS=2 FUSED_ZERO_BENCH_STEPS=3 python -m pytest bench/bench_lightning.py --benchmark-only
    python bench/bench_lightning.py                                     # the table, no pytest

CPU, world size 2 (gloo): a GPT of d=256, 4 layers, 4 heads, vocab 4096 (tied head), seq 128,
batch 8 per rank, fp32, 4.2M parameters, in a LightningModule whose configure_optimizers returns
torch.optim.AdamW(fused=True) (two param groups); ``Trainer(gradient_clip_val=1.0)``. Variants:
``strategy="ddp"`` (the baseline) and ``ZeroStrategy(stage=1|2|3)``, the same LightningModule.

How it is measured: ONE spawn of 2 ranks and one process group (Lightning sees processes created
externally and reuses it) runs every variant. Each round fits every variant once, in turn
(ABCD ABCD ...), each fit a fresh model from the same seed on the same per-rank batches:
FUSED_ZERO_BENCH_WARMUP steps (default 2) discarded, then FUSED_ZERO_BENCH_STEPS (default 5)
timed, for FUSED_ZERO_BENCH_ROUNDS rounds (default 3). A step is timed on each rank from a
barrier in ``on_train_batch_start`` to a barrier in ``on_train_batch_end`` (training_step,
backward, clipping, optimizer step, zero_grad: everything Lightning does per batch but fetching
it); the step's time is the max over ranks. The ratio is each variant's median over the baseline's
median from the same run. pytest-benchmark replays the in-rank times (a replay clock), as
bench_step.py does. Each rank uses cpu_count // 2 threads; on a shared 2-core box read ratios,
and differences only beyond the IQRs.
"""
from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("lightning")

import lightning.pytorch as L  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402
from _replay import ReplayClock, finish, replay, same_model, shown, spawn, summarize  # noqa: E402

WORLD = 2
CFG = GPTConfig(vocab=4096, d_model=256, n_layer=4, n_head=4, seq_len=128)
BATCH = 8
STEPS = int(os.environ.get("FUSED_ZERO_BENCH_STEPS", "5"))
WARMUP = int(os.environ.get("FUSED_ZERO_BENCH_WARMUP", "2"))
ROUNDS = int(os.environ.get("FUSED_ZERO_BENCH_ROUNDS", "3"))
CLIP = 1.0
BASELINE = "ddp_adamw"
VARIANTS = {
    "ddp_adamw": "Lightning DDP + torch AdamW(fused)",
    "zero_s1": "ZeroStrategy(stage=1)",
    "zero_s2": "ZeroStrategy(stage=2)",
    "zero_s3": "ZeroStrategy(stage=3)",
}
TARGET = {"zero_s1": 1.05, "zero_s2": 1.05, "zero_s3": 1.15}


class Batches(Dataset):
    def __init__(self, rank: int, n: int) -> None:
        self.rank, self.n = rank, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return synthetic_batch(CFG, BATCH, step=i, rank=self.rank, seed=0)


class LitGPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(CFG, seed=0)
        self.last_loss = None

    def training_step(self, batch, batch_idx):
        _, loss = self.model(*batch)
        self.last_loss = loss.detach()
        return loss

    def train_dataloader(self):
        return DataLoader(Batches(self.trainer.global_rank, WARMUP + STEPS), batch_size=None)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                 lr=1e-4, betas=(0.9, 0.95), fused=True)


class StepTimer(L.Callback):
    """Barrier to barrier around each batch, on this rank."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        trainer.strategy.barrier()
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.strategy.barrier()
        self.times.append(time.perf_counter() - self.t0)


def _strategy(name: str):
    if name == BASELINE:
        return "ddp"
    from fused_zero.integrations.lightning import ZeroStrategy
    return ZeroStrategy(stage=int(name[-1]))


def _fit(name: str) -> tuple[list[float], float]:
    timer = StepTimer()
    trainer = L.Trainer(strategy=_strategy(name), accelerator="cpu", devices=WORLD, max_steps=WARMUP + STEPS,
                        gradient_clip_val=CLIP, use_distributed_sampler=False, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        num_sanity_val_steps=0, callbacks=[timer])
    model = LitGPT()
    trainer.fit(model)
    return timer.times[WARMUP:], float(model.last_loss)


def _worker(rank: int, port: int, names: list[str], out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or WORLD) // WORLD))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    import logging
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    times = {n: [] for n in names}
    losses = {}
    for _ in range(ROUNDS):
        for name in names:
            ts, loss = _fit(name)
            times[name].extend(ts)
            losses[name] = loss
    result = {}
    for name in names:
        per_rank = [None] * WORLD
        dist.all_gather_object(per_rank, (times[name], losses[name]))
        result[name] = {"times": [max(ts) for ts in zip(*(p[0] for p in per_rank))],
                        "final_loss": sum(p[1] for p in per_rank) / WORLD}
    finish(rank, result, out)


def run_cpu(names=None) -> dict:
    result = spawn(_worker, (names or list(VARIANTS),), WORLD)
    summarize(result, BASELINE, "ratio_to_ddp")
    return result


def format_table(result: dict) -> str:
    head = (f"{'variant':36s} {'median s':>9s} {'x DDP':>6s} {'target':>6s} {'min':>7s} {'q1':>7s} {'q3':>7s} "
            f"{'max':>7s} {'final loss':>10s}")
    lines = [f"Lightning step, CPU gloo world {WORLD}, GPT {CFG.d_model}d x {CFG.n_layer}L, vocab {CFG.vocab}, "
             f"seq {CFG.seq_len}, batch {BATCH}/rank, fp32, clip {CLIP}; {ROUNDS} rounds x {STEPS} steps "
             f"(after {WARMUP} warm-up steps per fit)", head, "-" * len(head)]
    for name, res in result.items():
        target = f"{TARGET[name]:.2f}" if name in TARGET else ""
        lines.append(f"{VARIANTS[name]:36s} {res['median_s']:9.3f} {res['ratio_to_ddp']:6.3f} {target:>6s} "
                     f"{res['min_s']:7.3f} {res['q1_s']:7.3f} {res['q3_s']:7.3f} {res['max_s']:7.3f} "
                     f"{res['final_loss']:10.5f}")
    return "\n".join(lines)


CLOCK = ReplayClock()


@pytest.fixture(scope="module")
def lightning_results(request):
    return shown(request, run_cpu(), format_table)


@pytest.mark.benchmark(group="lightning-step-cpu-world2", timer=CLOCK)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_lightning_step_cpu_world2(benchmark, lightning_results, variant):
    replay(benchmark, CLOCK, lightning_results[variant],
           ("median_s", "ratio_to_ddp", "min_s", "q1_s", "q3_s", "max_s", "final_loss"),
           target_ratio=TARGET.get(variant), world_size=WORLD, params=GPT(CFG).num_params(),
           measured="in-rank, barrier to barrier per batch, max over ranks; replayed")
    same_model(lightning_results, BASELINE, variant)


if __name__ == "__main__":
    print(format_table(run_cpu()))
