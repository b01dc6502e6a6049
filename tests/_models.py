"""Small deterministic models, data and DDP/torch references shared by the optimizer tests.

Everything here is deterministic: a model built with the same seed is bitwise identical
on every rank and in every copy, and a batch depends only on (step, rank, micro-batch).
The reference side is torch itself: a model wrapped in DDP (which averages gradients)
stepped by a torch optimizer with ``foreach=False``.
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

D_IN, D, D_OUT, SEQ = 16, 64, 8, 4


class TinyNet(nn.Module):
    """A transformer-like block (LayerNorm, attention, MLP) plus special-case parameters.

    ``branch`` is used only when ``use_branch`` (tests skip it on even steps on every rank),
    ``side`` only when ``use_side`` (tests skip it on one rank only), and ``frozen`` has
    ``requires_grad=False``. About 48k parameters; several weights have 4096 or more
    elements so that a 1000-element bucket splits them.
    """

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.inp = nn.Linear(D_IN, D)
            self.ln1 = nn.LayerNorm(D)
            # no bias: a key bias has an exactly-zero gradient (softmax is shift invariant), so
            # its computed gradient is rounding noise that Adam would blow up to ±lr per step
            self.qkv = nn.Linear(D, 3 * D, bias=False)
            self.proj = nn.Linear(D, D)
            self.ln2 = nn.LayerNorm(D)
            self.fc1 = nn.Linear(D, 2 * D)
            self.fc2 = nn.Linear(2 * D, D)
            self.branch = nn.Linear(D, D)
            self.side = nn.Linear(D, D, bias=False)
            self.frozen = nn.Linear(D, D)
            self.head = nn.Linear(D, D_OUT)
            # LayerNorm starts at (1, 0): perturb so that its parameters look like the rest.
            for ln in (self.ln1, self.ln2):
                nn.init.normal_(ln.weight, 1.0, 0.1)
                nn.init.normal_(ln.bias, 0.0, 0.1)
        self.frozen.requires_grad_(False)
        self.to(dtype)

    def forward(self, x, use_branch: bool = True, use_side: bool = True):
        h = self.inp(x)
        q, k, v = self.qkv(self.ln1(h)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / 8.0, dim=-1)
        h = h + self.proj(att @ v)
        h = h + self.fc2(F.gelu(self.fc1(self.ln2(h))))
        if use_branch:
            h = h + self.branch(h)
        if use_side:
            h = h + self.side(torch.tanh(h))
        h = self.frozen(h)
        return self.head(h).mean(dim=1)


class ClipNet(nn.Module):
    """Three tanh layers and a head, seeded alike every time (the clip tests): ``gain`` scales the head's output,
    so the gradients outgrow a small clip."""

    def __init__(self, outputs: int = 4, gain: float = 1.0) -> None:
        super().__init__()
        self.gain = gain
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.a = nn.Linear(8, 16)
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
            self.b = nn.Linear(16, outputs)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        for blk in self.blocks:
            h = torch.tanh(blk(h))
        return (self.b(h) * self.gain).square().mean()


class PlainNet(nn.Module):
    """An MLP whose parameters are all trainable and used every step (for accounting)."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.layers = nn.Sequential(
                nn.Linear(D_IN, D), nn.LayerNorm(D), nn.GELU(), nn.Linear(D, D), nn.GELU(),
                nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D_OUT))
        self.to(dtype)

    def forward(self, x, **_):
        return self.layers(x).mean(dim=1)


class BNNet(nn.Module):
    """Blocks of Linear + BatchNorm1d + GELU in a ModuleList: running stats are module buffers."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32, n_blocks: int = 3):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.inp = nn.Linear(D_IN, D)
            # no bias before BatchNorm: its gradient is exactly zero (BN subtracts the mean)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D, bias=False), nn.BatchNorm1d(D), nn.GELU())
                                        for _ in range(n_blocks))
            self.head = nn.Linear(D, D_OUT)
        self.to(dtype)

    def forward(self, x, **_):
        b = x.shape[0]
        h = self.inp(x.flatten(0, 1))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h).view(b, -1, D_OUT).mean(dim=1)


class LoraNet(nn.Module):
    """The issue's fine-tuning shape: 133,640 elements, 98.5% frozen (a frozen embedding and base
    layer), 2,056 trainable in a LoRA-like adapter (A with a bias, B) beside the base. ``forward(x, y)``
    takes token ids (batch, SEQ) and a (batch, D_OUT) target; returns (None, loss). Children are stage 3's
    units; the adapter sits in the base layer's unit, as PEFT puts it."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.emb = nn.Embedding(1000, 128)
            self.block = nn.ModuleDict({"base": nn.Linear(128, 28, bias=False), "lora_a": nn.Linear(128, 8),
                                        "lora_b": nn.Linear(8, 128, bias=False)})
            nn.init.normal_(self.block["lora_b"].weight, 0.0, 0.02)  # nonzero: the test compares every step
        self.emb.requires_grad_(False)
        self.block["base"].requires_grad_(False)

    def forward(self, x, y):
        h = self.emb(x)
        h = h + self.block["lora_b"](self.block["lora_a"](h))
        out = self.block["base"](h).mean(dim=1)[:, :D_OUT]
        return None, F.mse_loss(out, y)


def lora_batch(step: int, rank: int, micro: int = 0, size: int = 4):
    """Token ids and a target for LoraNet; a function of (step, rank, micro) only."""
    g = torch.Generator().manual_seed(100_003 * step + 1_009 * rank + micro)
    return torch.randint(0, 1000, (size, SEQ), generator=g), torch.randn(size, D_OUT, generator=g)


def param_groups(model: nn.Module) -> list[dict]:
    """Three groups with different lr / weight decay (TinyNet or PlainNet alike)."""
    special = ("branch.", "side.", "frozen.", "head.")
    decay, no_decay, other = [], [], []
    for name, p in model.named_parameters():
        if name.startswith(special):
            other.append(p)
        elif p.dim() >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    return [
        {"params": decay, "lr": 2e-3, "weight_decay": 0.05},
        {"params": no_decay, "lr": 1e-3, "weight_decay": 0.0},
        {"params": other, "lr": 3e-3, "weight_decay": 0.1},
    ]


HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


def batch(step: int, rank: int, micro: int = 0, size: int = 4, dtype=torch.float32):
    """Input and target of one micro-batch; a function of (step, rank, micro) only."""
    g = torch.Generator().manual_seed(100_003 * step + 1_009 * rank + micro)
    x = torch.randn(size, SEQ, D_IN, generator=g)
    y = torch.randn(size, D_OUT, generator=g)
    return x.to(dtype), y.to(dtype)


def flags(step: int, rank: int) -> dict:
    """``branch`` is unused on even steps on every rank; ``side`` on rank 1 every third step."""
    return {"use_branch": step % 2 == 1, "use_side": not (rank == 1 and step % 3 == 0)}


def loss_fn(out, y):
    return F.mse_loss(out.float(), y.float())


def ddp_reference(model: nn.Module, opt_cls=torch.optim.AdamW, groups=True, **opt_kwargs):
    """``(ddp, optimizer)``: a deep copy of ``model`` in DDP and a torch optimizer (foreach=False)."""
    ref = copy.deepcopy(model)
    ddp = DDP(ref, find_unused_parameters=True)
    kwargs = dict(HYPER, foreach=False)
    kwargs.update(opt_kwargs)
    params = param_groups(ref) if groups else ref.parameters()
    return ddp, opt_cls(params, **kwargs)


def micro_steps(model, opt, step, rank, k=1, sync_ctx=None, scale=1.0, grad_scaler=None,
                dtype=torch.float32):
    """``opt.zero_grad()``, then forward/backward of ``k`` micro-batches; returns the loss.

    ``sync_ctx()`` (``no_sync``) wraps all but the last micro-batch; each micro-batch loss is
    divided by ``k`` so that accumulation equals one step on the concatenated batch.
    """
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for m in range(k):
        x, y = batch(step, rank, m, dtype=dtype)
        ctx = sync_ctx() if (sync_ctx is not None and m < k - 1) else contextlib.nullcontext()
        with ctx:
            loss = loss_fn(model(x, **flags(step, rank)), y) * (scale / k)
            total += float(loss.detach())
            (grad_scaler.scale(loss) if grad_scaler is not None else loss).backward()
    return total


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64 (‖a‖ when b is zero)."""
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    den = b.norm()
    num = (a - b).norm()
    return float(num / den) if den > 0 else float(num)


def param_error(model: nn.Module, ref: nn.Module) -> float:
    """Largest relative error over the parameters of ``model`` against ``ref`` (same names)."""
    refs = dict(ref.named_parameters())
    return max(rel(p.float(), refs[n].float()) for n, p in model.named_parameters())


def flat_full(part, values: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay ``values`` (param id -> tensor or None) out as the partition's padded flat buffer.

    Returns ``(flat, mask)``: fp64 values and a bool mask of the elements that hold a value.
    """
    layout = part.layout
    flat = torch.zeros(layout.numel, dtype=torch.float64)
    mask = torch.zeros(layout.numel, dtype=torch.bool)
    for p, slot in zip(part.params, layout.slots):
        assert slot.numel == p.numel(), (slot, tuple(p.shape))
        v = values.get(id(p))
        if v is not None:
            flat[slot.offset:slot.offset + slot.numel] = v.detach().double().flatten()
            mask[slot.offset:slot.offset + slot.numel] = True
    return flat, mask


def rank_slice(part, full: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's shard of a padded flat buffer: its slice of every bucket, concatenated."""
    pieces = [full[b.offset + rank * b.shard_numel: b.offset + (rank + 1) * b.shard_numel]
              for b in part.layout.buckets]
    return torch.cat(pieces) if pieces else full[:0]


def padding_mask(part) -> torch.Tensor:
    """Bool mask over the padded flat buffer: True on elements that belong to no parameter."""
    mask = torch.ones(part.layout.numel, dtype=torch.bool)
    for slot in part.layout.slots:
        mask[slot.offset:slot.offset + slot.numel] = False
    return mask


def grad_shard_error(opt, model: nn.Module, ref_grads: dict, rank: int) -> float:
    """Relative error of every partition's grad_shard against the DDP-averaged gradient slice.

    ``ref_grads`` maps parameter names to DDP's (averaged) ``.grad`` or None; elements of
    parameters without a reference gradient are not compared.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    got_all, want_all = [], []
    for part in opt.partitions:
        values = {id(p): ref_grads.get(names[id(p)]) for p in part.params}
        full, mask = flat_full(part, values)
        want = rank_slice(part, full, rank)
        keep = rank_slice(part, mask, rank)
        got = part.grad_shard.detach().double()
        assert got.numel() == part.layout.shard_numel, (got.numel(), part.layout.shard_numel)
        got_all.append(got[keep])
        want_all.append(want[keep])
    return rel(torch.cat(got_all), torch.cat(want_all))


def shard_state(opt, k: int, kind: str) -> torch.Tensor:
    """Partition ``k``'s whole ``kind`` shard (master, exp_avg, exp_avg_sq), through the public reader."""
    return opt.read_shard(k, kind, 0, opt.shard_index()[k].shard_numel)


def grads_of(model: nn.Module) -> dict:
    return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()
