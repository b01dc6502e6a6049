"""The optimizer's autograd hooks: one per parameter, held by weak reference.

torch keeps a parameter's post-accumulate-grad hooks (and the module hooks of
stage 3) for as long as the parameter or module lives. A closure over the
optimizer would keep a dropped optimizer alive and firing into the next one
(a sweep, a notebook, a rebuild after loading). The hooks here reach their
owner through a weak reference, do nothing once it is gone, and are removed
when the owner closes, is rebuilt or is garbage-collected.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch


class Relay:
    """Calls ``getattr(owner, method)(*args)`` while the owner lives; a no-op after."""

    __slots__ = ("owner", "method")

    def __init__(self, owner: Any, method: str) -> None:
        self.owner = weakref.ref(owner)
        self.method = method

    def __call__(self, *args):
        owner = self.owner()
        if owner is not None:
            return getattr(owner, self.method)(*args)
        return None


class HookSet:
    """Hooks registered on behalf of ``owner``; ``remove()`` takes them all off."""

    def __init__(self, owner: Any) -> None:
        self._owner = weakref.ref(owner)  # the owner holds this set: no cycle through it
        self._handles: list = []
        # Also removed when the owner is collected without close().
        self._finalizer = weakref.finalize(owner, HookSet._remove_all, self._handles)

    def relay(self, method: str) -> Callable:
        """A callable that forwards to ``owner.method`` without keeping the owner alive."""
        return Relay(self._owner(), method)

    def grad(self, p: torch.nn.Parameter, method: str) -> None:
        """``owner.method(p)`` after ``p``'s gradient is accumulated."""
        self._handles.append(p.register_post_accumulate_grad_hook(self.relay(method)))

    def add(self, handle) -> None:
        """Own a handle registered elsewhere (a module or tensor hook built with ``relay``)."""
        self._handles.append(handle)

    def remove(self) -> None:
        HookSet._remove_all(self._handles)

    @staticmethod
    def _remove_all(handles: list) -> None:
        for h in handles:
            h.remove()
        handles.clear()
