"""Every read of a device tensor's values on the host goes through ``to_host``, so it can be counted.

On CUDA such a read waits for the device (a sync that keeps the host from queueing the next
work); on CPU it costs nothing, but the same call sites would sync on a GPU, so the tests count
them here (``counting()``) and the GPU figures follow from the counts. Reads of tensors that
always live on the host (step counts, a CPU lr, the CPU backend's own scalars, checkpoint data
already on the host) are not device reads: they stay plain ``.item()``/``.tolist()`` with a
``# host tensor`` mark, and tests/test_host_reads.py fails on any unmarked read outside this module.

What a training step reads (tests/test_host_reads.py counts it): nothing, at every stage, with
clipping, a GradScaler and accumulation. The verdicts stay on the device (the update kernel skips
on them; the ranks' checksum verdict reaches the host asynchronously, deferred.py). One read by
design: a rank among several that saw some parameter without a gradient in a step reads the has-grad flags
("has-grad flags"), and a step that would give a parameter its first state reads the skip verdict
("verdict before new states": a skipped step creates no state, as in torch). Offload reads where
the host update runs: the skip flag and the gradient scale ("offload: ..."), each once per
partition; on a CPU-only run those are host tensors.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch

_counts: Counter | None = None


def to_host(t: torch.Tensor, site: str):
    """``t``'s values as Python numbers (one 0-d tensor: a number; otherwise a list); counted under ``site``."""
    if _counts is not None:
        _counts[site] += 1
    return t.item() if t.dim() == 0 else t.tolist()


def host_copy(t: torch.Tensor, site: str) -> torch.Tensor:
    """``t`` copied to host memory (itself when it is there already); counted under ``site`` when it moves."""
    if t.device.type == "cpu":
        return t
    if _counts is not None:
        _counts[site] += 1
    return t.cpu()


@contextmanager
def counting():
    """Count the reads made inside: a Counter of site -> reads, filled as they happen."""
    global _counts
    previous, _counts = _counts, Counter()
    try:
        yield _counts
    finally:
        _counts = previous
