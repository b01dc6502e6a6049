"""The fused AdamW update of every partition of one step, all or nothing.

For each partition: advance the step count of every parameter that got a gradient on some rank,
cut the shard into maximal runs of parameters sharing a step count, and run ``ops.adamw_`` on
each chunk the partition's ``ShardStore`` hands out (states, gradient shard and narrow param
shard over the same range, where the states live). A store that fails midway (a full disk)
rolls back: the states, the step counts and the narrow param shards stay as before the step;
only when every partition succeeded do the stores commit.

``skip`` (a 0-d fp32 device tensor, or None) is the step's verdict, decided on the device: a
GradScaler's overflow or ranks that disagree. Where it is set, no element changes and no step count
advances, and the host never reads it: the kernels take it as ``found_inf``. Only an update that
runs on the host (the CPU backend, offloaded states) reads it, once per step, to skip the work: on
CPU it is a host tensor; offloaded from a GPU it is one copy to the host (``host_copy``).
"""
from __future__ import annotations

import bisect
from contextlib import closing

import torch

from . import ops
from .host_read import host_copy
from .hyper import as_float
from .sharding.partition import Partition
from .state_views import StepCounts
from .tiers.store import AMSGRAD_KIND


def update_all(partitions: list[Partition], groups: list[dict], state: dict,
               has_grad: tuple[tuple[bool, ...], ...], grad_scale: torch.Tensor | None,
               skip: torch.Tensor | None, adam_w_mode: bool) -> None:
    advanced: list[StepCounts] = []
    try:
        for part, flags in zip(partitions, has_grad):
            _update_partition(part, groups[part.group_index], state, flags, grad_scale, skip, adam_w_mode, advanced)
    except BaseException:
        for part in partitions:
            part.store.rollback()
            if part.pshard is not None:
                part.pshard.discard()
            part.param_shard_from_master()
        for counts in advanced:
            counts.rollback()
        raise
    for part in partitions:
        part.store.commit()


def _update_partition(part: Partition, group: dict, state: dict, flags: tuple[bool, ...], grad_scale, skip,
                      adam_w_mode: bool, advanced: list) -> None:
    device = part.grad_shard.device  # where the update runs
    if part.step_counts is None:
        part.step_counts = StepCounts(len(part.params), device)
    if skip is not None:
        skip = host_copy(skip, "offload: the host update's skip verdict") if device.type == "cpu" else skip.to(device)
    active = part.step_counts.advance(state, part, flags, skip)  # in one op, on the device
    if not active:
        return
    advanced.append(part.step_counts)  # what a rollback takes back
    if skip is not None and device.type == "cpu":
        if skip.item() != 0:  # host tensor: the update runs on the host
            return
        skip = None
    amsgrad = bool(group.get("amsgrad", False))
    if amsgrad and part.store.kinds[-1] != AMSGRAD_KIND:
        raise RuntimeError(f"param group {part.group_index} turned amsgrad on after the optimizer was "
                           "built; amsgrad needs its max_exp_avg_sq state from the first step: build "
                           "the optimizer with amsgrad=True in that group")
    hyper = dict(lr=as_float(group["lr"]), beta1=as_float(group["betas"][0]),
                 beta2=as_float(group["betas"][1]), eps=group["eps"], weight_decay=group["weight_decay"],
                 adam_w_mode=bool(group.get("decoupled_weight_decay", adam_w_mode)),
                 maximize=bool(group.get("maximize", False)))
    runs = part.step_counts.runs(part, active)
    starts = [a for a, _, _ in runs]
    sink = part.param_sink()
    if grad_scale is not None:  # once per partition, not per chunk
        grad_scale = host_copy(grad_scale, "offload: the host update's gradient scale") if device.type == "cpu" \
            else grad_scale.to(device)
    # closing(): a failed chunk closes the store's generator at once (its copies in flight are settled)
    with closing(part.store.update_chunks(part.update_ranges([(a, b) for a, b, _ in runs]), part.grad_shard,
                                          sink)) as chunks:
        for chunk in chunks:
            step = runs[bisect.bisect_right(starts, chunk.start) - 1][2]  # a chunk lies inside one run
            if step.device != chunk.master.device:  # states kept elsewhere than the gradient shard
                step = step.to(chunk.master.device)
            extra = {"amsgrad": True, "max_exp_avg_sq": chunk.max_exp_avg_sq} if amsgrad else {}
            ops.adamw_(chunk.master, chunk.grad, chunk.exp_avg, chunk.exp_avg_sq, step=step,
                       param_out=chunk.param_out, grad_scale=grad_scale, found_inf=skip, **hyper, **extra)
    if part.pshard is not None:
        part.pshard.flush()  # the written narrow params are the shard now (a staged tier writes them out)
