"""Train a GPT with Accelerate's own loop and fused_zero: ``Accelerator`` becomes ``ZeroAccelerator``.

    torchrun --standalone --nproc_per_node=2 examples/train_accelerate.py --stage 2
    accelerate launch --multi_gpu --num_processes 2 examples/train_accelerate.py --stage 3   # GPUs

On CPU launch with torchrun: ``accelerate launch --cpu`` starts one process unless an MPI host file is
configured (Accelerate's multi-CPU launcher), so the run would train at world size 1.

The loop is Accelerate's documented one, unchanged: a torch.optim.AdamW and a scheduler passed
to ``prepare`` with the model and the data, ``accumulate``, ``backward``, ``clip_grad_norm_``
when the gradients sync, ``save_state`` / ``load_state``. ZeroAccelerator turns the AdamW into a
fused_zero.ShardedOptimizer, never wraps the model in DDP, and checkpoints the model and
optimizer as a fused_zero.checkpoint (resumable at any world size and stage).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from accelerate.utils import DataLoaderConfiguration

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig, markov_entropy, synthetic_batch  # noqa: E402

from fused_zero import ZeroConfig  # noqa: E402
from fused_zero.integrations.accelerate import ZeroAccelerator  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--checkpoint", default="runs/accelerate", help="save_state folder")
    p.add_argument("--resume", action="store_true", help="load_state from --checkpoint first")
    a = p.parse_args()
    accelerator = ZeroAccelerator(zero=ZeroConfig(stage=a.stage),  # was: Accelerator(
                                  gradient_accumulation_steps=a.accum, cpu=not torch.cuda.is_available(),
                                  dataloader_config=DataLoaderConfiguration(split_batches=True))
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, d_model=128, n_layer=4, n_head=4, seq_len=64)
    model = GPT(cfg)
    x, y = synthetic_batch(cfg, 16 * a.accum * a.steps, step=0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=a.steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if a.resume:
        accelerator.load_state(a.checkpoint)
        done = scheduler.scheduler.last_epoch
        loader = accelerator.skip_first_batches(loader, done * a.accum)
    else:
        done = 0
    for inputs, targets in loader:
        with accelerator.accumulate(model):
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            done += 1
            loss = accelerator.gather(loss.detach().reshape(1)).mean().item()
            if done % 10 == 0:
                accelerator.print(f"step {done:3d}  loss {loss:.4f}  grad norm {float(norm):.3f}")
            if done == a.steps // 2:
                accelerator.save_state(a.checkpoint)
            if done == a.steps:
                break
    accelerator.print(f"stage {a.stage}: final loss {loss:.4f} (chain entropy floor "
                      f"{markov_entropy(cfg.vocab, 0):.4f}); state saved at step {a.steps // 2} in {a.checkpoint}")


if __name__ == "__main__":
    main()
