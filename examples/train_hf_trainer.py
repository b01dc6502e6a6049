"""Train a GPT-2 (built from a config) with HF Trainer and fused_zero: one changed line.

    torchrun --standalone --nproc_per_node=2 examples/train_hf_trainer.py --stage 2
    torchrun --standalone --nproc_per_node=2 examples/train_hf_trainer.py --stage 3 --resume --steps 60

The second resumes the first's last checkpoint (saved at stage 2, loaded at stage 3) and trains on to step 60
(resumed at its own ``--steps``, HF's Trainer runs one more step past the end).

``Trainer(...)`` becomes ``ZeroTrainer(..., zero=ZeroConfig(stage=...))``; everything else is
the Trainer you know: TrainingArguments' AdamW hyperparameters, schedule, max_grad_norm and
gradient accumulation, checkpoint-N folders and save_model(). CPU ranks talk over gloo; with
CUDA the same command uses NCCL, one GPU per rank, and fused_zero's Triton kernels.
The data is a synthetic Markov chain (examples/gpt.py), so the loss falls from ln(vocab)
towards the chain's entropy rate.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPTConfig, markov_entropy, synthetic_batch  # noqa: E402

from fused_zero import ZeroConfig  # noqa: E402
from fused_zero.integrations.transformers import ZeroTrainer  # noqa: E402

VOCAB, SEQ = 256, 64


class MarkovTokens(torch.utils.data.Dataset):
    """Sequences from examples/gpt.py's synthetic Markov chain, as HF causal-LM samples."""

    def __init__(self, n: int) -> None:
        cfg = GPTConfig(vocab=VOCAB, seq_len=SEQ)
        x, y = synthetic_batch(cfg, n, step=0)
        self.ids = torch.cat([x, y[:, -1:]], dim=1)[:, :SEQ]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--output-dir", default="runs/hf_trainer")
    p.add_argument("--resume", action="store_true", help="resume from the output dir's last checkpoint")
    a = p.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=128, n_layer=4, n_head=4))
    args = TrainingArguments(
        output_dir=a.output_dir, max_steps=a.steps, per_device_train_batch_size=8, gradient_accumulation_steps=2,
        learning_rate=3e-3, weight_decay=0.1, adam_beta2=0.95, warmup_steps=a.steps // 10, max_grad_norm=1.0,
        lr_scheduler_type="cosine", logging_steps=5, save_steps=20, report_to=[], disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available())
    trainer = ZeroTrainer(model=model, args=args, train_dataset=MarkovTokens(4096),
                          zero=ZeroConfig(stage=a.stage))  # was: Trainer(model=model, args=args, ...)
    result = trainer.train(resume_from_checkpoint=True if a.resume else None)
    trainer.save_model()  # every rank calls it (stage 3 gathers the full model)
    if trainer.is_world_process_zero():
        print(f"stage {a.stage}: mean train loss of this run {result.training_loss:.4f} "
              f"(chain entropy floor {markov_entropy(VOCAB, 0):.4f}); "
              f"model saved to {args.output_dir}")


if __name__ == "__main__":
    main()
