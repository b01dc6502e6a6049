"""Activation checkpointing (torch.utils.checkpoint), reentrant and not, at stages 2 and 3 against torch.

The reference is torch's AdamW over the same model with the gradients averaged over the ranks by hand
(all_reduce, then / N): DDP's arithmetic, which DDP itself cannot run here (reentrant checkpointing that
runs a module in two segments marks its parameters ready twice, which DDP refuses).

Two patterns need care (README, "Stage 3"):
- a module run in two checkpointed segments: with ``use_reentrant=True`` each segment's recomputation runs a
  backward of its own, so its parameters' gradients accumulate twice in one backward, the second time after
  their bucket may have been reduced (grad_sync's late gradients); at stage 3 its unit is gathered again for
  the second recomputation (the gatherer counts its gradients anew).
- a rank whose data skips the forward's last unit: reentrant checkpointing runs the units under no_grad, and
  what a training forward keeps gathered for backward must not depend on that (the ranks' gathers must pair).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from _dist import run_ranks


class _Block(nn.Module):
    """``inside``: the block's own forward checkpoints its first layer (reentrant or not), inside its unit."""

    def __init__(self, d: int = 8, inside: bool | None = None) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 24), nn.Linear(24, d)
        self.inside = inside

    def _first(self, x):
        return torch.tanh(self.fc1(x))

    def forward(self, x):
        h = self._first(x) if self.inside is None else checkpoint(self._first, x, use_reentrant=self.inside)
        return x + self.fc2(h)


class _Net(nn.Module):
    """Three blocks; ``twice`` runs block 1 in two segments (ALBERT-style sharing); ``skip_last``: this forward
    leaves block 2 out; ``lora``: each block's fc1 frozen (a frozen unit is released once its inputs' gradient
    is in too)."""

    def __init__(self, reentrant: bool | None, twice: bool, lora: bool, inside: bool | None = None) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.inp = nn.Linear(8, 8)
            self.blocks = nn.ModuleList(_Block(inside=inside) for _ in range(3))
            self.head = nn.Linear(8, 2)
        if lora:
            for b in self.blocks:
                b.fc1.requires_grad_(False)
        self.reentrant, self.twice = reentrant, twice

    def forward(self, x, skip_last: bool = False):
        h = self.inp(x)
        blocks = list(self.blocks)
        if self.twice:
            blocks.insert(2, self.blocks[1])
        if skip_last:
            blocks.pop()
        for b in blocks:
            h = b(h) if self.reentrant is None else checkpoint(b, h, use_reentrant=self.reentrant)
        return self.head(h).square().mean()


def _train(rank, world_size, stage, reentrant, twice, lora, skip_last, bucket_numel, inside=None):
    import torch.distributed as dist
    from fused_zero import ShardedOptimizer
    ref = _Net(reentrant, twice, lora, inside)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    kw = {} if bucket_numel is None else dict(bucket_numel=bucket_numel)
    opt = ShardedOptimizer(model, stage=3, lr=1e-2, min_unit_numel=0, **kw) if stage == 3 else \
        ShardedOptimizer([p for p in model.parameters() if p.requires_grad], stage=stage, lr=1e-2, **kw)
    for step in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        skip = skip_last and rank == world_size - 1 and step % 2 == 0
        ref(x, skip).backward()
        for p in ref.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if world_size > 1:
                    dist.all_reduce(p.grad)
                    p.grad /= world_size
        ref_opt.step()
        ref_opt.zero_grad()
        model(x, skip).backward()
        opt.step()
        opt.zero_grad()
    with opt.full_parameters() if stage == 3 else torch.no_grad():
        got = [p.detach().clone() for p in model.parameters()]
    return got, [p.detach().clone() for p in ref.parameters()]


def _check(results):
    for got, want in results:
        for a, b in zip(got, want):
            # the late gradient is reduced apart and added: (c1 + c2) rounds differently from c1 + c2 reduced
            # apart, within a few ulps; a gradient lost or counted twice moves a weight by ~1e-2 per step
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    firsts = [got for got, _ in results]
    assert all(torch.equal(a, b) for other in firsts[1:] for a, b in zip(firsts[0], other))  # ranks agree


@pytest.mark.parametrize("stage,world_size,bucket_numel", [(3, 1, None), (3, 2, None), (3, 3, 64), (2, 2, 64)])
def test_a_block_run_in_two_reentrant_segments_trains_as_torch(stage, world_size, bucket_numel):
    """Block 1 in two reentrant segments: its gradients come in twice in one backward (at stage 3 its unit is
    gathered for each recomputation); 64-element buckets split its parameters over buckets."""
    _check(run_ranks(_train, world_size, stage, True, True, False, False, bucket_numel, timeout=120))


@pytest.mark.parametrize("stage", [2, 3])
def test_a_frozen_block_run_in_two_reentrant_segments_trains_as_torch(stage):
    """LoRA-like blocks (fc1 frozen) under reentrant checkpointing, as peft + gradient checkpointing runs."""
    _check(run_ranks(_train, 2, stage, True, True, True, False, 64, timeout=120))


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_rank_skipping_the_last_unit_under_checkpointing_trains_as_torch(reentrant):
    """Stage 3: the last rank's data leaves the last block out on alternate steps. Before, reentrant
    checkpointing released that unit after its forward on the ranks that ran it (under no_grad) while the
    skipping rank kept it: their backward gathers paired different units (a hang, or equal-sized units mixed)."""
    _check(run_ranks(_train, 2, 3, reentrant, False, False, True, None, timeout=120))


@pytest.mark.parametrize("stage,world_size,inside,twice", [(3, 2, True, False), (3, 2, False, False), (3, 2, True, True),
                                                       (3, 2, False, True), (3, 1, True, True), (2, 2, True, True)])
def test_checkpointing_inside_a_units_forward_trains_as_torch(stage, world_size, inside, twice):
    """Each block's forward checkpoints its first layer (reentrant or not): the recomputation runs inside the unit's
    backward, with its parameters gathered; twice: block 1 runs twice per forward, so its recomputations and
    gradients come twice in one backward. Before, at stage 3 the unit was released once one call's gradients
    completed it, and the other call's reentrant recomputation read its empty placeholders ("mat2 must be a
    matrix")."""
    _check(run_ranks(_train, world_size, stage, None, twice, False, False, 64, inside, timeout=120))


def test_a_block_run_twice_without_checkpointing_is_unchanged():
    """Without checkpointing the twice-run block's gradient accumulates before its hook: no late gradient."""
    _check(run_ranks(_train, 2, 3, None, True, False, False, 64, timeout=120))


@pytest.mark.parametrize("stage,bucket_numel", [(3, None), (2, 64)])
def test_a_late_gradient_is_seen_by_the_users_hooks(stage, bucket_numel):
    """A post-accumulate-grad hook registered after the optimizer (a per-parameter clamp) sees the accumulated
    ``.grad`` at each of a reentrant block's two segments, as torch's (before: None the second time, so the
    second contribution went unclamped; 6e-3 off after three steps)."""
    from torch.utils.checkpoint import checkpoint

    from fused_zero import ShardedOptimizer

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            with torch.random.fork_rng():
                torch.manual_seed(0)
                self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
                self.head = nn.Linear(8, 2)

        def forward(self, x):
            h = self.blocks[0](x)
            for b in (self.blocks[1], self.blocks[1], self.blocks[2]):
                h = checkpoint(b, h, use_reentrant=True)
            return self.head(torch.tanh(h)).square().mean()

    seen = {"ref": [], "fz": []}

    def clamp(tag):
        def hook(p):
            seen[tag].append(None if p.grad is None else p.grad.abs().sum().item())
            if p.grad is not None:
                p.grad.clamp_(-0.01, 0.01)
        return hook

    ref, model = Net(), Net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = ShardedOptimizer(model, stage=3, lr=1e-2, min_unit_numel=0) if stage == 3 else \
        ShardedOptimizer(model.parameters(), stage=stage, lr=1e-2, bucket_numel=bucket_numel)
    ref.blocks[1].weight.register_post_accumulate_grad_hook(clamp("ref"))
    model.blocks[1].weight.register_post_accumulate_grad_hook(clamp("fz"))
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for m, o in ((ref, ref_opt), (model, opt)):
            m(x).backward()
            o.step()
            o.zero_grad()
    assert seen["fz"] == pytest.approx(seen["ref"], rel=1e-6)
    with opt.full_parameters():
        assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())) < 1e-6


def _train_whole(rank, world_size, stage, min_unit_numel, early_stop):
    """The model's whole forward under one non-reentrant checkpoint, called from outside the model."""
    import torch.distributed as dist
    import torch.utils.checkpoint as ckpt

    from fused_zero import ShardedOptimizer
    ref = _Net(None, False, False)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = ShardedOptimizer(model, stage=3, lr=1e-2, min_unit_numel=min_unit_numel) if stage == 3 else \
        ShardedOptimizer(model.parameters(), stage=stage, lr=1e-2)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        ref(x).backward()
        for p in ref.parameters():
            if world_size > 1:
                dist.all_reduce(p.grad)
                p.grad /= world_size
        ref_opt.step()
        ref_opt.zero_grad()
        with ckpt.set_checkpoint_early_stop(early_stop):
            checkpoint(model, x, use_reentrant=False).backward()
        opt.step()
        opt.zero_grad()
    with opt.full_parameters() if stage == 3 else torch.no_grad():
        got = [p.detach().clone() for p in model.parameters()]
    return got, [p.detach().clone() for p in ref.parameters()]


@pytest.mark.parametrize("stage,world_size,min_unit_numel,early_stop", [
    (3, 1, 1 << 20, True), (3, 2, 1 << 20, True), (3, 2, 0, True), (3, 2, 1 << 20, False), (2, 2, 1 << 20, True)])
def test_the_whole_model_under_one_checkpoint_trains_as_torch(stage, world_size, min_unit_numel, early_stop):
    """``checkpoint(model, x, use_reentrant=False)`` around the root's whole forward (default units: one, the
    root's; ``min_unit_numel=0``: a unit per block inside it). Recomputation stops early by raising through the
    modules once backward has what it needs; at stage 3 the root's forward hook took that for a failed forward
    and released every unit while backward still read them (a storage-size error in backward)."""
    _check(run_ranks(_train_whole, world_size, stage, min_unit_numel, early_stop, timeout=120))
