"""Train the example GPT with Lightning and fused_zero's ZeroStrategy: the LightningModule is plain.

    python examples/train_lightning.py --stage 2 --devices 2     # Lightning starts the 2nd rank
    python examples/train_lightning.py --stage 3 --devices 2 --save ckpt/last.ckpt
    python examples/train_lightning.py --stage 1 --devices 2 --resume ckpt/last.ckpt --steps 60

No torchrun: Lightning's launcher re-runs this script once per extra device (CPU ranks talk over
gloo; with CUDA, ``--accelerator gpu`` uses NCCL and one GPU per rank). ``configure_optimizers``
returns ``torch.optim.AdamW`` and a warm-up + cosine LambdaLR as for any Lightning strategy;
``ZeroStrategy`` rebuilds it as a ShardedOptimizer with the same groups and hyperparameters.
``gradient_clip_val`` and ``accumulate_grad_batches`` are the Trainer's usual arguments. The data
is examples/gpt.py's synthetic Markov chain: the loss falls from ln(vocab) towards its floor.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig, add_model_args, lr_lambda, markov_entropy, model_config, synthetic_batch  # noqa: E402

import lightning.pytorch as L  # noqa: E402

from fused_zero.integrations.lightning import ZeroStrategy  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--precision", default="32-true", help="Lightning's precision flag, e.g. bf16-mixed")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--grad-accum", type=int, default=2, help="accumulate_grad_batches")
    p.add_argument("--clip", type=float, default=1.0, help="gradient_clip_val (<= 0: off)")
    p.add_argument("--lr", type=float, default=3e-3)
    add_model_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default=None, help="write a checkpoint here at the end")
    p.add_argument("--resume", default=None, help="resume from this checkpoint (any stage or world size)")
    return p.parse_args(argv)


class MarkovData(Dataset):
    """Micro-batch i of this rank: a fixed function of (seed, rank, i)."""

    def __init__(self, cfg: GPTConfig, batch_size: int, length: int, rank: int, seed: int) -> None:
        self.cfg, self.batch_size, self.length, self.rank, self.seed = cfg, batch_size, length, rank, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        return synthetic_batch(self.cfg, self.batch_size, step=i, rank=self.rank, seed=self.seed)


class LitGPT(L.LightningModule):
    """A plain LightningModule: nothing here knows about fused_zero."""

    def __init__(self, cfg: GPTConfig, args: argparse.Namespace) -> None:
        super().__init__()
        self.cfg, self.args = cfg, args
        self.model = GPT(cfg, seed=args.seed)
        self._loss_sum = torch.zeros(())

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self._loss_sum = self._loss_sum.to(loss.device) + loss.detach()
        return loss

    def train_dataloader(self):
        n = self.args.steps * self.args.grad_accum
        return DataLoader(MarkovData(self.cfg, self.args.batch_size, n, self.trainer.global_rank, self.args.seed),
                          batch_size=None)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                       {"params": no_decay, "weight_decay": 0.0}],
                                      lr=self.args.lr, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(max(1, self.args.steps // 10), self.args.steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class PrintLoss(L.Callback):
    """After every optimizer step: the loss averaged over micro-batches and ranks, printed by rank 0."""

    def __init__(self) -> None:
        self.t0 = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.t0 is None:
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        loss = trainer.strategy.reduce(pl_module._loss_sum / trainer.accumulate_grad_batches, reduce_op="mean")
        pl_module._loss_sum = torch.zeros_like(pl_module._loss_sum)
        if trainer.is_global_zero:
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            dt = time.perf_counter() - self.t0
            print(f"step {trainer.global_step:4d}/{trainer.max_steps} loss {float(loss):.4f} lr {lr:.2e} "
                  f"{dt:6.1f} s", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = model_config(args)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, args.devices)))
    trainer = L.Trainer(
        strategy=ZeroStrategy(stage=args.stage),  # instead of strategy="ddp": THE ONE CHANGED LINE
        accelerator=args.accelerator, devices=args.devices, precision=args.precision,
        max_steps=args.steps, accumulate_grad_batches=args.grad_accum,
        gradient_clip_val=args.clip if args.clip > 0 else None,
        use_distributed_sampler=False,  # each rank draws its own stream (MarkovData)
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[PrintLoss()],
    )
    model = LitGPT(cfg, args)
    if trainer.is_global_zero:
        print(f"GPT {cfg}: {model.model.num_params() / 1e6:.2f}M params; Lightning {L.__version__}, "
              f"ZeroStrategy(stage={args.stage}) on {args.devices} {args.accelerator} rank(s); "
              f"loss floor {markov_entropy(cfg.vocab, args.seed):.3f}", flush=True)
    trainer.fit(model, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)  # every rank (collective at stage 3); rank 0 writes
        if trainer.is_global_zero:
            print(f"saved {args.save}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
