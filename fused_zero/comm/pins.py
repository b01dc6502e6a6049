"""The pinned aliases that every tensor handed to torch.distributed travels as (no torch.distributed here).

Why every tensor a collective is given is a pinned alias (a clean exit). A torch Work
holds the tensors it was given, and in torch >= 2.10 a tensor whose C++ reference count
falls from 2 to 1 releases its Python object, which takes the GIL. gloo runs each Work on a
thread of its own and lets go of it just after marking it complete; when Python already
dropped the Work, that thread is the last owner and takes the GIL to free the tensors'
Python objects. A thread that asks for the GIL while the interpreter exits is ended inside
a C++ destructor: "terminate called without an active exception", SIGABRT, in about one
run in five when the last step's collectives were released just before the script ended.
So ``Comm._launch`` (collectives.py) hands torch.distributed fresh aliases of the caller's tensors (views that no
other object references) and pins each alias with one more C++ reference (``_Pin``) before
the collective starts: whoever destroys the Work then takes the aliases' counts down to 2,
never to 1, and needs no GIL. A pin is released on this thread (it holds the GIL) once every
alias's count is back to 2 (the Work is gone); at exit (collectives.py's ``atexit`` hook, which runs
before the interpreter finalizes) the pins still held are kept for good, and the hook lets go
of the GIL for a moment, so that a thread finishing a collective fused_zero did not issue (a
framework's loss gather: Accelerate's, Trainer's) takes it while it still can.
"""
from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple

import torch


class _Pin(NamedTuple):
    """Aliases handed to one collective and one more C++ reference to each (see "pinned alias")."""

    aliases: tuple[torch.Tensor, ...]
    pin: Any  # a torch.ScriptList of the aliases: a C++ reference, so a Work's release never frees them

    def released(self) -> bool:
        """The collective's Work is gone: only the alias's Python object and the pin hold each alias."""
        return all(a._use_count() == 2 for a in self.aliases)


_PINS: deque[_Pin] = deque()  # oldest first, for every communicator of this process
_pin_scan_at = 64  # the deque's length that triggers a full pass


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A view of all of ``t`` that no other object references (its own C++ reference count)."""
    return t.view(t.shape)


def _reap() -> None:
    """Release the pins whose collectives' Works are gone (here, on the thread that holds the GIL).

    Oldest first; and once the deque doubled since the last full pass, also those behind a Work
    still held (a unit's gathers in flight), so one long-held Work never keeps later aliases
    and their storages alive (amortised O(1) a launch).
    """
    global _pin_scan_at
    while _PINS and _PINS[0].released():
        _PINS.popleft()
    if len(_PINS) > _pin_scan_at:
        held = [p for p in _PINS if not p.released()]
        _PINS.clear()
        _PINS.extend(held)
        _pin_scan_at = 2 * len(held) + 64

