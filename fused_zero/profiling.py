"""Profiler labels: where a step's time goes, in a user's ``torch.profiler`` trace.

``label("fused_zero::pack")`` is ``torch.profiler.record_function`` while a profiler records, and a
shared no-op context otherwise: one C call to ask, no allocation (the labels sit on the hot path,
once per bucket). The labels: ``fused_zero::pack`` (gradients into a bucket buffer),
``fused_zero::reduce_scatter`` (launching a bucket's reduction, and waiting for the reductions),
``fused_zero::update`` (the fused AdamW over the shards), ``fused_zero::all_gather`` (parameters
back from the shards).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

PACK = "fused_zero::pack"
REDUCE_SCATTER = "fused_zero::reduce_scatter"
UPDATE = "fused_zero::update"
ALL_GATHER = "fused_zero::all_gather"

_OFF = nullcontext()
_recording = torch._C._autograd._profiler_enabled


def label(name: str):
    """A context naming what runs inside it in the profiler's trace (nothing when none records)."""
    return torch.profiler.record_function(name) if _recording() else _OFF
