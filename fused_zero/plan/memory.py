"""Bytes per rank at each stage: what DDP would hold (stage 0) and what fused_zero allocates.

Stages 1-3 repeat ShardedOptimizer's layout decisions with the same pure function
(``fused_zero.layout.build_layout``): one flat buffer per (param group, dtype), per unit
too at stage 3, parameters in reverse order, each 64-element aligned, buckets padded to a
multiple of 64 x N. Per partition of padded size F and shard size S = F / N, with P the
param dtype's bytes and R the reduce dtype's:

    params      P*F (stages 1-2); P*S at stage 3 (the resident narrow shard; 0 for fp32,
                whose master shard is the gather source)
    grads       stage 1: P * (trainable elements) for the full .grad + R*S for the reduced
                shard; stages 2-3: R*S (each .grad is freed once its bucket is reduced)
    optimizer   master, exp_avg, exp_avg_sq: 4*S each (frozen parameters included)
    buffers     GradSync's pool: per reduce dtype, min(MAX_INFLIGHT = 2, buckets holding a
                trainable parameter) buffers of the largest bucket (a gradient hook never
                grows it: it defers a launch instead); stages 1-2 add the narrow param
                shard P*S (the all-gather source)
    gathered    stage 3 only: the root unit plus the max_live_units largest units, full size

These are the figures ``ShardedOptimizer.memory_bytes()`` reports after a backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

from fused_zero.config import ALIGN
from fused_zero.grad_sync import MAX_INFLIGHT
from fused_zero.layout import FlatLayout, build_layout
from fused_zero.stats import HEAD

from .count import ModelCount, ParamSpec

BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Job:
    """The size-determining options of the run (ZeroConfig's, plus the world size)."""

    world_size: int
    bucket_numel: int
    reduce_dtype: str | None  # None: each partition reduces in its own dtype
    max_live_units: int
    reshard_after_forward: bool = True


@dataclass(frozen=True)
class StageEstimate:
    """Bytes per rank for one stage, where the model states live (``offload``)."""

    stage: int
    params: int
    grads: int
    optimizer: int
    buffers: int
    gathered: int  # stage 3: full units held at once during forward/backward
    activations: int
    comm_bytes: int  # sent per step, counted as the ZeRO paper does
    detail: dict = field(default_factory=dict)
    offload: str = "none"  # the tier: "none" until CPU/NVMe offload exists
    host: int = 0  # bytes an offload tier would keep in host memory
    nvme: int = 0  # bytes an offload tier would keep on NVMe

    @property
    def total(self) -> int:
        """Peak device bytes per rank: everything above at once."""
        return self.params + self.grads + self.optimizer + self.buffers + self.gathered + self.activations

    @property
    def device(self) -> int:
        return self.total

    @property
    def model_states(self) -> int:
        """What ``memory_bytes()`` reports besides ``buffers``: params + grads + optimizer."""
        return self.params + self.grads + self.optimizer


class _Part(NamedTuple):
    specs: tuple[ParamSpec, ...]
    layout: FlatLayout
    unit: int

    @property
    def dtype(self) -> str:
        return self.specs[0].dtype

    def launched(self) -> set[int]:
        """Buckets holding a trainable parameter: the ones the reducer reduces (and stages 1-2 gather)."""
        return {k for i, s in enumerate(self.specs) if s.trainable for k in self.layout.buckets_of_param(i)}


def _partitions(count: ModelCount, job: Job, stage: int) -> list[_Part]:
    """The optimizer's partitions: per dtype (and per unit at stage 3), parameters reversed."""
    units = sorted({s.unit for s in count.params}) if stage == 3 else [None]
    parts = []
    for unit in units:
        mine = [s for s in reversed(count.params) if unit is None or s.unit == unit]
        for dtype in dict.fromkeys(s.dtype for s in mine):
            specs = tuple(s for s in mine if s.dtype == dtype)
            layout = build_layout([s.numel for s in specs], job.world_size, job.bucket_numel, ALIGN)
            parts.append(_Part(specs, layout, unit or 0))
    return parts


def stage0(count: ModelCount, job: Job) -> StageEstimate:
    """DDP + torch AdamW, fp32 master for narrow params; grads are DDP's buckets (gradient_as_bucket_view)."""
    params = sum(BYTES[s.dtype] * s.numel for s in count.params)
    trained = [s for s in count.params if s.trainable]
    grads = sum(BYTES[s.dtype] * s.numel for s in trained)
    master = sum(4 * s.numel for s in trained if s.dtype != "fp32")
    moments = sum(4 * s.numel for s in trained)
    comm = 2 * grads if job.world_size > 1 else 0  # all-reduce = reduce-scatter + all-gather: 2Ψ
    detail = {"master": master, "exp_avg": moments, "exp_avg_sq": moments, "all_reduce": comm}
    return StageEstimate(0, params, grads, master + 2 * moments, 0, 0, 0, comm, detail)


def sharded(count: ModelCount, job: Job, stage: int) -> StageEstimate:
    """Stage 1, 2 or 3 as fused_zero allocates it."""
    d = dict.fromkeys(["param_full", "param_shard", "grad_full", "grad_shard", "master", "exp_avg",
                       "exp_avg_sq", "bucket_pool", "reduce_scatter", "all_gather", "all_reduce"], 0)
    pools: dict[str, list[int]] = {}  # reduce dtype -> [buckets reduced, largest bucket]
    unit_bytes: dict[int, int] = {}
    for part in _partitions(count, job, stage):
        p, shard, full = BYTES[part.dtype], part.layout.shard_numel, part.layout.numel
        reduce = job.reduce_dtype or part.dtype
        r = BYTES[reduce]
        launched = part.launched()
        d["param_full"] += p * full
        d["param_shard"] += p * shard if part.dtype != "fp32" else 0
        d["grad_full"] += p * sum(s.numel for s in part.specs if s.trainable) if stage == 1 else 0
        d["grad_shard"] += r * shard
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            d[kind] += 4 * shard
        pool = pools.setdefault(reduce, [0, 0])
        pool[0] += len(launched)
        pool[1] = max([pool[1]] + [b.numel for b in part.layout.buckets])
        reduced = sum(part.layout.buckets[k].numel for k in launched)
        d["reduce_scatter"] += r * reduced
        # stage 3 gathers every unit in forward and, resharded, every unit but the root again in backward
        again = full if part.unit and job.reshard_after_forward else 0
        d["all_gather"] += p * (reduced if stage < 3 else full + again)
        unit_bytes[part.unit] = unit_bytes.get(part.unit, 0) + p * full
    d["bucket_pool"] = sum(min(MAX_INFLIGHT, n) * size * BYTES[r] for r, (n, size) in pools.items())
    if job.world_size > 1:
        d["all_reduce"] = 4 * (HEAD + len(count.params))  # the step's scalars and has-grad flags (stats.py)
    else:
        d.update(reduce_scatter=0, all_gather=0)
    if stage == 3:
        params, buffers, gathered = d["param_shard"], d["bucket_pool"], _gathered(unit_bytes, count, job)
    else:
        params, buffers, gathered = d["param_full"], d["bucket_pool"] + d["param_shard"], 0
    optimizer = d["master"] + d["exp_avg"] + d["exp_avg_sq"]
    comm = d["reduce_scatter"] + d["all_gather"] + d["all_reduce"]
    return StageEstimate(stage, params, d["grad_full"] + d["grad_shard"], optimizer, buffers, gathered, 0, comm, d)


def _gathered(unit_bytes: dict[int, int], count: ModelCount, job: Job) -> int:
    """Stage 3's gathered units at their peak: the root plus the largest live units."""
    if not count.exact:  # one flat stand-in: the units are unknown (see flat_units)
        return 0
    others = sorted((b for u, b in unit_bytes.items() if u), reverse=True)
    live = len(others) if not job.reshard_after_forward else job.max_live_units
    return unit_bytes.get(0, 0) + sum(others[:live])


def flat_units(est: StageEstimate, count: ModelCount, job: Job, layers: int | None) -> StageEstimate:
    """``--params`` at stage 3: every parameter sits in ``layers`` equal units (embeddings unknown).

    Backward gathers the units again (3Ψ per step, as the paper counts); without ``layers``
    the gathered units' size is unknown and left at 0.
    """
    if count.exact or est.stage != 3:
        return est
    p = BYTES[count.params[0].dtype]
    gather_again = est.detail["param_full"] if job.reshard_after_forward and job.world_size > 1 else 0
    detail = dict(est.detail, all_gather=est.detail["all_gather"] + gather_again)
    gathered = 0
    if layers:
        live = layers if not job.reshard_after_forward else min(job.max_live_units, layers)
        gathered = p * live * -(-count.numel() // layers)
    return replace(est, gathered=gathered, comm_bytes=est.comm_bytes + gather_again, detail=detail)


def with_activations(est: StageEstimate, activations: int) -> StageEstimate:
    return replace(est, activations=activations)
