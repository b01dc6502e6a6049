"""HF Trainer's step with ZeroTrainer (stages 1-3) against Trainer's own DDP + torch AdamW(fused).

    python -m pytest bench/bench_hf_trainer.py --benchmark-only -s     # -s prints the table
    python bench/bench_hf_trainer.py                                    # the table, no pytest

CPU, world size 2 (gloo): a GPT-2 built from a config (d=256, 4 layers, vocab 8192, seq 128,
tied embeddings, dropout off: 3.3M parameters), 4 samples per rank and micro-batch, 2 micro-batches
accumulated per step, max_grad_norm 1.0. ONE spawn of 2 ranks builds a Trainer per variant
(plain Trainer first: the baseline) and runs them interleaved, ``FUSED_ZERO_BENCH_STEPS``
rounds (default 6) after one warm-up round, each round a ``trainer.train()`` of 2 optimizer
steps per variant. A step is timed inside the ranks by a callback, barrier to barrier, from
``on_step_begin`` (micro-batches already fetched) to ``on_step_end`` (after the optimizer step
and zero_grad), and the step's time is the max over ranks. Ratios are against the baseline's
median in the same run. Accelerate users run the same ZeroAccelerator code path.
pytest-benchmark replays the in-rank times (see bench/bench_step.py's ReplayClock).
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from _replay import ReplayClock, finish, replay, same_model, shown, spawn, summarize  # noqa: E402

pytest.importorskip("transformers")

WORLD = 2
STEPS = int(os.environ.get("FUSED_ZERO_BENCH_STEPS", "6"))
VOCAB, SEQ, BATCH, ACCUM, PER_CALL = 8192, 128, 4, 2, 2
BASELINE = "trainer_ddp"
VARIANTS = {"trainer_ddp": "Trainer + DDP + torch AdamW(fused)", "zero_s1": "ZeroTrainer stage 1",
            "zero_s2": "ZeroTrainer stage 2", "zero_s3": "ZeroTrainer stage 3"}


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    torch.set_num_threads(max(1, (os.cpu_count() or WORLD) // WORLD))
    os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging

    from fused_zero import ZeroConfig
    from fused_zero.integrations.transformers import ZeroTrainer

    logging.set_verbosity_error()
    times = {n: [] for n in VARIANTS}
    losses = {}

    class Timer(TrainerCallback):
        def __init__(self, name):
            self.name, self.t0, self.keep = name, 0.0, False

        def on_step_begin(self, args, state, control, **kw):
            dist.barrier()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            dist.barrier()
            if self.keep:
                times[self.name].append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses[self.name] = logs["loss"]

    trainers = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in VARIANTS:
            torch.manual_seed(0)
            model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=256, n_layer=4, n_head=4,
                                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
            args = TrainingArguments(
                output_dir=os.path.join(tmp, name), per_device_train_batch_size=BATCH,
                gradient_accumulation_steps=ACCUM, max_steps=PER_CALL, learning_rate=1e-4, weight_decay=0.1,
                max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                disable_tqdm=True, optim="adamw_torch_fused", seed=0)
            kw = dict(model=model, args=args, train_dataset=_Tokens(WORLD * BATCH * ACCUM * PER_CALL),
                      callbacks=[Timer(name)])
            trainers[name] = (Trainer(**kw) if name == BASELINE else
                              ZeroTrainer(**kw, zero=ZeroConfig(stage=int(name[-1]))))
        for r in range(STEPS // PER_CALL + 1):
            for name, trainer in trainers.items():
                next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, Timer)).keep = r > 0
                trainer.train()
    per_rank = [None] * WORLD
    dist.all_gather_object(per_rank, (times, losses))
    result = {n: {"times": [max(ts) for ts in zip(*(p[0][n] for p in per_rank))],
                  "final_loss": statistics.mean(p[1][n] for p in per_rank)} for n in VARIANTS}
    finish(rank, result, out)


def run_cpu() -> dict:
    result = spawn(_worker, (), WORLD)
    summarize(result, BASELINE, "ratio_to_baseline")
    return result


def format_table(result: dict) -> str:
    head = f"{'variant':36s} {'median s':>9s} {'x DDP':>6s} {'q1':>7s} {'q3':>7s} {'final loss':>10s}"
    lines = [f"HF Trainer step, CPU gloo world {WORLD}, GPT-2 256d x 4L, vocab {VOCAB}, seq {SEQ}, "
             f"{BATCH}/rank x {ACCUM} micro-batches; {len(result[BASELINE]['times'])} steps kept", head,
             "-" * len(head)]
    for name, res in result.items():
        lines.append(f"{VARIANTS[name]:36s} {res['median_s']:9.3f} {res['ratio_to_baseline']:6.3f} "
                     f"{res['q1_s']:7.3f} {res['q3_s']:7.3f} {res['final_loss']:10.4f}")
    return "\n".join(lines)


CLOCK = ReplayClock()


@pytest.fixture(scope="module")
def results(request):
    return shown(request, run_cpu(), format_table)


@pytest.mark.benchmark(group="hf-trainer-cpu-world2", timer=CLOCK)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_trainer_step_cpu_world2(benchmark, results, variant):
    replay(benchmark, CLOCK, results[variant], ("median_s", "ratio_to_baseline", "min_s", "q1_s", "q3_s", "max_s",
                                                "final_loss"),
           world_size=WORLD, measured="in-rank callback, barrier to barrier, max over ranks; replayed")
    same_model(results, BASELINE, variant)


if __name__ == "__main__":
    print(format_table(run_cpu()))
