"""Traffic per level: the bytes one rank sends per step inside a node and across nodes, per stage and layout.

A collective counts at the level of its group: "inside" when every rank of the group is on one node,
"across" when the group spans nodes (its slowest links are between nodes), as ``comm_bytes()`` counts
volume (a reduce-scatter its input, an all-gather its output, an all-reduce twice its tensor). With ``nodes``
nodes of ``g`` ranks each, one training step of one micro-batch:

    flat ZeRO  one shard group of every rank: reduce-scatter, all-gather, the stats all-reduce all cross
               nodes (with one node, all inside)
    HSDP       the shard group is a node (a ("replicate", "shard") mesh of nodes x g): every ZeRO collective
               stays inside it; across nodes only the reduced gradient shards (R bytes per element of this
               rank's shard of every reduced bucket) and the step's stats without the norm are all-reduced
               over the replicas ("replicate_all_reduce")
    hpZ        stage 3, ``secondary_shard=g``: the shard group is every rank (reduce-scatter, forward's
               all-gather and the stats cross nodes); backward's all-gathers run inside a node
               ("secondary_all_gather"), at the cost of the node-local copies (``secondary``)

With the codecs (``param_comm``, ``grad_comm``: comm/codec.py) a collective they replace counts its payloads
under its key suffixed by the codec ("reduce_scatter_int8", "all_gather_int8" for stage 3's gathers but hpZ's
backward ones, which stay exact; "replicate_all_reduce_int8": HSDP's two exchanges over the replicas), at the
level of its group as before; ``coded_inside`` / ``coded_across`` say how much of each level they are.

Each row's ``comm`` holds the figures under ``comm_bytes()``'s keys, which tests compare to what the
optimizer measures. One micro-batch: each further accumulated micro-batch at stage 3 repeats the gathers.
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from fused_zero.config import STAGE_TRAITS, STATS_HEAD

from .count import ModelCount
from .memory import BYTES, Job, _partitions, comm_of, flat_units, kind_of, sharded

#: comm_bytes() keys whose group lies inside a node, per layout (the rest cross nodes)
INSIDE = {"flat": (), "hsdp": ("reduce_scatter", "all_gather", "all_reduce"), "hpz": ("secondary_all_gather",)}
LAYOUTS = {"flat": "flat ZeRO", "hsdp": "HSDP", "hpz": "hpZ"}


class LevelTraffic(NamedTuple):
    """One stage in one layout: bytes per rank per step inside a node and across nodes."""

    layout: str  # "flat", "hsdp" or "hpz" (LAYOUTS names them)
    stage: int
    inside: int
    across: int
    comm: dict  # comm_bytes() key -> bytes
    secondary: int = 0  # hpZ: device bytes of the node-local copies at their most (memory_bytes()'s "secondary")
    coded_inside: int = 0  # of ``inside``, the codecs' payloads (keys such as "reduce_scatter_int8")
    coded_across: int = 0  # of ``across``, the codecs' payloads


def _row(layout: str, stage: int, comm: dict, nodes: int, secondary: int = 0) -> LevelTraffic:
    def level(coded: bool) -> tuple[int, int]:
        mine = [(k, n) for k, n in comm.items() if (kind_of(k) != k) == coded]
        inside = sum(n for k, n in mine if nodes == 1 or kind_of(k) in INSIDE[layout])
        return inside, sum(n for _, n in mine) - inside

    (plain_in, plain_out), (coded_in, coded_out) = level(False), level(True)
    return LevelTraffic(layout, stage, plain_in + coded_in, plain_out + coded_out, comm, secondary, coded_in,
                        coded_out)


def _comm(detail: dict, hpz: bool = False) -> dict:
    """The shard group's traffic of a planned stage (codecs' keys included); hpZ's backward gathers with ``hpz``."""
    return {k: n for k, n in comm_of(detail).items() if hpz or k != "secondary_all_gather"}


def _replicated(count: ModelCount, job: Job, stage: int, replicas: int) -> dict:
    """HSDP's all-reduce over the replicas: each reduced bucket's shard (grad_buckets.GradBucket.finish), and the
    step's stats without the norm (stats.reduce_stats). With qgZ the shards go in two exchanges (codec.TwoPhase):
    an all-to-all of ``replicas`` slices of ceil(shard / replicas) elements, then an all-gather of the summed slices,
    each ``replicas`` payloads of a slice, under "replicate_all_reduce_int8" (or _int4)."""
    shards = [(BYTES[job.reduce_dtype or part.dtype], part.layout.buckets[k].shard_numel)
              for part in _partitions(count, job, stage) if not part.frozen for k in part.launched()]
    stats = 2 * 4 * (STATS_HEAD - 1 + sum(1 for s in count.params if s.trainable))  # an all-reduce: 2Ψ
    if job.grad_comm is None:
        return {"replicate_all_reduce": 2 * sum(r * n for r, n in shards) + stats}
    slices = [-(-n // replicas) for _, n in shards]
    return {"replicate_all_reduce": stats,
            f"replicate_all_reduce_{job.grad_comm}": 2 * job.coded(job.grad_comm, slices, replicas)}


def levels(count: ModelCount, job: Job, nodes: int, layers: int | None = None) -> tuple[LevelTraffic, ...]:
    """Every sharding stage as flat ZeRO, HSDP and (stage 3) hpZ over ``nodes`` nodes; none with one node."""
    if nodes == 1:
        return ()
    g = job.world_size // nodes
    flat, node = replace(job, secondary_shard=None), replace(job, world_size=g, secondary_shard=None)
    rows = []
    for stage, traits in STAGE_TRAITS.items():
        if not traits.shards_states:
            continue
        d = flat_units(sharded(count, flat, stage), count, flat, layers).detail
        rows.append(_row("flat", stage, _comm(d), nodes))
        d = flat_units(sharded(count, node, stage), count, node, layers).detail
        rows.append(_row("hsdp", stage, dict(_comm(d), **_replicated(count, node, stage, nodes)), nodes))
        if traits.shards_params and g > 1:
            hpz = replace(job, secondary_shard=g)
            d = flat_units(sharded(count, hpz, stage), count, hpz, layers).detail
            rows.append(_row("hpz", stage, _comm(d, hpz=True), nodes, d["secondary"]))
    return tuple(rows)
