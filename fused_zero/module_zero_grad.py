"""``model.zero_grad()`` reaches the gradient shards (stages 2-3).

Stages 2-3 free ``.grad`` once a backward reduced it, and the shards stand in for it: ``nn.Module.zero_grad``
finds nothing to clear there. Gradients a backward reduced after ``step()`` would then reach the next step,
where torch's ``model.zero_grad()`` drops them: a GAN's generator loss runs backward through the
discriminator after the discriminator's step, and the DCGAN loop clears those with ``netD.zero_grad()``.

So ``nn.Module.zero_grad`` is wrapped, once, when the first optimizer whose reducer frees ``.grad`` is built:
after torch's own, each such live optimizer holding some of the module's parameters forgets their reduced
gradients (``ShardedOptimizer.zero_grad`` when the module holds all of them, else
``GradSync.forget_some``). A local operation, as torch's: no collective. A subclass overriding
``zero_grad`` without calling ``super().zero_grad()`` is not seen.
"""
from __future__ import annotations

import functools
import weakref

from torch import nn

_LIVE: "weakref.WeakSet" = weakref.WeakSet()  # optimizers whose reducer frees .grad, not closed
_ORIGINAL = None  # nn.Module.zero_grad before it was wrapped


def watch(optimizer) -> None:
    """``optimizer`` (built, its reducer freeing ``.grad``) follows ``model.zero_grad()`` from now on."""
    _install()
    _LIVE.add(optimizer)


def unwatch(optimizer) -> None:
    """``optimizer`` closed: it no longer follows ``model.zero_grad()``."""
    _LIVE.discard(optimizer)


def _install() -> None:
    global _ORIGINAL
    if _ORIGINAL is not None:
        return
    original = nn.Module.zero_grad

    @functools.wraps(original)
    def zero_grad(self: nn.Module, set_to_none: bool = True) -> None:
        original(self, set_to_none)
        if _LIVE:
            for optimizer in list(_LIVE):
                _forget(optimizer, self, set_to_none)

    nn.Module.zero_grad = zero_grad
    _ORIGINAL = original


def _forget(optimizer, module: nn.Module, set_to_none: bool) -> None:
    """The reduced gradients of ``module``'s parameters that ``optimizer`` holds, forgotten as torch's
    ``module.zero_grad(set_to_none)`` forgets their ``.grad``."""
    sync = getattr(optimizer, "grad_sync", None)
    if sync is None or optimizer.closed:
        return
    entries = sync.entries
    mine = [p for p in module.parameters() if p in entries]
    if not mine:
        return
    if len(mine) == len(entries):
        optimizer.zero_grad(set_to_none)  # (its torch part finds .grad already cleared)
    else:
        sync.forget_some(mine, set_to_none)
