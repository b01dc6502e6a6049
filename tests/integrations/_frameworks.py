"""Shared pieces of the framework tests: the launcher environment, a tiny GPT-2, token data.

The ranks come from tests/_dist.py (a gloo default group is already initialised); the
frameworks find it through the usual torchrun variables, which ``launcher_env`` sets, and
reuse it instead of starting processes or a group of their own.
"""
from __future__ import annotations

import os

import torch

VOCAB, SEQ, N_SAMPLES = 96, 16, 256


def launcher_env(rank: int, world_size: int) -> None:
    """What torchrun would have set for this rank (the group itself already exists)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), NODE_RANK="0", GROUP_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29512"),
                      OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                      TRANSFORMERS_NO_ADVISORY_WARNINGS="1")


def accelerator(rank: int, world_size: int, stage: int | None, accum: int):
    """This rank's Accelerate front, after ``launcher_env``: Accelerate's own Accelerator (``stage`` None: its
    DDP) or ZeroAccelerator at ``stage`` (4096-element buckets), on the CPU, ``accum`` micro-batches a step,
    split_batches (a step sees the same global batch at any world size)."""
    launcher_env(rank, world_size)
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    from fused_zero import ZeroConfig
    from fused_zero.integrations.accelerate import ZeroAccelerator

    kw = dict(cpu=True, gradient_accumulation_steps=accum,
              dataloader_config=DataLoaderConfiguration(split_batches=True))
    return Accelerator(**kw) if stage is None else ZeroAccelerator(**kw, zero=ZeroConfig(stage=stage,
                                                                                          bucket_numel=4096))


def tiny_gpt2(seed: int = 0):
    """A 2-layer GPT-2 built from a config (tied input and output embeddings), about 110k parameters."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def tokens(n: int = N_SAMPLES, seed: int = 1) -> torch.Tensor:
    """Deterministic token sequences with some structure to learn (a noisy counting pattern)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    seq = (start + step * torch.arange(SEQ)) % VOCAB
    noise = torch.rand(n, SEQ, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, VOCAB, (n, SEQ), generator=g), seq)


class TokenDataset(torch.utils.data.Dataset):
    """Dicts of input_ids and labels, as HF models and Trainer take them."""

    def __init__(self, n: int = N_SAMPLES) -> None:
        self.data = tokens(n)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def rel_close(a: list[float], b: list[float], tol: float) -> float:
    """The largest relative difference between two loss curves (asserting equal lengths)."""
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
