"""A small GPT and a synthetic, learnable token stream: the workload of the examples and benches.

The model is GPT-2 shaped: token + position embeddings, pre-LayerNorm blocks (causal
self-attention through ``F.scaled_dot_product_attention``, then a GELU MLP), a final
LayerNorm and an lm head whose weight is tied to the token embedding (``tie_weights=False``
unties it). Initialisation draws from a private ``torch.Generator`` seeded by ``seed`` on
the CPU, so every rank and every device builds bit-identical weights whatever the global RNG.

No data can be downloaded here, so :func:`synthetic_batch` samples a fixed random Markov
chain over the vocabulary: each token has ``branching`` possible successors with random
probabilities. A model can learn it, so the loss falls from ``ln(vocab)`` towards the
chain's entropy rate (:func:`markov_entropy`), which is the floor no model can beat.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 512
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    seq_len: int = 64
    tie_weights: bool = True
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        for name in ("vocab", "d_model", "n_layer", "n_head", "seq_len", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """GPT-2 init from ``seed``: N(0, 0.02), residual projections scaled by
        1/sqrt(2 n_layer), LayerNorm weight 1, biases 0. Drawn on the CPU in
        ``named_parameters`` order, so the result is device-independent."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():  # tied weights are listed once
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_"):
                p.fill_(1.0)
            else:
                std = resid_std if name.endswith("proj.weight") else 0.02
                p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=gen))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits (B, T, vocab); with ``targets`` also the mean cross-entropy (fp32)."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss


# ----------------------------------------------------------------------------- data

@functools.lru_cache(maxsize=8)
def markov_chain(vocab: int, seed: int, branching: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain: ``succ[v]`` are the successors of token v, ``probs[v]`` their probabilities."""
    gen = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, branching), generator=gen)
    logits = 2.0 * torch.randn(vocab, branching, generator=gen)
    return succ, torch.softmax(logits, dim=-1)


def markov_entropy(vocab: int, seed: int, branching: int = 4) -> float:
    """Entropy rate (nats/token) of the chain under a uniform token distribution: about the
    lowest loss reachable (successor sets may collide, which only lowers it)."""
    _, probs = markov_chain(vocab, seed, branching)
    return float(-(probs * probs.log()).sum(-1).mean())


def synthetic_batch(cfg: GPTConfig, batch_size: int, *, step: int, rank: int = 0,
                    seed: int = 0, device: torch.device | str = "cpu",
                    branching: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, each (batch_size, seq_len) int64 on ``device``.

    The chain depends only on ``seed``; the sequences drawn from it depend on
    (seed, rank, step), so each rank sees its own reproducible stream. Sampled on the
    CPU, so the tokens are the same on every device.
    """
    succ, probs = markov_chain(cfg.vocab, seed, branching)
    gen = torch.Generator().manual_seed(((seed * 1_000_003 + rank) * 1_000_003 + step) % (1 << 63))
    cum = probs.cumsum(-1)
    u = torch.rand(cfg.seq_len, batch_size, 1, generator=gen)
    tokens = torch.empty(batch_size, cfg.seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, cfg.vocab, (batch_size,), generator=gen)
    for t in range(cfg.seq_len):
        cur = tokens[:, t]
        choice = torch.searchsorted(cum[cur], u[t]).clamp_(max=branching - 1)
        tokens[:, t + 1] = succ[cur].gather(1, choice).squeeze(1)
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


def add_model_args(p) -> None:
    """The examples' options for the batch and the model's size (argparse), GPTConfig's defaults;
    ``model_config(args)`` builds the model's config from them."""
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch per rank")
    for name in ("vocab", "d_model", "n_layer", "n_head", "seq_len"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(GPTConfig, name))


def model_config(args, **kw) -> GPTConfig:
    """The GPTConfig of ``add_model_args``' options (``kw``: the other fields, e.g. tie_weights)."""
    return GPTConfig(vocab=args.vocab, d_model=args.d_model, n_layer=args.n_layer, n_head=args.n_head,
                     seq_len=args.seq_len, **kw)


def lr_lambda(warmup: int, total: int, floor: float = 0.1):
    """The examples' schedule for LambdaLR: linear warm-up, then cosine down to ``floor`` of the peak."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return f
