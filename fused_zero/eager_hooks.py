"""Hooks that torch.compile must never trace: ``_eager_only`` (stage 3's module hooks, stages 1-2's
forward waits in behind_buckets.py), which resize storages and re-point ``p.data``.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def _eager_only(hook: Callable, on_compiled: Callable[[], None] | None = None) -> Callable:
    """``hook`` kept out of torch.compile's graph: called through ``torch.compiler.disable`` while Dynamo
    traces, directly otherwise (the wrapper's own cost, paid per module per forward, is then saved).
    ``on_compiled``: called first on each call from compiled code (behind_buckets: the model is compiled)."""
    if on_compiled is not None:
        def from_compiled(*args, hook=hook):
            on_compiled()
            return hook(*args)
        disabled = torch.compiler.disable(from_compiled)
    else:
        disabled = torch.compiler.disable(hook)

    def call(*args):
        if torch.compiler.is_compiling():
            return disabled(*args)
        return hook(*args)
    return call
