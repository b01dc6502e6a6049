"""The fused AdamW update of every partition of one step, all or nothing.

For each partition: advance the step count of every parameter that got a gradient on some rank,
cut the shard into maximal runs of parameters sharing a step count, and run ``ops.adamw_`` on
each chunk the partition's ``ShardStore`` hands out (states, gradient shard and narrow param
shard over the same range, where the states live). A store that fails midway (a full disk)
rolls back: the states, the step counts and the narrow param shards stay as before the step;
only when every partition succeeded do the stores commit.
"""
from __future__ import annotations

import bisect
from contextlib import closing

import torch

from . import ops
from .hyper import as_float
from .sharding.partition import Partition
from .state_views import StepCounts
from .tiers.store import AMSGRAD_KIND


def update_all(partitions: list[Partition], groups: list[dict], state: dict,
               has_grad: tuple[tuple[bool, ...], ...], grad_scale: torch.Tensor | None, adam_w_mode: bool) -> None:
    advanced: list[torch.nn.Parameter] = []
    try:
        for part, flags in zip(partitions, has_grad):
            _update_partition(part, groups[part.group_index], state, flags, grad_scale, adam_w_mode, advanced)
    except BaseException:
        for part in partitions:
            part.store.rollback()
            if part.pshard is not None:
                part.pshard.discard()
            part.param_shard_from_master()
        for p in advanced:
            state[p]["step"] -= 1
        raise
    for part in partitions:
        part.store.commit()


def _update_partition(part: Partition, group: dict, state: dict, flags: tuple[bool, ...], grad_scale,
                      adam_w_mode: bool, advanced: list) -> None:
    if part.step_counts is None:
        part.step_counts = StepCounts(len(part.params))
    steps = part.step_counts.advance(state, part, flags)  # {position: step count}, in one op
    if not steps:
        return
    advanced.extend(part.params[i] for i in steps)  # what a rollback takes back
    amsgrad = bool(group.get("amsgrad", False))
    if amsgrad and part.store.kinds[-1] != AMSGRAD_KIND:
        raise RuntimeError(f"param group {part.group_index} turned amsgrad on after the optimizer was "
                           "built; amsgrad needs its max_exp_avg_sq state from the first step: build "
                           "the optimizer with amsgrad=True in that group")
    hyper = dict(lr=as_float(group["lr"]), beta1=as_float(group["betas"][0]),
                 beta2=as_float(group["betas"][1]), eps=group["eps"], weight_decay=group["weight_decay"],
                 adam_w_mode=bool(group.get("decoupled_weight_decay", adam_w_mode)),
                 maximize=bool(group.get("maximize", False)))
    runs = _runs(part, steps)
    starts = [a for a, _, _ in runs]
    sink = part.param_sink()
    if grad_scale is not None:  # once per partition, not per chunk (a device scalar read once by the host)
        grad_scale = grad_scale.to(part.grad_shard.device)
    # closing(): a failed chunk closes the store's generator at once (its copies in flight are settled)
    with closing(part.store.update_chunks(part.update_ranges([(a, b) for a, b, _ in runs]), part.grad_shard,
                                          sink)) as chunks:
        for chunk in chunks:
            step = runs[bisect.bisect_right(starts, chunk.start) - 1][2]  # a chunk lies inside one run
            extra = {"amsgrad": True, "max_exp_avg_sq": chunk.max_exp_avg_sq} if amsgrad else {}
            ops.adamw_(chunk.master, chunk.grad, chunk.exp_avg, chunk.exp_avg_sq, step=step,
                       param_out=chunk.param_out, grad_scale=grad_scale, **hyper, **extra)
    if part.pshard is not None:
        part.pshard.flush()  # the written narrow params are the shard now (a staged tier writes them out)

def _runs(part: Partition, steps: dict) -> list[tuple[int, int, int]]:
    """Maximal [start, end) shard ranges of active params (``steps``: position -> step count) sharing a
    step count.

    Padding between two pieces of one run is updated too (it stays zero).
    """
    runs: list[list[int]] = []
    current = None
    for piece in part.pieces:
        step = steps.get(piece.param_index)
        if step is None:
            current = None
            continue
        if current is not None and current[2] == step:
            current[1] = piece.shard_offset + piece.numel
        else:
            current = [piece.shard_offset, piece.shard_offset + piece.numel, step]
            runs.append(current)
    return [tuple(r) for r in runs]
