"""``user_stacklevel()``: the ``stacklevel`` that makes a warning name the user's line, not fused_zero's or torch's."""
from __future__ import annotations

import sys

_OWN = ("fused_zero", "torch")


def library_module(name: str) -> bool:
    """Whether the module named ``name`` is fused_zero's or torch's (a package or one of its modules)."""
    return any(name == top or name.startswith(top + ".") for top in _OWN)


def _ours(frame) -> bool:
    """A frame of fused_zero's or torch's code (by module: a dataclass's generated ``__init__`` has no file of its
    own but runs in its class's module)."""
    return library_module(frame.f_globals.get("__name__", ""))


def user_stacklevel() -> int:
    """For ``warnings.warn`` called right in the caller: the first frame outside fused_zero and torch (the user's
    forward call, the line that built the optimizer), however deep inside them the warning is raised."""
    frame, level = sys._getframe(1), 1
    while frame is not None and _ours(frame):
        frame, level = frame.f_back, level + 1
    return level
