"""Interval math, written once: half-open [start, end) ranges of elements or bytes.

Layout (which parameters a bucket or shard holds), the reducer (the segments of a
bucket), checkpoint resharding and the collectives' memory-overlap checks all ask
the same two questions: where do two ranges intersect, and do two tensors share
memory.
"""
from __future__ import annotations

import torch


def intersect(a0: int, a1: int, b0: int, b1: int) -> tuple[int, int] | None:
    """The intersection of [a0, a1) and [b0, b1), or None when it is empty."""
    lo, hi = max(a0, b0), min(a1, b1)
    return (lo, hi) if lo < hi else None


def memory_span(t: torch.Tensor) -> tuple[int, int]:
    """The [first, past-the-end) byte addresses a contiguous tensor occupies."""
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte of memory (empty tensors never do)."""
    return a.numel() > 0 and b.numel() > 0 and intersect(*memory_span(a), *memory_span(b)) is not None
