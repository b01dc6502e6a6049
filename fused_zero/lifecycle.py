"""Named states of the runtime's lifecycles, and the one assertion they share.

Stage 3's units (``comm/gather_cycle.py``: ``UnitState``) and the gatherer's pass through the model
(``TrainingState``) move between a few named states instead of flags; ``expect`` states an invariant
at the point that relies on it, as FSDP2's ``_assert_in_states`` does. A failed ``expect`` is a bug in
fused_zero, never the user's: it says so. ``setting`` holds a flag at a value for the length of a block
(``GradSync.no_sync``, ``ParamSync.exact``).
"""
from __future__ import annotations

import enum
from contextlib import contextmanager


@contextmanager
def setting(obj: object, name: str, value: object):
    """``obj.<name>`` is ``value`` inside the block, and what it was before after it (however the block ends)."""
    previous = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, previous)


def expect(state: enum.Enum, *allowed: enum.Enum, what: str) -> None:
    """``what`` (e.g. "stage-3 unit 2") is in one of the ``allowed`` states, else a RuntimeError naming both."""
    if state not in allowed:
        raise RuntimeError(f"fused_zero internal error: {what} is {state.name}, expected "
                           f"{' or '.join(s.name for s in allowed)}; please report it with the stack trace")
