"""Verdicts a step computes on the device and the host learns later, without waiting for them.

Whether the ranks agreed on a step (the checksum in the stats all-reduce, stats.py) is a device
scalar. Reading it at once would make the host wait for the device in every step (on CUDA, for
backward and the all-reduce to finish), so instead the step acts on it on the device (the update
is skipped wherever it is set: nothing changes on any rank) and posts it here. A posted verdict
is copied to the host asynchronously (CUDA: into page-locked memory behind an event; CPU: it is
there already) and checked at the next call that needs it, by which time the copy has landed:

- ``check_due()``: the verdicts of steps that ended before this call (``step()`` and
  ``clip_grad_norm_`` call it first, so a disagreement raises at the latest at the next step);
- ``check_all()``: every verdict posted, also those of the step in progress (``state_dict()``
  and checkpoints call it before anything is written).

Every rank computes the same verdict from the same all-reduced sums, so every rank raises at the
same call.
"""
from __future__ import annotations

import torch


class _Posted:
    __slots__ = ("host", "event")

    def __init__(self, flag: torch.Tensor) -> None:
        if flag.device.type == "cuda":
            self.host = torch.empty((), dtype=flag.dtype, pin_memory=True)
            self.host.copy_(flag, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = flag, None

    def value(self) -> bool:
        if self.event is not None and not self.event.query():
            self.event.synchronize()  # only when the host runs more than a step ahead of the device
        return bool(self.host.item() != 0)  # host tensor: landed in page-locked memory (or a CPU tensor)


class DeferredFlags:
    """Device flags (0-d tensors, nonzero = raise) posted by steps and checked at later calls."""

    def __init__(self) -> None:
        self._due: list[_Posted] = []  # posted by steps that have ended
        self._current: list[_Posted] = []  # posted by the step in progress

    def post(self, flag: torch.Tensor | None) -> None:
        if flag is not None:
            self._current.append(_Posted(flag))

    def end_step(self) -> None:
        self._due.extend(self._current)
        self._current = []

    def check_due(self) -> bool:
        """Whether a flag posted by an ended step is set (all of them are consumed)."""
        due, self._due = self._due, []
        return any([p.value() for p in due])

    def check_all(self) -> bool:
        """Whether any posted flag is set, the current step's included (all are consumed)."""
        posted, self._due, self._current = self._due + self._current, [], []
        return any([p.value() for p in posted])
