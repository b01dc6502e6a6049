"""Loads in the orders users and frameworks make them resume exactly.

- bf16 parameters: the weights loaded again after the optimizer's state (torch.distributed.checkpoint's
  ``set_state_dict`` loads the optimizer, then the model, after ``dcp.load`` wrote the weights in place) keep the
  fp32 masters loaded with the state, at stages 1-3 (stages 1-2 took the masters back from the bf16 weights).
- Stage 3: ``fused_zero.checkpoint.load`` and ``load_state_dict`` inside ``full_parameters(writeback=True)`` (the
  stage-3 recipe wraps its loads in it): the block holds the loaded values, and its writeback keeps them (it wrote
  the block's pre-load copies back over the loaded masters, frozen weights included).
"""
import contextlib
import copy

import pytest
import torch
from torch import nn

from fused_zero import ShardedOptimizer, checkpoint


class _Net(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.fc, self.head = nn.Embedding(10, 8), nn.Linear(8, 16), nn.Linear(16, 10)
        self.frozen = nn.Linear(16, 16)  # a frozen base layer (LoRA-like): its weights load too
        self.frozen.requires_grad_(False)
        self.to(dtype)

    def forward(self, x):
        return self.head(self.frozen(torch.relu(self.fc(self.emb(x)))))


def _build(stage, dtype):
    model = _Net(dtype)
    opt = ShardedOptimizer(model if stage == 3 else [p for p in model.parameters() if p.requires_grad],
                           stage=stage, lr=5e-3, **({"min_unit_numel": 0} if stage == 3 else {}))
    return model, opt


def _train(model, opt, steps):
    for t in steps:
        g = torch.Generator().manual_seed(t)
        x, y = torch.randint(0, 10, (8,), generator=g), torch.randint(0, 10, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x).float(), y).backward()
        opt.step()


def _full(opt, stage, writeback=False):
    return opt.full_parameters(writeback=writeback) if stage == 3 else contextlib.nullcontext()


def _params(model, opt, stage):
    with _full(opt, stage):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_weights_loaded_again_after_the_state_keep_the_masters(stage):
    model, opt = _build(stage, torch.bfloat16)
    _train(model, opt, range(3))
    with _full(opt, stage):
        weights = copy.deepcopy(model.state_dict())
    sd = opt.state_dict()
    _train(model, opt, range(3, 6))
    want = _params(model, opt, stage)
    fresh, fresh_opt = _build(stage, torch.bfloat16)
    for load in (lambda: fresh.load_state_dict(weights), lambda: fresh_opt.load_state_dict(sd),
                 lambda: fresh.load_state_dict(weights)):
        with _full(fresh_opt, stage, writeback=True):
            load()
    _train(fresh, fresh_opt, range(3, 6))
    got = _params(fresh, fresh_opt, stage)
    assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("how", ["checkpoint.load", "load_state_dict"])
def test_stage3_loads_inside_a_writeback_block_are_kept(how, dtype, tmp_path):
    model, opt = _build(3, dtype)
    _train(model, opt, range(3))
    checkpoint.save(str(tmp_path), model, opt)
    with opt.full_parameters():
        weights = copy.deepcopy(model.state_dict())
    sd = opt.state_dict()
    _train(model, opt, range(3, 5))
    want = _params(model, opt, 3)
    fresh, fresh_opt = _build(3, dtype)
    fresh.frozen.weight.data = torch.zeros(16, 16, dtype=dtype)  # (assigned: the load must replace it)
    with fresh_opt.full_parameters(writeback=True):
        if how == "checkpoint.load":
            checkpoint.load(str(tmp_path), fresh, fresh_opt)
        else:
            fresh.load_state_dict(weights)
            fresh_opt.load_state_dict(sd)
        inside = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    assert all(torch.equal(inside[n], weights[n]) for n in weights)  # the block holds what was loaded
    _train(fresh, fresh_opt, range(3, 5))
    got = _params(fresh, fresh_opt, 3)
    assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]


def _inside_writeback_on_ranks(rank, world_size, folder):
    model, opt = _build(3, torch.bfloat16)
    _train(model, opt, range(3))
    checkpoint.save(folder, model, opt)
    _train(model, opt, range(3, 5))
    want = _params(model, opt, 3)
    fresh, fresh_opt = _build(3, torch.bfloat16)
    with fresh_opt.full_parameters(writeback=True):
        checkpoint.load(folder, fresh, fresh_opt)
    _train(fresh, fresh_opt, range(3, 5))
    got = _params(fresh, fresh_opt, 3)
    return [n for n in want if not torch.equal(got[n], want[n])]


def test_stage3_checkpoint_load_inside_a_writeback_block_on_two_ranks(tmp_path):
    from _dist import run_ranks
    assert run_ranks(_inside_writeback_on_ranks, 2, str(tmp_path), timeout=180) == [[], []]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_weights_of_another_step_restored_reset_the_masters(stage):
    """A restart (the initial weights and the initial, empty optimizer state loaded into a trained run) equals a
    fresh run: the masters of weights that changed are taken from them whole, not kept where an element's bf16
    value happened not to move."""
    model, opt = _build(stage, torch.bfloat16)
    initial = _params(model, opt, stage)
    empty = opt.state_dict()
    _train(model, opt, range(3))
    with _full(opt, stage, writeback=True):
        model.load_state_dict(initial, strict=False)
    opt.load_state_dict(empty)
    _train(model, opt, range(3))
    fresh, fresh_opt = _build(stage, torch.bfloat16)
    _train(fresh, fresh_opt, range(3))
    got, want = _params(model, opt, stage), _params(fresh, fresh_opt, stage)
    assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]
