"""Hooks that torch.compile must never trace: ``_eager_only`` (stage 3's module hooks, stages 1-2's
forward waits in behind_buckets.py), which resize storages and re-point ``p.data``.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def _eager_only(hook: Callable, on_compiled: Callable[[], None] | None = None) -> Callable:
    """``hook`` kept out of torch.compile's graph: called through ``torch.compiler.disable`` while Dynamo
    traces or compiled code runs, directly in plain eager code (the wrapper's own cost, paid per module per forward,
    is then saved).
    ``on_compiled``: called first on each call from compiled code (behind_buckets: the model is compiled)."""
    if on_compiled is not None:
        def from_compiled(*args, hook=hook):
            on_compiled()
            return hook(*args)
        disabled = torch.compiler.disable(from_compiled)
    else:
        disabled = torch.compiler.disable(hook)

    def call(*args, callback=_GET_CALLBACK or _no_callback):
        # ``call`` is inlined where Dynamo traces a module's forward (is_compiling: the hook, a graph break, runs
        # out of the graph); run from compiled code's eager frames (a graph break in the model's forward), Dynamo's
        # frame callback is set and would compile the hook's frames: it runs disabled then too
        if torch.compiler.is_compiling() or callback() is not None:
            return disabled(*args)
        if _functorch_level() is not None:  # inside torch.func.grad / vmap / jacrev: the hook's own tensors (the
            with torch._C._DisableFuncTorch():  # flat buffers, their slices) stay plain, not the transform's
                return hook(*args)
        return hook(*args)
    _skip_frame(call.__code__)
    return call


def _no_level() -> None:
    """Where torch has no functorch: no transform active."""


_functorch_level = getattr(getattr(torch._C, "_functorch", None), "maybe_current_level", _no_level)


def _no_callback() -> None:
    """Where torch has no ``get_eval_frame_callback``: no callback seen."""


def _skip_frame(code) -> None:
    """Dynamo never compiles a frame of ``code`` (``call``'s: one code object for every hook made here) on its own:
    compiled alone, once per module class and input signature that reached it, it hit Dynamo's recompile limit and
    warned at stage 3 with a unit per module. Run eagerly, it sees Dynamo's callback and runs the hook disabled.
    Only the frame: where Dynamo traces a forward it still inlines ``call`` (idempotent: a set of codes)."""
    import torch._dynamo.eval_frame  # imported already: torch.compiler.disable made the hook's twin
    skip_code = getattr(torch._dynamo.eval_frame, "skip_code", None)
    if skip_code is not None:
        skip_code(code)
_GET_CALLBACK = getattr(getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "get_eval_frame_callback", None)
