"""Habits of torch users at one rank (no process group), each against torch where it has a reference:
GradScaler's current protocol, zero-element parameters, dtype and device changes after building,
writes between stage-3 steps, hand-made gradients of the wrong shape, torch's clip on freed
gradients, named param groups and state-dict hooks, per-parameter optimizer state."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from _models import HYPER, TinyNet, batch, flags, loss_fn, param_groups, rel
from fused_zero import ShardedOptimizer

TOL = 1e-6
STAGES = [1, 2, 3]


def _build(model, stage, groups=None, **kw):
    groups = groups if groups is not None else model.parameters()
    if stage == 3:
        return ShardedOptimizer(groups, module=model, **HYPER, stage=stage, bucket_numel=1000, **kw)
    return ShardedOptimizer(groups, **HYPER, stage=stage, bucket_numel=1000, **kw)


def _step(model, opt, t, scale=1.0, scaler=None):
    opt.zero_grad()
    x, y = batch(t, 0)
    loss = loss_fn(model(x, **flags(t, 0)), y) * scale
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()


def _max_error(model, opt, ref):
    with opt.full_parameters():
        refs = dict(ref.named_parameters())
        return max(rel(p, refs[n]) for n, p in model.named_parameters())


# --- GradScaler: torch's current protocol, no FutureWarning -------------------------------------

@pytest.mark.parametrize("stage", STAGES)
def test_grad_scaler_steps_without_futurewarning_and_backs_off_as_torch(stage):
    """scaler.step(opt) on the attribute protocol (torch warns when step() takes grad_scaler=): the
    overflow at step 2 is skipped and the scale backs off exactly as with torch's fused AdamW."""
    model, ref = TinyNet(), TinyNet()
    opt = _build(model, stage)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER, fused=True)
    kw = dict(init_scale=2.0 ** 10, growth_interval=2)
    scaler, ref_scaler = torch.amp.GradScaler("cpu", **kw), torch.amp.GradScaler("cpu", **kw)
    scales = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for t in range(6):
            scale = float("inf") if t == 2 else 1.0
            _step(model, opt, t, scale, scaler)
            _step(ref, ref_opt, t, scale, ref_scaler)
            scales.append((scaler.get_scale(), ref_scaler.get_scale()))
    assert all(a == b for a, b in scales), scales
    assert scales[2][0] < scales[1][0]  # backed off at the overflow
    assert _max_error(model, opt, ref) < TOL
