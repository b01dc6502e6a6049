"""Which live fused_zero object owns a parameter, so that a new optimizer can take over.

A sweep, a notebook or a rebuild after loading builds a second optimizer over
the same model. The first one's hooks would still reduce (and free) the
gradients, and at stage 3 its gatherer still holds the parameters' only full
copy. Every optimizer (and stage-3 gatherer) claims its parameters here; a new
claim closes the previous live owners first (collectively: every rank builds the
new optimizer), and a closed optimizer refuses to step.
"""
from __future__ import annotations

import weakref

import torch

_owners: dict[int, list[weakref.ref]] = {}


def claim(owner, params: list[torch.nn.Parameter]) -> list:
    """Record ``owner`` for ``params``; return the other live owners of any of them (to close)."""
    previous = []
    for p in params:
        refs = _owners.get(id(p), [])
        for ref in refs:
            other = ref()
            if other is not None and other is not owner and other.owns(p) and other not in previous:
                previous.append(other)
        refs = [r for r in refs if r() is not None and r() is not owner]
        refs.append(weakref.ref(owner))
        _owners[id(p)] = refs
    return previous


def held(p: torch.nn.Parameter) -> bool:
    """Whether a live, open fused_zero object holds ``p`` (another optimizer trains it)."""
    return any(o is not None and o.owns(p) for o in (r() for r in _owners.get(id(p), ())))


def release(owner, params: list[torch.nn.Parameter]) -> None:
    """``owner`` no longer owns ``params``."""
    for p in params:
        refs = [r for r in _owners.get(id(p), []) if r() is not None and r() is not owner]
        if refs:
            _owners[id(p)] = refs
        else:
            _owners.pop(id(p), None)


_on_group: dict[object, list[weakref.ref]] = {}


def others_on_group(owner, group) -> bool:
    """Record ``owner`` as reducing over process group ``group`` (None: the default group); whether another live,
    open optimizer already does (two optimizers trained by one backward would interleave their reductions on
    it in an order that moves with timing: the later one reduces over a group of its own)."""
    live = [(r, r()) for r in _on_group.get(group, [])]  # (each dereferenced once: a collection may run between)
    live = [(r, o) for r, o in live if o is not None and o is not owner]
    _on_group[group] = [r for r, _ in live] + [weakref.ref(owner)]
    return any(not o._closed for _, o in live)
