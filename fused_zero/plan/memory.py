"""Bytes per rank at each stage: what DDP would hold (stage 0) and what fused_zero allocates.

Stages 1-3 repeat ShardedOptimizer's layout decisions with the same pure function
(``fused_zero.sharding.layout.build_layout``): one flat buffer per (param group, dtype), per unit
too at stage 3, parameters in reverse order, each 64-element aligned, buckets padded to a
multiple of 64 x N. Per partition of padded size F and shard size S = F / N, with P the
param dtype's bytes and R the reduce dtype's:

    params      P*F (stages 1-2); P*S at stage 3 (the resident narrow shard; 0 for fp32,
                whose master shard is the gather source)
    grads       stage 1: P * (trainable elements) for the full .grad + R*S for the reduced
                shard; stages 2-3: R*S (each .grad is freed once its bucket is reduced)
    optimizer   master, exp_avg, exp_avg_sq: 4*S each; no master for fp32 at stages 1-2, where it
                is this rank's own slices of the parameters' flat buffer (tiers.store.ParamsAsMaster)
    frozen      parameters with requires_grad=False (frozen.py) are weights only: at stages
                1-2 the user's whole tensors (P * elements, under params, in no partition); at
                stage 3 a weights-only partition per (unit, dtype) whose narrow shard P*S (fp32
                too: no master to gather from) is their only resident cost; no grads, states,
                pool buffer or reduction, gathered with their unit
    buffers     GradSync's pool: per reduce dtype, min(MAX_INFLIGHT = 2, buckets holding a
                trainable parameter) buffers of the largest bucket (a gradient hook never
                grows it: it defers a launch instead; none on one rank without offload, where
                the gradients pack straight into the shard); stages 1-2 add the narrow param
                shard P*S (the all-gather source)
    gathered    stage 3 only: the root unit plus the max_live_units largest units, full size;
                with hpZ (``secondary_shard`` s) also the node-local copies at their most, the end
                of a training forward: P*F/s of every unit but the root and the last (detail's
                "secondary", memory_bytes()'s "secondary" then)

These are the figures ``ShardedOptimizer.memory_bytes()`` reports after a backward.

Traffic per step (detail's "reduce_scatter", "all_gather", "all_reduce", "secondary_all_gather") is what
``comm_bytes()`` reports. With the codecs (``Job.param_comm`` / ``grad_comm``, comm/codec.py; none alone) a
collective they replace counts under its key suffixed by the codec, as payloads (``config.payload_bytes``: the
values padded to 4 bytes and an fp32 scale per ``quant_block``): "reduce_scatter_int8" / "_int4", N payloads of
each reduced bucket's shard; "all_gather_int8", stage 3's gathers (forward's, and backward's but hpZ's), N
payloads of each bucket's shard (frozen partitions' too; full_parameters() and checkpoints gather exactly).

The offload tiers (``offload_optimizer``, ``offload_params``, ZeroConfig's) move bytes off the
device, as the stores do (tiers/store_host.py, store_nvme.py, param_store.py):

    offload_optimizer  the 12*S of states go to "host" (cpu) or "nvme", and the reduced gradient
                       shard R*S to "host" (where the update reads it); the narrow param shard
                       at stages 1-2 becomes this rank's own slices of the flat buffer (0 bytes),
                       at stage 3 every partition keeps one (fp32 ones too: the master is gone);
                       planned for a GPU: a CPU-only run's fp32 params at stages 1-2 are their own
                       master under "cpu" (HostParamsAsMaster: 4*S less "host")
    offload_params     stage 3: the narrow param shard P*S goes to "host" (cpu) or "nvme" (fp32
                       partitions whose master stays on the device have none to move)
    staging            not in memory_bytes(), planned as upper bounds with a GPU in mind, once per
                       optimizer (staging.Staging: the partitions update one after another and
                       share it), with C = offload_chunk_numel rounded up to 64:
                       host, optimizer "cpu": none (with a GPU the master itself, page-locked,
                       goes up chunk by chunk and the GPU rounds it in a 4*C-byte temporary,
                       not counted; on the host the update writes the params in place);
                       "nvme": two pinned chunks of params going up per param dtype, 2*C*P,
                       and three blocks per state kind, 3*3*4*min(C, the largest shard); on the device, per reduce
                       dtype, the scratch an accumulating backward is added in before it goes
                       down, one per pool buffer, of the largest bucket shard ("grad_staging");
                       offload_params: the shards of the units in flight (max_live_units + 1 of
                       the largest) staged on the device, and for "nvme" read into host memory first

``host`` and ``nvme`` are what memory_bytes() reports under those keys plus the host staging.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

from fused_zero.config import (ALIGN, CODECS, MAX_INFLIGHT, STAGE_TRAITS, STATS_HEAD, StageTraits, ZeroConfig,
                               payload_bytes)
from fused_zero.sharding.layout import FlatLayout, build_layout
from fused_zero.sharding.units import merge_small
from fused_zero.tiers.tier import Tier

from .count import ModelCount, ParamSpec

BYTES = {"bf16": 2, "fp16": 2, "fp32": 4,  # and what frozen parameters may be (count.FROZEN_DTYPES)
         "fp64": 8, "u8": 1, "i8": 1, "i16": 2, "i32": 4, "i64": 8, "bool": 1}
#: offload option value -> the memory_bytes() key its bytes go under (the tier's name)
WHERE = {option: Tier.of(option).value for option in ("cpu", "nvme")}


def stage_where(**facts: bool) -> int:
    """The first stage in ``config.STAGE_TRAITS`` with these facts: ``stage_where(shards_states=False)`` is DDP.
    The planner names its stages so, by what they shard, never by testing their numbers."""
    return next(n for n, t in STAGE_TRAITS.items() if all(getattr(t, k) == v for k, v in facts.items()))


def stage_traits(n) -> StageTraits | None:
    """Stage ``n``'s row of ``config.STAGE_TRAITS``; None for anything that is not a stage."""
    if isinstance(n, bool):  # (True == 1)
        return None
    return next((t for k, t in STAGE_TRAITS.items() if k == n), None)


def find(stages, stage, offload: str = "none") -> StageEstimate | None:
    """The row of ``stages`` for ``stage`` at the tier ``offload`` (None when there is none): the one place a
    planned row is looked up by its stage, as ``Plan.stage``, the recommendation and the outputs do (a bool is no
    stage, though True == 1)."""
    if isinstance(stage, bool):
        return None
    return next((s for s in stages if s.stage == stage and s.offload == offload), None)


def traffic(stage: int) -> str:
    """What a step sends, as the ZeRO paper counts it: 2Ψ (an all-reduce, or a reduce-scatter and an all-gather),
    3Ψ where backward gathers the parameters again."""
    return "3Ψ" if STAGE_TRAITS[stage].shards_params else "2Ψ"


def aka(stage: int) -> str:
    """The stage's other name in parentheses (" (DDP)"), or nothing."""
    alias = STAGE_TRAITS[stage].alias
    return f" ({alias})" if alias else ""


#: The stage that shards nothing: DDP + torch AdamW, which the planner sets the sharded stages against.
DDP = stage_where(shards_states=False)
#: The offload tiers the recommendation tries when no stage fits on the device, cheapest first:
#: (stage, offload_optimizer, offload_params), the stages that shard gradients (2, then 3; stage 3 with its
#: param shards there too) in host memory, then on NVMe: (2, "cpu", None), (3, "cpu", None), (3, "cpu", "cpu"),
#: (2, "nvme", None), (3, "nvme", None), (3, "nvme", "nvme"). Stage 1 tiers are planned too, never
#: recommended: stage 2 with the same tier sends the same bytes and holds less.
LADDER = tuple((n, where, par) for where in ("cpu", "nvme") for n, t in STAGE_TRAITS.items() if t.shards_grads
               for par in ((None, where) if t.shards_params else (None,)))


def tier(offload_optimizer: str | None, offload_params: str | None) -> str:
    """The tier's name: "none", "opt=cpu", "params=cpu", "opt=nvme,params=nvme", ..."""
    parts = [f"{k}={v}" for k, v in (("opt", offload_optimizer), ("params", offload_params)) if v not in (None, "none")]
    return ",".join(parts) or "none"


def tier_options(name: str) -> tuple[str | None, str | None]:
    """(offload_optimizer, offload_params) of a tier name; ValueError for a name that is none."""
    options = {"opt": None, "params": None}
    for part in ([] if name == "none" else str(name).split(",")):
        k, _, v = part.partition("=")
        if k not in options or options[k] is not None or v not in WHERE:
            raise ValueError(f"{name!r} is not an offload tier: \"none\", or \"opt=cpu|nvme\" and/or "
                             "\"params=cpu|nvme\" joined by a comma, e.g. \"opt=cpu,params=cpu\"")
        options[k] = v
    return options["opt"], options["params"]


def all_tiers() -> tuple[tuple[int, str | None, str | None], ...]:
    """Every (stage, offload_optimizer, offload_params) ShardedOptimizer accepts, the ladder first."""
    rest = [(s, o, p) for s, t in STAGE_TRAITS.items() if t.shards_states for o in (None, "cpu", "nvme")
            for p in ((None, "cpu", "nvme") if t.shards_params else (None,))]
    return LADDER + tuple(t for t in rest if t not in LADDER and t[1:] != (None, None))


@dataclass(frozen=True)
class Job:
    """The size-determining options of the run (ZeroConfig's, plus the world size)."""

    world_size: int
    bucket_numel: int
    reduce_dtype: str | None  # None: each partition reduces in its own dtype
    max_live_units: int
    reshard_after_forward: bool = True
    offload_chunk_numel: int = ZeroConfig.offload_chunk_numel
    min_unit_numel: int = ZeroConfig.min_unit_numel  # stage 3: default units smaller than this are merged
    secondary_shard: int | None = None  # stage 3's hpZ: backward gathers inside blocks of this many ranks
    param_comm: str | None = None  # stage 3's qwZ: "int8" (comm/codec.py); stages 1-2 gather exactly
    grad_comm: str | None = None  # qgZ: "int8" or "int4"
    quant_block: int = ZeroConfig.quant_block

    def regathered(self) -> str:
        """The comm_bytes() key of backward's gathers at stage 3: inside a node with hpZ (exact), else the shard
        group's, as forward's (with qwZ, "all_gather_int8")."""
        return self.key("all_gather") if self.secondary_shard is None else "secondary_all_gather"

    def key(self, kind: str) -> str:
        """The comm_bytes() key of the shard group's ``kind`` ("reduce_scatter"; stage 3's "all_gather"): suffixed
        by the codec that replaces it ("reduce_scatter_int8"); as it is without one or alone (codec.codec_for)."""
        codec = self.param_comm if kind == "all_gather" else self.grad_comm
        return kind if codec is None or self.world_size == 1 else f"{kind}_{codec}"

    def coded(self, codec: str, shards, ranks: int) -> int:
        """Bytes of one coded exchange per shard size in ``shards`` over ``ranks`` ranks: ``ranks`` payloads of a
        shard each (comm/codec.py: an all-to-all counts its input, an all-gather its output)."""
        return ranks * sum(payload_bytes(n, CODECS[codec], self.quant_block) for n in shards)

    def sent(self, kind: str, buckets, elem_bytes: int) -> int:
        """Bytes of one ``kind`` of each of ``buckets`` under ``key(kind)``: their elements at ``elem_bytes`` each,
        or with a codec ``world_size`` payloads of a bucket's shard."""
        key = self.key(kind)
        if key == kind:
            return elem_bytes * sum(b.numel for b in buckets)
        return self.coded(key.rpartition("_")[2], [b.shard_numel for b in buckets], self.world_size)

    @property
    def chunk(self) -> int:
        """Elements per staged chunk, as the stores round it (whole 64-element lanes)."""
        return -(-max(1, self.offload_chunk_numel) // ALIGN) * ALIGN


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
    offload: str = "none"  # the tier (see ``tier``): "none", "opt=cpu", "opt=cpu,params=cpu", ...
    host: int = 0  # host memory per rank: offloaded states and param shards, and the host staging
    nvme: int = 0  # bytes per rank on NVMe: offloaded states and param shards (one slot each)
    staging: int = 0  # device bytes of offload_params' staged shards (the units in flight)

    @property
    def total(self) -> int:
        """Peak device bytes per rank: everything above at once."""
        return (self.params + self.grads + self.optimizer + self.buffers + self.gathered + self.staging
                + self.activations)

    @property
    def device(self) -> int:
        return self.total

    @property
    def offload_optimizer(self) -> str | None:
        return tier_options(self.offload)[0]

    @property
    def offload_params(self) -> str | None:
        return tier_options(self.offload)[1]

    @property
    def model_states(self) -> int:
        """What ``memory_bytes()`` reports besides ``buffers``: params + grads + optimizer."""
        return self.params + self.grads + self.optimizer


class _Part(NamedTuple):
    specs: tuple[ParamSpec, ...]
    layout: FlatLayout
    unit: int
    frozen: bool = False  # stage 3's weights-only partitions (frozen.py)

    @property
    def dtype(self) -> str:
        return self.specs[0].dtype

    def launched(self) -> set[int]:
        """Buckets holding a trainable parameter: the ones the reducer reduces (and stages 1-2 gather)."""
        return {k for i, s in enumerate(self.specs) if s.trainable for k in self.layout.buckets_of_param(i)}


def _partitions(count: ModelCount, job: Job, stage: int) -> list[_Part]:
    """The optimizer's partitions: per dtype (and per unit at stage 3), parameters reversed; the trainable
    ones, then at stage 3 each unit's frozen ones (stages 1-2 leave frozen parameters whole, unpartitioned)."""
    by_unit = STAGE_TRAITS[stage].shards_params
    units = sorted({s.unit for s in count.params}) if by_unit else [None]
    parts = []
    for unit in units:
        mine = [s for s in reversed(count.params) if unit is None or s.unit == unit]
        for frozen in (False, True) if by_unit else (False,):
            kind = [s for s in mine if s.trainable != frozen]
            for dtype in dict.fromkeys(s.dtype for s in kind):
                specs = tuple(s for s in kind if s.dtype == dtype)
                layout = build_layout([s.numel for s in specs], job.world_size, job.bucket_numel, ALIGN)
                parts.append(_Part(specs, layout, unit or 0, frozen))
    return parts


def unsharded(count: ModelCount, job: Job) -> StageEstimate:
    """DDP + torch AdamW, fp32 master for narrow params; grads are DDP's buckets (gradient_as_bucket_view)."""
    params = sum(BYTES[s.dtype] * s.numel for s in count.params)
    trained = [s for s in count.params if s.trainable]
    grads = sum(BYTES[s.dtype] * s.numel for s in trained)
    master = sum(4 * s.numel for s in trained if s.dtype != "fp32")
    moments = sum(4 * s.numel for s in trained)
    comm = 2 * grads if job.world_size > 1 else 0  # all-reduce = reduce-scatter + all-gather: 2Ψ
    detail = {"master": master, "exp_avg": moments, "exp_avg_sq": moments, "all_reduce": comm}
    return StageEstimate(DDP, params, grads, master + 2 * moments, 0, 0, 0, comm, detail)


def sharded(count: ModelCount, job: Job, stage: int, offload_optimizer: str | None = None,
            offload_params: str | None = None) -> StageEstimate:
    """Stage 1, 2 or 3 as fused_zero allocates it, with the optimizer states and (stage 3) the
    param shards where ``offload_optimizer`` / ``offload_params`` put them."""
    opt, par = offload_optimizer, offload_params
    tier_options(tier(opt, par))  # a known tier
    traits = STAGE_TRAITS[stage]
    if par is not None and not traits.shards_params:
        raise ValueError(f"offload_params={par!r} needs stage 3 (stages 1-2 keep every parameter whole on every "
                         f"rank; got stage {stage}): plan stage 3, or opt={par} to move the optimizer states")
    d = dict.fromkeys(["param_full", "param_shard", "grad_full", "grad_shard", "master", "exp_avg",
                       "exp_avg_sq", "bucket_pool", "reduce_scatter", "all_gather", "all_reduce", "host_states",
                       "nvme_states", "host_params", "nvme_params", "host_grads", "grad_staging",
                       "host_staging", "device_staging", "secondary_all_gather", "secondary", "host_pinned"], 0)
    for key in (job.key("reduce_scatter"),) + ((job.key("all_gather"),) if traits.shards_params else ()):
        d.setdefault(key, 0)  # a codec's (qgZ; qwZ at stage 3)
    pools: dict[str, list[int]] = {}  # reduce dtype -> [buckets reduced, largest bucket]
    unit_bytes: dict[int, int] = {}
    moved: dict[int, int] = {}  # unit -> bytes of its offloaded param shards (staged for each gather)
    parts = _partitions(count, job, stage)
    kept = max((part.unit for part in parts), default=0)  # the schedule's last unit: gathered into backward
    for part in parts:
        p, shard, full = BYTES[part.dtype], part.layout.shard_numel, part.layout.numel
        reduce = job.reduce_dtype or part.dtype
        r = BYTES[reduce]
        launched = part.launched()
        d["param_full"] += p * full
        # the narrow param shard (Partition.__init__): narrow params, or any once the master leaves the device
        if part.dtype != "fp32" or opt is not None or part.frozen:
            if traits.shards_params and par is not None:
                d[WHERE[par] + "_params"] += p * shard
                moved[part.unit] = moved.get(part.unit, 0) + p * shard
            elif traits.shards_params or opt is None:
                d["param_shard"] += p * shard
            # else stages 1-2 with offloaded states: this rank's own slices of the flat buffer, no bytes
        d["grad_full"] += p * sum(s.numel for s in part.specs if s.trainable) if not traits.shards_grads else 0
        if not part.frozen:
            d["grad_shard" if opt is None else "host_grads"] += r * shard
            _states(d, opt, shard, master=part.dtype != "fp32" or traits.shards_params)
            # one rank without offload: the gradients pack straight into the shard (BucketPipe.direct), no pool
            # (with offload the GPU's way: a device pool buffer; a CPU-only run packs straight into the host shard)
            pool = pools.setdefault(reduce, [0, 0, 0]) if job.world_size > 1 or opt is not None else [0, 0, 0]
            pool[0] += len(launched)
            pool[1] = max([pool[1]] + [b.numel for b in part.layout.buckets])
            pool[2] = max([pool[2]] + [b.shard_numel for b in part.layout.buckets])
        reduced = [part.layout.buckets[k] for k in sorted(launched)]
        d[job.key("reduce_scatter")] += job.sent("reduce_scatter", reduced, r)  # qgZ: an all-to-all of payloads
        # stage 3 gathers every unit in forward and, resharded, every unit but the root and the last (kept
        # gathered into backward, which needs it first) again in backward
        again = part.unit and part.unit != kept and job.reshard_after_forward
        if traits.shards_params:  # hpZ: backward's gathers inside a node (exact), from copies of 1/s of the unit
            gather = job.sent("all_gather", part.layout.buckets, p)  # qwZ: payloads of every bucket's shard
            d[job.key("all_gather")] += gather
            d[job.regathered()] += (gather if job.secondary_shard is None else p * full) if again else 0
            d["secondary"] += p * full // job.secondary_shard if job.secondary_shard and again else 0
        else:
            d["all_gather"] += p * sum(b.numel for b in reduced)
        unit_bytes[part.unit] = unit_bytes.get(part.unit, 0) + p * full
    d["bucket_pool"] = sum(min(MAX_INFLIGHT, n) * size * BYTES[r] for r, (n, size, _) in pools.items())
    if opt is not None:
        # the optimizer's staging.Staging, shared by every partition, for NvmeStore: two pinned chunks of params
        # going up to a GPU per param dtype (transfer.Uploads) and three blocks per state kind (HostStore
        # sends its page-locked master up as it is)
        dtypes = {part.dtype for part in parts if not part.frozen}
        if Tier.of(opt) is Tier.NVME:
            uploads = sum(2 * job.chunk * BYTES[dt] for dt in dtypes)
            # a block holds a chunk, or the largest shard where every shard is smaller (Staging.blocks)
            largest = max((part.layout.shard_numel for part in parts if not part.frozen), default=0)
            d["host_staging"] += uploads + 3 * 3 * 4 * min(job.chunk, -(-largest // ALIGN) * ALIGN)
            d["host_pinned"] += uploads
        # GradSync's device scratch a backward that accumulates is added in before it goes down, per pool buffer
        d["grad_staging"] = sum(min(MAX_INFLIGHT, n) * shard * BYTES[r] for r, (n, _, shard) in pools.items())
    if not traits.shards_params:  # frozen parameters stay the user's whole tensors
        d["param_full"] += sum(BYTES[s.dtype] * s.numel for s in count.params if not s.trainable)
    if job.world_size > 1:  # the step's scalars and has-grad flags of the trained parameters (stats.py)
        d["all_reduce"] = 2 * 4 * (STATS_HEAD + sum(1 for s in count.params if s.trainable))  # 2Ψ: an all-reduce
    else:
        d.update(reduce_scatter=0, all_gather=0, secondary_all_gather=0)
    d["partitions"] = sum(1 for part in parts if not part.frozen)  # the optimizer's (ShardedOptimizer.partitions)
    d["frozen_partitions"] = len(parts) - d["partitions"]  # stage 3's weights-only ones
    if moved:  # the shards of the units in flight: on the device for the gather; "nvme" reads them to the host
        d["device_staging"] = _in_flight(moved, job)
        d["host_staging"] += d["device_staging"] if Tier.of(par) is Tier.NVME else 0
    _pinned(d, opt, par)
    if traits.shards_params:
        params, buffers = d["param_shard"], d["bucket_pool"]
        gathered = _gathered(unit_bytes, count, job) + d["secondary"]
    else:
        params, buffers, gathered = d["param_full"], d["bucket_pool"] + d["param_shard"], 0
    optimizer = d["master"] + d["exp_avg"] + d["exp_avg_sq"]
    comm = sum(comm_of(d).values())
    host = d["host_states"] + d["host_params"] + d["host_grads"] + d["host_staging"]
    return StageEstimate(stage, params, d["grad_full"] + d["grad_shard"], optimizer, buffers, gathered, 0, comm, d,
                         offload=tier(opt, par), host=host, nvme=d["nvme_states"] + d["nvme_params"],
                         staging=d["device_staging"] + d["grad_staging"])


#: comm_bytes()'s keys of the shard group's collectives; a codec's are these suffixed by its name ("all_gather_int8")
COMM = ("reduce_scatter", "all_gather", "all_reduce", "secondary_all_gather")


def kind_of(key: str) -> str:
    """The collective a comm_bytes() key counts: the key without its codec's suffix ("reduce_scatter_int8")."""
    head, _, codec = key.rpartition("_")
    return head if codec in CODECS else key


def comm_of(detail: dict) -> dict:
    """The figures of a planned ``detail`` under comm_bytes()'s keys: the collectives' and the codecs'."""
    return {k: n for k, n in detail.items() if kind_of(k) in COMM}


def _pinned(d: dict, opt: str | None, par: str | None) -> None:
    """With a GPU, the host bytes page-locked: what is copied to or from the GPU asynchronously. The reduced
    gradient shard, the host param shard of
    ``offload_params="cpu"``, ``"cpu"``'s master where it goes up to the GPU (a third of its states: the param
    shard is on the device), and the param shards "nvme" reads for a gather (from torch's pinned allocator,
    which rounds each up to a power of two, and which ``transfer.locked_bytes()`` does not see); NvmeStore's
    chunks of params going up are added where they are planned. Not counted: the fp32 state blocks NVMe reads
    into (never copied to a GPU) and torch's small pinned buffers (scalars, pack addresses)."""
    d["host_pinned"] += d["host_grads"] + d["host_params"]
    if opt == "cpu" and par is None:
        d["host_pinned"] += d["host_states"] // 3
    if Tier.of(par) is Tier.NVME:
        d["host_pinned"] += d["device_staging"]


def _states(d: dict, opt: str | None, shard: int, master: bool) -> None:
    """A trained partition's master, exp_avg and exp_avg_sq: 4 bytes per shard element each, where they live
    (``master`` False: on the device it is the parameters' own slices, fp32 at stages 1-2)."""
    if opt is None:
        for kind in ("master", "exp_avg", "exp_avg_sq") if master else ("exp_avg", "exp_avg_sq"):
            d[kind] += 4 * shard
    else:
        d[WHERE[opt] + "_states"] += 3 * 4 * shard


def _in_flight(unit_shards: dict[int, int], job: Job) -> int:
    """offload_params: the staged shards at once, at most those of max_live_units + 1 units (the ones
    gathering and the one read ahead), the largest; every unit without resharding."""
    sizes = sorted(unit_shards.values(), reverse=True)
    return sum(sizes if not job.reshard_after_forward else sizes[:job.max_live_units + 1])


def _gathered(unit_bytes: dict[int, int], count: ModelCount, job: Job) -> int:
    """Stage 3's gathered units at their peak: the root plus the largest live units."""
    if not count.exact:  # one flat stand-in: the units are unknown (see flat_units)
        return 0
    others = sorted((b for u, b in unit_bytes.items() if u), reverse=True)
    live = len(others) if not job.reshard_after_forward else job.max_live_units
    return unit_bytes.get(0, 0) + sum(others[:live])


def flat_units(est: StageEstimate, count: ModelCount, job: Job, layers: int | None) -> StageEstimate:
    """``--params`` at stage 3: every parameter sits in ``layers`` equal units (embeddings unknown), merged
    where a layer holds fewer than ``min_unit_numel`` elements, as the optimizer merges its default units.

    Backward gathers the units again but the last (about 3Ψ per step, as the paper counts); without ``layers``
    the gathered units' size is unknown and left at 0. With ``layers`` an offload tier stages
    per partition (one per unit) and offload_params stages the in-flight units' shards only.
    """
    if count.exact or not STAGE_TRAITS[est.stage].shards_params:
        return est
    p = BYTES[count.params[0].dtype]
    gather_again = est.detail["param_full"] if job.reshard_after_forward and job.world_size > 1 else 0
    detail = dict(est.detail)
    gathered, staging, units = 0, 0, 1
    par = tier_options(est.offload)[1]
    moved = detail["host_params"] + detail["nvme_params"]
    if layers:  # layers smaller than min_unit_numel merge, as the optimizer's default units do
        per_layer = -(-count.numel() // layers)
        runs = merge_small([per_layer] * layers, job.min_unit_numel)
        units = len(runs)
        sizes = sorted((len(run) for run in runs), reverse=True)
        live = units if not job.reshard_after_forward else min(job.max_live_units, units)
        gathered = p * per_layer * sum(sizes[:live])
        staging = _in_flight({u: -(-moved // layers) * len(run) for u, run in enumerate(runs)}, job) if moved else 0
        if gather_again:  # the last unit stays gathered into backward
            gather_again = p * per_layer * (layers - len(runs[-1]))
    if job.regathered() not in COMM and gather_again:  # qwZ: payloads, in proportion to forward's of the flat buffer
        gather_again = detail[job.regathered()] * gather_again // detail["param_full"]
    detail[job.regathered()] += gather_again
    if job.secondary_shard and gather_again:  # hpZ: the copies of the units backward gathers again
        detail["secondary"] = gather_again // job.secondary_shard
        gathered += detail["secondary"]
    # without --layers the units, like the gathered bytes, are unknown: staged shards not counted
    reads = Tier.of(par) is Tier.NVME  # "nvme" reads the staged shards to the host first
    chunks = detail["host_staging"] - (detail["device_staging"] if reads else 0)  # shared by the units
    pinned = detail["host_pinned"] + ((staging - detail["device_staging"]) if reads else 0)  # _pinned's staged shards
    detail.update(device_staging=staging, host_staging=chunks + (staging if reads else 0),
                  partitions=detail["partitions"] * units, host_pinned=pinned)
    host = detail["host_states"] + detail["host_params"] + detail["host_grads"] + detail["host_staging"]
    return replace(est, gathered=gathered, comm_bytes=est.comm_bytes + gather_again, detail=detail,
                   host=host, staging=detail["device_staging"] + detail["grad_staging"])


def with_activations(est: StageEstimate, activations: int) -> StageEstimate:
    return replace(est, activations=activations)
