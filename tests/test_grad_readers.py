"""Code around step() that reads .grad (grad_readers.py): an optimizer wrapping ShardedOptimizer (timm's Lookahead,
SAM) or a subclass's step() override (gradient centralization).

At stage 1 such code trains as it does over torch's AdamW (``.grad`` is the local gradient after backward). At
stages 2-3 ``.grad`` is None after backward, so it would silently do nothing (Lookahead 5e-2 off torch after six
steps, a centralizing subclass 2e-1): step() refuses it on every rank, before any collective, naming the method.
Wrappers and overrides that read no ``.grad`` (a warm-up, a delegating wrapper, ``torch.autograd.grad``) are not
refused.
"""
from collections import defaultdict

import pytest
import torch

from _dist import run_ranks
from _models import TinyNet, batch, flags, loss_fn, rel
from fused_zero import ShardedOptimizer

TOL = 1e-6
LR = 1e-2


class _Wrapping(torch.optim.Optimizer):
    """An optimizer over ``base``'s param groups, as third-party wrappers are made (torch.optim's constructor not
    called): the base's state unless given its own."""

    def __init__(self, base, state=None):
        self.base, self.param_groups, self.defaults = base, base.param_groups, base.defaults
        self.state = base.state if state is None else state
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

    def zero_grad(self, set_to_none=True):
        self.base.zero_grad(set_to_none)


class Lookahead(_Wrapping):
    """timm's Lookahead, in its logic: every k steps the weights move halfway back to slow copies kept in state."""

    def __init__(self, base, alpha=0.5, k=2):
        super().__init__(base, defaultdict(dict))
        self.alpha, self.k, self.count = alpha, k, 0

    @torch.no_grad()
    def update_slow(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                slow = self.state[p].setdefault("slow", p.detach().clone())
                slow.add_(p - slow, alpha=self.alpha)
                p.copy_(slow)

    def step(self, closure=None):
        loss = self.base.step(closure)
        self.count += 1
        if self.count % self.k == 0:
            self.update_slow()
        return loss


def _centralize(opt):
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None and p.dim() > 1:
                p.grad.sub_(p.grad.mean(dim=tuple(range(1, p.dim())), keepdim=True))


def _centralized(base):
    class Centralized(base):  # gradient centralization (Yong et al. 2020) as a step() override
        def step(self, closure=None):
            _centralize(self)
            return super().step(closure)
    return Centralized


def _warmup(base):
    class Warmup(base):  # reads no .grad
        def step(self, closure=None):
            for g in self.param_groups:
                g["lr"] = LR * 0.5
            return super().step(closure)
    return Warmup


class Delegating(_Wrapping):
    """A wrapper that reads no .grad (as accelerate's AcceleratedOptimizer), though its step names autograd.grad."""

    def __init__(self, base, grad_probe=False):
        super().__init__(base)
        self.grad_probe = grad_probe

    def step(self, closure=None):
        if self.grad_probe and closure is not None:  # (off here)
            with torch.enable_grad():
                torch.autograd.grad(closure(), self.param_groups[0]["params"])
        return self.base.step(closure)


class SAM(_Wrapping):
    """davda54's SAM, in its logic: ascend along the gradient, backward again, restore the weights, step."""

    def __init__(self, base, rho=0.05):
        super().__init__(base)
        self.rho, self.old = rho, {}

    @torch.no_grad()
    def first_step(self):
        ps = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.norm(torch.stack([p.grad.norm() for p in ps]))
        for p in ps:
            self.old[p] = p.detach().clone()
            p.add_(p.grad * (self.rho / (norm + 1e-12)))
        self.base.zero_grad()

    @torch.no_grad()
    def second_step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                p.copy_(self.old[p])
        self.base.step()
        self.base.zero_grad()


def _build(model, stage, cls=ShardedOptimizer):
    return cls(model if stage == 3 else model.parameters(), lr=LR, stage=stage, bucket_numel=1000)


def _backward(model, t, rank=0):
    x, y = batch(t, rank)
    loss_fn(model(x, **flags(t, rank)), y).backward()


def _train(model, opt, steps=6, rank=0, step=None):
    for t in range(steps):
        opt.zero_grad()
        _backward(model, t, rank)
        (step or opt.step)()


def _weights(model, opt):
    with (opt.full_parameters() if isinstance(opt, ShardedOptimizer) else torch.no_grad()):
        return [p.detach().clone() for p in model.parameters()]


def _err(got, want):
    return max(rel(a, b) for a, b in zip(got, want))


def _wrapped(kind, model, stage):
    if kind == "lookahead":
        return Lookahead(_build(model, stage))
    if kind == "centralized":
        return _build(model, stage, _centralized(ShardedOptimizer))
    if kind == "warmup":
        return _build(model, stage, _warmup(ShardedOptimizer))
    return Delegating(_build(model, stage))


def _reference(kind, model):
    base = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    if kind == "lookahead":
        return Lookahead(base)
    if kind == "centralized":
        return _centralized(torch.optim.AdamW)(model.parameters(), lr=LR, foreach=False)
    if kind == "warmup":
        return _warmup(torch.optim.AdamW)(model.parameters(), lr=LR, foreach=False)
    return Delegating(base)


@pytest.mark.parametrize("kind", ["lookahead", "centralized", "warmup", "delegating"])
def test_at_stage_1_wrappers_and_overrides_train_as_over_torchs_adamw(kind):
    model, ref = TinyNet(), TinyNet()
    opt, ref_opt = _wrapped(kind, model, 1), _reference(kind, ref)
    _train(model, opt)
    _train(ref, ref_opt)
    assert _err(_weights(model, opt.base if hasattr(opt, "base") else opt), _weights(ref, ref_opt)) < TOL


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("kind", ["warmup", "delegating"])
def test_wrappers_and_overrides_that_read_no_grad_are_served_at_stages_2_3(kind, stage):
    model, ref = TinyNet(), TinyNet()
    opt, ref_opt = _wrapped(kind, model, stage), _reference(kind, ref)
    _train(model, opt)
    _train(ref, ref_opt)
    assert _err(_weights(model, opt.base if hasattr(opt, "base") else opt), _weights(ref, ref_opt)) < TOL


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("kind,where", [("lookahead", "Lookahead.step"), ("centralized", "Centralized.step")])
def test_wrappers_and_overrides_reading_grad_are_refused_at_stages_2_3(kind, where, stage):
    model = TinyNet()
    opt = _wrapped(kind, model, stage)
    sharded = opt.base if hasattr(opt, "base") else opt
    plain = lambda: ShardedOptimizer.step(sharded)  # noqa: E731 - without the wrapper or the override
    _train(model, sharded, steps=2, step=plain)
    before = _weights(model, sharded)
    opt.zero_grad()
    _backward(model, 2)
    with pytest.raises(RuntimeError, match=rf"^{where} \(around ShardedOptimizer.step\(\)\) reads .grad.*stage=1"):
        opt.step()
    assert _err(_weights(model, sharded), before) == 0  # nothing changed
    plain()  # the refused step's gradients are still there for a plain one
    assert _err(_weights(model, sharded), before) > 0


def test_sam_is_refused_in_its_second_step_at_stage_2():
    """SAM's first backward under no_sync() (so its first_step finds local .grad), the second synced: second_step
    finds no .grad and would step from the perturbed weights (2e-1 off torch); refused, naming it."""
    model = TinyNet()
    sam = SAM(_build(model, 2))
    with sam.base.no_sync():
        _backward(model, 0)
    sam.first_step()
    _backward(model, 0)
    with pytest.raises(RuntimeError, match=r"^SAM.second_step \(around ShardedOptimizer.step\(\)\) reads .grad"):
        sam.second_step()


def _refused_on_each_rank(rank, world_size, stage):
    model = TinyNet()
    opt = Lookahead(_build(model, stage))
    opt.zero_grad()
    _backward(model, 0, rank)
    try:
        opt.step()
    except RuntimeError as e:
        refused = str(e).split(" (")[0]
    else:
        refused = None
    _train(model, opt.base, steps=2, rank=rank)  # the ranks go on together
    return refused, [p.detach().clone() for p in _weights(model, opt.base)]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_wrapper_reading_grad_is_refused_on_every_rank_before_any_collective(stage):
    (r0, w0), (r1, w1) = run_ranks(_refused_on_each_rank, 2, stage)
    assert r0 == r1 == "Lookahead.step"
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
