"""The fused AdamW update of every partition of one step, all or nothing.

For each partition: advance the step count of every parameter that got a gradient on some rank,
cut the shard into maximal runs of parameters sharing a step count, and run ``ops.adamw_checked_``
(the hyperparameters checked once per group a step, before any partition runs: ``read_hypers``) on each chunk
the partition's ``ShardStore`` hands out (states, gradient shard and narrow param shard over the
same range, where the states live). A store that fails midway (a full disk)
rolls back: the states, the step counts and the narrow param shards stay as before the step;
only when every partition succeeded do the stores commit.

Two halves: ``plan_update`` runs where the optimizer's Python state lives (it advances the counts and
creates states, with the hyperparameters ``read_hypers`` took from the param groups) and hands out one
``PartitionJob`` per partition;
``run_job`` touches only that partition's shards, so it may run on a worker thread
(``behind.UpdateBehind``: stage 3 with offloaded states overlaps it with the next forward).
``update_all`` runs both here, now.

``skip`` (a 0-d fp32 device tensor, or None) is the step's verdict, decided on the device: a
GradScaler's overflow or ranks that disagree. Where it is set, no element changes and no step count
advances, and the host never reads it: the kernels take it as ``found_inf``. Only an update that
runs on the host (the CPU backend, offloaded states) reads it, once per step, to skip the work: on
CPU it is a host tensor; offloaded from a GPU it is one copy to the host (``host_copy``).
"""
from __future__ import annotations

import bisect
from contextlib import closing
from typing import NamedTuple

import torch

from . import ops
from .host_read import host_copy
from .hyper import as_float, check_flags, check_hyperparameters
from .sharding.partition import Partition
from .state_views import StepCounts
from .tiers.store import AMSGRAD_KIND


class PartitionJob(NamedTuple):
    """The update of one partition in one step, decided on the host: what ``run_job`` runs (on any thread)."""

    part: Partition
    ranges: list  # [(start, end)]: the runs' ranges, cut where the narrow param shard needs it
    runs: list  # [(start, end, step count)]: maximal runs of parameters sharing a step count
    hyper: dict  # the group's hyperparameters, read when the step was taken (a scheduler may change them after)
    amsgrad: bool
    grad_scale: torch.Tensor | None  # where the update runs
    skip: torch.Tensor | None  # where the update runs; None where the host already knows it is unset


class UpdatePlan(NamedTuple):
    """A step's update: the jobs (partition order) and the step counts they advanced (what a rollback undoes)."""

    jobs: list[PartitionJob]
    advanced: list[StepCounts]


def update_all(partitions: list[Partition], state: dict, has_grad: tuple[tuple[bool, ...], ...],
               grad_scale: torch.Tensor | None, skip: torch.Tensor | None, hypers, agree=None,
               read_skip: bool = True) -> None:
    """Plan, run and commit the whole update here, now (a failure rolls every partition back and raises).

    ``agree`` (``Topology.agree``, where a store can fail: NVMe): the ranks agree on whether every rank's update
    succeeded before any commits, so a full disk on one rank rolls the step back on all and raises on all (the
    failing rank its OSError), instead of leaving the others a step ahead or waiting in the gather."""
    plan = plan_update(partitions, state, has_grad, grad_scale, skip, hypers, read_skip)

    def run() -> None:
        for job in plan.jobs:
            run_job(job)
    try:
        if agree is None:
            run()
        else:
            agree(run)
    except BaseException:
        rollback(partitions, plan.advanced)
        raise
    commit(partitions)


def mark_written(partitions: list[Partition], has_grad: tuple[tuple[bool, ...], ...],
                 shared: tuple[tuple[Partition, int], ...] = ()) -> None:
    """Every parameter the step updates, marked written in place, as torch's in-place update marks it
    (``Partition.mark_written``): a graph saved before the step and run backward after it (``retain_graph`` across
    a step, a GAN's second loss through the updated discriminator) raises torch's "modified by an inplace
    operation" instead of mixing old activations with new weights. ``shared`` (``shared_counters``): parameters
    whose version counter others share; the versions their partition remembers move by what this marking moved
    them (a bump of each sharer), so only user code's writes show."""
    before = [part.params[i]._version for part, i in shared]
    for part, flags in zip(partitions, has_grad):
        part.mark_written(flags)
    if shared:
        flags_of = {id(part): flags for part, flags in zip(partitions, has_grad)}  # (none for frozen partitions)
        for (part, i), old in zip(shared, before):
            flags = flags_of.get(id(part))
            own = int(flags is not None and bool(flags[i]))  # the bump part.mark_written counted itself
            part.shift_versions(i, part.params[i]._version - old - own)


def shared_counters(partitions) -> tuple[tuple[Partition, int], ...]:
    """(partition, index) of every parameter whose autograd version counter another parameter of ``partitions``
    shares: Parameters made from views of one tensor (``[nn.Parameter(t) for t in torch.randn(2, 4, 4)]``; a
    view and ``detach()`` keep the counter of their base, and ``p.data = t`` keeps ``p``'s). Found by bumping
    every parameter once (a counter shared by k parameters moves by k) and setting them back. Empty in the
    common case, which costs ``mark_written`` nothing."""
    slots = [(part, i) for part in partitions for i in range(len(part.params))]
    params = [part.params[i] for part, i in slots]
    if len(params) < 2:
        return ()
    before = [p._version for p in params]
    torch.autograd.graph.increment_version(params)
    moved = [p._version - v for p, v in zip(params, before)]
    torch._C._autograd._unsafe_set_version_counter(tuple(params), tuple(before))
    return tuple(slot for slot, m in zip(slots, moved) if m > 1)


def plan_update(partitions: list[Partition], state: dict, has_grad: tuple[tuple[bool, ...], ...],
                grad_scale: torch.Tensor | None, skip: torch.Tensor | None, hypers, read_skip: bool = True) -> UpdatePlan:
    """Advance the step counts (in one op per partition, on the device) and decide each partition's job.

    Runs where the optimizer's Python state lives (the caller's thread): it creates states; ``run_job``
    then touches only the partition's shards. All or nothing: if it raises midway, the counts it advanced
    are rolled back first. ``hypers``: each partition's ``read_hypers`` of this step (read by the caller
    before the step's collectives), or ``REFUSED`` for a step this rank refuses (a bad hyperparameter):
    ``skip`` must then be set, so the jobs keep their shape on every rank and change nothing. ``read_skip``
    False: an update on the host takes ``skip`` as the kernel's ``found_inf`` too, unread (a captured step's,
    step_graph.py: its CPU twin in the tests)."""
    advanced: list[StepCounts] = []
    jobs = []
    host = {}  # per device where an update runs on the host: the skip verdict and scale, read once a step
    edits = hypers is not REFUSED  # a refused step takes in none of user code's state edits (one may be why)
    if hypers is REFUSED:
        if skip is None:
            raise RuntimeError("internal: a refused step's update must be skipped")
        hypers = [_PLACEHOLDER] * len(partitions)
    try:
        for part, flags, hyper in zip(partitions, has_grad, hypers):
            job = _plan_partition(part, hyper, state, flags, grad_scale, skip, advanced, host, read_skip, edits)
            if job is not None:
                jobs.append(job)
    except BaseException:
        rollback(partitions, advanced)
        raise
    return UpdatePlan(jobs, advanced)


def read_hypers(partitions: list[Partition], groups: list[dict], adam_w_mode: bool,
                capturable: bool = False) -> list[Hyper]:
    """Each partition's hyperparameters for this step, read from its group and checked (the constructor's checks,
    ``hyper.check_hyperparameters``: ValueError in torch's words naming the value and the group; amsgrad turned
    on after building: RuntimeError). Once per group and device a step, before the step's collectives (the
    optimizer calls it first, so a rank alone with a bad value can still go through the collectives with the
    step skipped, instead of leaving the others waiting)."""
    seen: dict = {}
    out = []
    for part in partitions:
        device = part.grad_shard.device  # where the update runs
        key = (part.group_index, device)
        if key not in seen:
            seen[key] = _read_hyper(groups[part.group_index], adam_w_mode, device, part.group_index, capturable)
        if seen[key].amsgrad and part.store.kinds[-1] != AMSGRAD_KIND:
            raise RuntimeError(f"param group {part.group_index} turned amsgrad on after the optimizer was "
                               "built; amsgrad needs its max_exp_avg_sq state from the first step: build "
                               "the optimizer with amsgrad=True in that group")
        out.append(seen[key])
    return out


class Hyper(NamedTuple):
    """A group's hyperparameters for one step: the kernel's keywords, checked, and whether it is amsgrad."""

    values: dict
    amsgrad: bool


def _read_hyper(group: dict, adam_w_mode: bool, device: torch.device, index: int, capturable: bool) -> Hyper:
    # flags set in the group after building (add_param_group and the constructor check them there)
    check_flags(group.get("foreach"), group.get("fused"), group.get("capturable"), group.get("differentiable"),
                capturable)
    betas = _entry(group, "betas", index)
    if not isinstance(betas, (tuple, list)):  # torch's update: TypeError ("cannot unpack non-iterable float")
        raise TypeError(f"param group {index}'s betas must be a pair (beta1, beta2), e.g. (0.9, 0.999), got "
                        f"{type(betas).__name__} {betas!r}")
    if len(betas) != 2:
        raise ValueError(f"param group {index}'s betas must be a pair (beta1, beta2), got {betas!r}")
    hyper = dict(lr=_real(_entry(group, "lr", index), "lr", index), beta1=_real(betas[0], "beta1", index),
                 beta2=_real(betas[1], "beta2", index), eps=_real(_entry(group, "eps", index), "eps", index),
                 weight_decay=_real(_entry(group, "weight_decay", index), "weight_decay", index),
                 adam_w_mode=bool(group.get("decoupled_weight_decay", adam_w_mode)),
                 maximize=bool(group.get("maximize", False)))
    try:
        hyper["lr"] = ops.check_hyper(lr=hyper["lr"], beta1=hyper["beta1"], beta2=hyper["beta2"], eps=hyper["eps"],
                                      weight_decay=hyper["weight_decay"], device=device)
    except ValueError as refused:
        # said again in the constructor's words, torch's ("Invalid learning rate: -0.5"), for a group edited or
        # loaded; only here, on the way out (with a tensor lr on a GPU, its range check reads the device)
        try:
            check_hyperparameters(hyper["lr"], (hyper["beta1"], hyper["beta2"]), hyper["eps"],
                                  hyper["weight_decay"])
        except ValueError as e:
            raise ValueError(f"param group {index}: {e}") from None
        raise refused
    return Hyper(hyper, bool(group.get("amsgrad", False)))


def _entry(group: dict, key: str, index: int):
    try:
        return group[key]
    except KeyError:
        raise ValueError(f"param group {index} has no {key!r} (removed since the optimizer was built): set it again, "
                         f"e.g. to optimizer.defaults[{key!r}]") from None


def _real(value, key: str, index: int) -> float:
    """A hyperparameter as a float, or TypeError naming it (a string is refused, as torch's update refuses it)."""
    if not isinstance(value, (str, bytes)):
        try:
            return as_float(value)
        except (TypeError, ValueError, RuntimeError):
            pass
    raise TypeError(f"param group {index}'s {key} must be a real number or a 1-element tensor, got "
                    f"{type(value).__name__} {value!r}")


def step_counts_of(part: Partition) -> StepCounts:
    """``part``'s step counts, made on first use on the device its update runs on."""
    if part.step_counts is None:
        part.step_counts = StepCounts(len(part.params), part.grad_shard.device)
    return part.step_counts


REFUSED = object()  # plan_update's hypers for a step this rank refuses: see there
# what a refused step's jobs carry instead of the bad values: valid, and unused (the step is skipped)
_PLACEHOLDER = Hyper(dict(lr=0.0, beta1=0.0, beta2=0.0, eps=1.0, weight_decay=0.0, adam_w_mode=True,
                          maximize=False), False)


def _plan_partition(part: Partition, hyper: Hyper, state: dict, flags: tuple[bool, ...], grad_scale, skip,
                    advanced: list, host: dict, read_skip: bool, edits: bool = True) -> PartitionJob | None:
    device = part.grad_shard.device  # where the update runs
    counts = step_counts_of(part)
    on_host = device.type == "cpu" and read_skip
    if skip is not None:
        skip = _where_it_runs(skip, device, host, "offload: the host update's skip verdict")
    active = counts.advance(state, part, flags, skip, edits)  # in one op, on the device
    if not active:
        return None
    advanced.append(counts)  # what a rollback takes back
    if skip is not None and on_host:
        if "skipped" not in host:
            host["skipped"] = skip.item() != 0  # host tensor: the update runs on the host
        if host["skipped"]:
            return None
        skip = None
    runs = counts.runs(part, active)
    if grad_scale is not None:  # once per step where the update runs, not per chunk
        grad_scale = _where_it_runs(grad_scale, device, host, "offload: the host update's gradient scale")
    return PartitionJob(part, part.update_ranges([(a, b) for a, b, _ in runs]), runs, hyper.values,
                        hyper.amsgrad, grad_scale, skip)


def _where_it_runs(t: torch.Tensor, device: torch.device, host: dict, site: str) -> torch.Tensor:
    """``t`` on the update's ``device``; for a host update, copied to the host once a step (kept in ``host``
    under ``site``, the read's name)."""
    if device.type != "cpu":
        return t.to(device)
    if site not in host:
        host[site] = host_copy(t, site)
    return host[site]


def run_job(job: PartitionJob) -> None:
    """Run one partition's fused AdamW over the chunks its store hands out (touches only its shards)."""
    part, runs = job.part, job.runs
    starts = [a for a, _, _ in runs]
    sink = part.param_sink()
    # closing(): a failed chunk closes the store's generator at once (its copies in flight are settled)
    with closing(part.store.update_chunks(job.ranges, part.grad_shard, sink)) as chunks:
        for chunk in chunks:
            step = runs[bisect.bisect_right(starts, chunk.start) - 1][2]  # a chunk lies inside one run
            if step.device != chunk.master.device:  # states kept elsewhere than the gradient shard
                step = step.to(chunk.master.device)
            extra = {"amsgrad": True, "max_exp_avg_sq": chunk.max_exp_avg_sq} if job.amsgrad else {}
            ops.adamw_checked_(chunk.master, chunk.grad, chunk.exp_avg, chunk.exp_avg_sq, step=step,
                               param_out=chunk.param_out, grad_scale=job.grad_scale, found_inf=job.skip,
                               **job.hyper, **extra)
    if part.pshard is not None:
        try:
            part.pshard.flush()  # the written narrow params are the shard now (a staged tier writes them out)
        except OSError as e:
            if part.store.undoes_failed_steps:
                raise  # the step is undone: update.rollback
            part.param_shard_lost(e)  # states in memory: the step is done, the shard rewritten before its use


def commit(partitions: list[Partition]) -> None:
    """Every job succeeded: the stores make the step's writes their states."""
    for part in partitions:
        part.store.commit()


def rollback(partitions: list[Partition], advanced: list[StepCounts]) -> None:
    """A job failed: states, step counts and narrow param shards go back to before the step."""
    for part in partitions:
        part.store.rollback()
        if part.pshard is not None:
            part.pshard.discard()
        part.restore_param_shard()
    for counts in advanced:
        counts.rollback()
