"""The user's model after the optimizer hooked it: copies of it, and its modules called on their own.

- ``copy.deepcopy(model)``, ``swa_utils.AveragedModel(model)`` and ``torch.save(model)`` give a plain model:
  fused_zero's hooks come along as inert ones, so a copy's forward gathers nothing and joins no collective
  (at stage 2 with the model given, the buffer broadcast stays the original's). At stage 3 a copy taken
  inside ``full_parameters()`` computes what the model does; one taken while the parameters were released
  refuses to run, naming the fix.
- Stage 3: a module that is not a unit's own (a Linear inside a unit's block, a small model folded into
  the root, an embedding outside the units) called directly between steps gathers the units that hold its
  parameters, as a unit's module gathers its unit, with and without gradients; training then goes on
  equal to a run without those calls.
"""
import copy
import io

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from _dist import run_ranks
from _models import PlainNet, batch, loss_fn
from fused_zero import ShardedOptimizer


def _step(model, opt, t, rank=0):
    x, y = batch(t, rank)
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()


def _copies(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return {"deepcopy": copy.deepcopy(model), "AveragedModel": AveragedModel(model),
            "torch.save": torch.load(buf, weights_only=False)}


@pytest.mark.parametrize("units", [None, "per module"])
def test_stage3_copies_inside_full_parameters_are_plain_models(units):
    model, ref = PlainNet(), PlainNet()
    opt = ShardedOptimizer(model, stage=3, lr=1e-2, **({"min_unit_numel": 0} if units else {}))
    ref_opt = ShardedOptimizer(ref, stage=3, lr=1e-2, **({"min_unit_numel": 0} if units else {}))
    for t in range(2):
        _step(model, opt, t)
        _step(ref, ref_opt, t)
    x, _ = batch(5, 0)
    with opt.full_parameters():
        expected = model(x)
        copies = _copies(model)
    for name, c in copies.items():
        with torch.no_grad():
            assert torch.equal(c(x), expected), name
        # the copy trains on its own, as any module: a torch optimizer over it
        c_opt = torch.optim.SGD(c.parameters(), lr=0.1)
        loss_fn(c(x), batch(5, 0)[1]).backward()
        c_opt.step()
    for t in range(2, 4):  # the model trains on, untouched by its copies
        _step(model, opt, t)
        _step(ref, ref_opt, t)
    with opt.full_parameters(), ref_opt.full_parameters():
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_stage3_copy_of_released_parameters_refuses_to_run():
    model = PlainNet()
    opt = ShardedOptimizer(model, stage=3, lr=1e-2)
    _step(model, opt, 0)
    x, _ = batch(1, 0)
    for name, c in _copies(model).items():
        with pytest.raises(RuntimeError, match="full_parameters"):
            c(x)
        # `best = copy.deepcopy(model); torch.save(best.state_dict(), ...)` would save 0-element tensors
        with pytest.raises(RuntimeError, match="made while its parameters were released"):
            c.state_dict()
    with opt.full_parameters():
        kept = _copies(model)
    for name, c in kept.items():  # copied whole: a plain model's state dict
        assert all(t.numel() > 0 for t in c.state_dict().values()), name


class Embedded(nn.Module):
    """An embedding and a head outside the units (``units=[nn.Sequential]``): both held by the root."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.emb = nn.Linear(16, 32)
            self.body = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
            self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(self.body(self.emb(x))).mean(dim=1)


class Folded(nn.Module):
    """Two small Linears: their default units merge into one, which the root then holds (no unit hooks)."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.emb, self.head = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x))).mean(dim=1)


#: the module called directly: a Linear inside a unit's Sequential (PlainNet), one of a model folded into the
#: root, and one the root holds beside explicit units
MODELS = {"unit's child": (PlainNet, {}, lambda m: m.layers[0]), "folded": (Folded, {}, lambda m: m.emb),
          "root-held": (Embedded, {"units": [nn.Sequential]}, lambda m: m.emb)}


def _direct_calls_rank(rank, world_size, model_name):
    cls, kw, pick = MODELS[model_name]
    model, ref = cls(), cls()
    opt = ShardedOptimizer(model, stage=3, lr=1e-2, **kw)
    ref_opt = ShardedOptimizer(ref, stage=3, lr=1e-2, **kw)
    first, ref_first = pick(model), pick(ref)
    x, _ = batch(9, rank)
    out = {}
    for t in range(4):
        _step(model, opt, t, rank)
        _step(ref, ref_opt, t, rank)
        with torch.no_grad():
            direct = first(x)
        with ref_opt.full_parameters():
            expected = ref_first(x)
        out[f"no_grad_{t}"] = torch.equal(direct, expected)
        out[f"released_{t}"] = all(p.numel() == 0 for p in first.parameters())
        if t == 2:  # with gradients: a loss through the module alone, its backward, then a normal step
            opt.zero_grad()
            first(x).square().mean().backward()
            out["grads_reduced"] = opt.clip_grad_norm_(1e9).item() > 0
    with opt.full_parameters(), ref_opt.full_parameters():
        out["equal"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    return out


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_stage3_module_called_directly(model_name, world_size):
    for out in run_ranks(_direct_calls_rank, world_size, model_name):
        assert all(out.values()), out


def _stage2_copy_rank(rank, world_size):
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 8))
    opt = ShardedOptimizer(model, stage=2, lr=1e-2)  # given the model: broadcasts rank 0's buffers
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    opt.step()
    if rank == 0:  # a copy evaluated on one rank only: no collective may hide in its forward
        ema = copy.deepcopy(model)
        ema(x)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_stage2_copy_forward_on_one_rank_joins_no_collective():
    a, b = run_ranks(_stage2_copy_rank, 2, timeout=60)  # (a collective in the copy's forward: a hang)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.emb = nn.Embedding(16, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.emb.weight  # tied

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.head(h).square().mean()


def test_stage3_state_dict_taken_inside_full_parameters_stays_valid_after():
    """`with opt.full_parameters(): sd = model.state_dict()`, then save or load sd after the block: the entries
    were views of buffers the block gives back (reading them crashed the process). Now each parameter's entry
    is a copy, tied names sharing one, and loads into a plain model as torch's does."""
    model, ref = _Tied(), _Tied()
    opt = ShardedOptimizer(model, stage=3, lr=1e-2, min_unit_numel=0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for t in range(2):
        ids = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(t))
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(ids).backward()
            o.step()
    with opt.full_parameters():
        sd = model.state_dict()
    want = ref.state_dict()
    assert sd.keys() == want.keys() and all(torch.equal(sd[k], want[k]) for k in want)
    assert sd["emb.weight"] is sd["head.weight"]  # tied: one copy
    buf = io.BytesIO()
    torch.save(sd, buf)
    plain = _Tied()
    plain.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), ref.parameters()))
    with opt.full_parameters():  # the next step's gathers leave the copies alone
        pass
    assert all(torch.equal(sd[k], want[k]) for k in want)


class _Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return h


class _LM(nn.Module):
    """A body of layers and a head, called child by child (``h = model.body(x)``, ``model.head(h)``, as HF code
    often does): the model's own forward never runs, and the head's parameters are the root's."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.body = _Body()
            self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(self.body(x))


def _children_two_backwards(model, x, y, pattern):
    h = model.body(x)
    loss = loss_fn(model.head(h).mean(dim=1), y)
    if pattern == "retain_graph":
        loss.backward(retain_graph=True)
        (loss * 0.5).backward()
    else:  # a second loss on the body's output after the first backward
        loss.backward(retain_graph=True)
        h.square().mean().backward()


def _children_rank(rank, world_size, pattern, per_module):
    model, ref = _LM(), _LM()
    opt = ShardedOptimizer(model, stage=3, lr=1e-2, **({"min_unit_numel": 0} if per_module else {}))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    for t in range(3):
        opt.zero_grad()
        x, y = batch(t, rank)
        _children_two_backwards(model, x, y, pattern)
        opt.step()
        ref_opt.zero_grad()  # every rank's batch on one copy, averaged: what the ranks' reduction gives
        for r in range(world_size):
            xr, yr = batch(t, r)
            _children_two_backwards(ref, xr, yr, pattern)
        for p in ref.parameters():
            p.grad /= world_size
        ref_opt.step()
    with opt.full_parameters():
        return max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))


def _children_cases(rank, world_size):
    return {(pattern, per_module): _children_rank(rank, world_size, pattern, per_module)
            for pattern in ("retain_graph", "second_loss") for per_module in (False, True)}


@pytest.mark.parametrize("world_size", [1, 2])
def test_stage3_children_called_directly_then_two_backwards_match_torch(world_size):
    """The first backward's end released the head (the root's unit); the second backward then read its empty
    placeholder (a torch size error). A direct call's outputs now gather its owners for every backward. Both
    patterns, with the default units and one unit per module, in one spawn."""
    for errors in run_ranks(_children_cases, world_size):
        assert all(err < 1e-6 for err in errors.values()), errors
