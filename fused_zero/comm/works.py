"""Handles of collectives in flight, and the torch Works behind them (no torch.distributed here).

``Handle`` is what every ``Comm`` collective returns: wait on it (or ask ``done()``) before reading
the output. ``_Watched`` wraps a gloo Work so a wait blocks in slices and tells ``rendezvous.py``
(a rank blocked in its step may serve a peer's lone ``state_dict()`` meanwhile); ``_AllWorks`` waits
on several as one; ``_copy_local`` is a world-size-1 collective.
"""
from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import rendezvous

class Handle(NamedTuple):
    """An in-flight collective; ``work`` is None once complete (local or synchronous).

    ``then`` runs after the wait (a copy that finishes an emulated collective);
    it may run more than once, so it must be idempotent.
    """

    work: Any = None
    then: Callable[[], None] | None = None

    def done(self) -> bool:
        """True when ``wait()`` would not block."""
        return self.work is None or self.work.is_completed()

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()  # a torch Work may be waited on more than once
        if self.then is not None:
            self.then()


_DONE = Handle(None)

#: How long a gloo wait blocks before it tells ``rendezvous`` (which may serve a peer's lone call).
WAIT_SLICE = datetime.timedelta(seconds=0.25)


class _Watched(NamedTuple):
    """A gloo Work whose wait blocks in slices of ``WAIT_SLICE`` (see rendezvous.py)."""

    work: Any

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> None:
        if not rendezvous.watching():
            self.work.wait()
            return
        blocked = False
        try:
            while True:
                try:
                    self.work.wait(WAIT_SLICE)
                    return
                except RuntimeError:
                    if self.work.is_completed():  # it ended: as the slice ran out, or it failed (a peer ended)
                        self._wait_ended()
                        return
                    blocked = True
                    rendezvous.while_blocked()
        finally:
            if blocked:
                rendezvous.unblocked()


    def _wait_ended(self) -> None:
        """The Work completed: waiting again returns at once if it succeeded (a slice's time-out can race the
        collective's end) and raises its own error if it failed, with a peer's reason when one left it."""
        try:
            self.work.wait()
        except RuntimeError as e:
            why = rendezvous.peer_failure()
            if why is not None:
                raise RuntimeError(why) from e
            raise


class _AllWorks(NamedTuple):
    """Several torch Works waited on as one."""

    works: list

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def _copy_local(output: torch.Tensor, input: torch.Tensor) -> Handle:
    """World size 1: a reduce-scatter or all-gather is a copy (none when in place)."""
    if output.data_ptr() != input.data_ptr():
        output.view(-1).copy_(input.view(-1))
    return _DONE
