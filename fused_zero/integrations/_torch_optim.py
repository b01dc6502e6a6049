"""A torch.optim.AdamW or Adam, as a framework user configured it, turned into a ShardedOptimizer.

Frameworks (Accelerate's ``prepare``, Lightning's ``configure_optimizers``) hand over an optimizer
the user built; the integrations replace it with a ShardedOptimizer over the same parameters,
param groups and hyperparameters. The new optimizer takes over the old one's param group dicts
themselves, so an LR scheduler still pointing at the old optimizer keeps steering the learning
rate; ``repoint_scheduler`` moves a scheduler (and the schedulers inside SequentialLR or
ChainedScheduler) over so that its step bookkeeping follows the new optimizer too.
"""
from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

from ..config import ZeroConfig
from ..optimizer import ShardedOptimizer

#: The torch optimizers a ShardedOptimizer computes exactly (torch.optim.Adam is AdamW's L2 form).
CONVERTIBLE = (torch.optim.AdamW, torch.optim.Adam)


def unwrap_optimizer(optimizer):
    """The optimizer inside framework wrappers (Accelerate's AcceleratedOptimizer, Lightning's)."""
    seen = set()
    while not isinstance(optimizer, (ShardedOptimizer, *CONVERTIBLE)) and hasattr(optimizer, "optimizer") \
            and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    return optimizer


def check_convertible(optimizer, where: str) -> None:
    """Raise a TypeError naming what is supported unless ``optimizer`` can become a ShardedOptimizer."""
    if isinstance(optimizer, ShardedOptimizer) or type(optimizer) in CONVERTIBLE:
        return
    raise TypeError(
        f"{where} got a {type(optimizer).__module__}.{type(optimizer).__name__}; fused_zero shards AdamW: "
        "return torch.optim.AdamW or torch.optim.Adam (it becomes a fused_zero.ShardedOptimizer with the same "
        "param groups and hyperparameters), or a fused_zero.ShardedOptimizer itself")


def sharded_from_torch(optimizer: torch.optim.Optimizer, config: ZeroConfig, module: nn.Module | None = None,
                       process_group=None, units=None) -> ShardedOptimizer:
    """A ShardedOptimizer over ``optimizer``'s param groups (the same dicts) and hyperparameters.

    ``module`` is the model the parameters belong to (stage 3 needs it; at every stage it names
    the parameters in errors and checkpoints); ``units`` are stage 3's, as ShardedOptimizer takes them. A torch optimizer that already stepped is refused:
    build the framework's optimizer fresh, or load its state_dict into the ShardedOptimizer.
    """
    check_convertible(optimizer, "fused_zero")
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer
    if optimizer.state:
        raise ValueError(f"this {type(optimizer).__name__} has already stepped (it holds optimizer state); "
                         "hand the framework a fresh optimizer, or load its state_dict() into the "
                         "fused_zero.ShardedOptimizer after it was built")
    defaults = optimizer.defaults
    if type(optimizer) is torch.optim.Adam:  # Adam's weight decay is L2, unless decoupled (then it is AdamW)
        for group in optimizer.param_groups:
            group["decoupled_weight_decay"] = bool(group.get("decoupled_weight_decay", False))
    else:
        for group in optimizer.param_groups:
            group["decoupled_weight_decay"] = True
    keep = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
            "differentiable", "fused")
    kwargs = {k: defaults[k] for k in keep if k in defaults}
    groups = optimizer.param_groups
    if module is not None:
        owned = {p for p in module.parameters()}
        stray = [p for g in groups for p in g["params"] if p not in owned]
        if stray:
            raise ValueError(f"the optimizer holds {len(stray)} parameters that are not the model's; "
                             "build the optimizer over model.parameters() (or its param groups)")
    return ShardedOptimizer(groups, **kwargs, config=config, process_group=process_group, module=module,
                            units=units)


def track_step_called(optimizer) -> None:
    """What torch's LRScheduler does to the optimizer it is built with: mark ``optimizer.step`` as called.

    The wrapper keeps step()'s signature visible (functools.wraps).
    """
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    ref = weakref.ref(optimizer)
    func = optimizer.step.__func__

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        opt = ref()
        opt._opt_called = True
        return func.__get__(opt, type(opt))(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    optimizer.step = wrapper


def _point(scheduler, old, new) -> bool:
    found = getattr(scheduler, "optimizer", None) is old
    if found:
        scheduler.optimizer = new
    for inner in getattr(scheduler, "_schedulers", ()) or ():  # SequentialLR, ChainedScheduler
        found = _point(inner, old, new) or found
    return found


def repoint_scheduler(scheduler, old, new) -> bool:
    """Make ``scheduler`` (and any scheduler inside it) drive ``new`` where it drove ``old``.

    Returns whether anything pointed at ``old``.
    """
    found = _point(scheduler, old, new)
    if found:
        track_step_called(new)
    return found
