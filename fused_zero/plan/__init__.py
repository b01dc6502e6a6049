"""The planner: bytes per GPU at stages 0-3 before launching a job, and which stage to pick.

    python -m fused_zero.plan --params 7e9 --world-size 8 --gpu-memory 80GiB
    plan = fused_zero.plan.estimate(7e9, world_size=8, gpu_memory=80 * 2**30)

``estimate`` returns a frozen ``Plan``: a ``StageEstimate`` per stage and offload tier
(params, grads, optimizer, buffers, gathered units, staging, activations, total and
communication on the device; host and NVMe bytes; bytes per rank) and a ``Recommendation``.
Stages 1-3 follow what ShardedOptimizer allocates (see memory.py), at every offload tier
(``plan.stage(2, "opt=cpu")``, ``plan.stage(3, "opt=nvme,params=nvme")``); stage 0 is DDP +
torch AdamW with an fp32 master for 16-bit params.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from fused_zero.config import STAGE_TRAITS, ZeroConfig

from . import activations as _act
from .levels import LevelTraffic, levels
from .count import DTYPES, ModelCount, count_module, dtype_name, flat_count
from .memory import (LADDER, Job, StageEstimate, all_tiers, find, flat_units, sharded, stage_traits, tier,
                     tier_options, unsharded, with_activations)
from .recommend import Recommendation, recommend

__all__ = ["estimate", "Plan", "StageEstimate", "Recommendation", "ModelCount", "DTYPES", "OFFLOAD", "tier"]

#: How far the recommendation may offload (``max_offload``): not at all, host memory, or NVMe too.
OFFLOAD = ("none", "cpu", "nvme")

_DEFAULTS = ZeroConfig()


@dataclass(frozen=True)
class Plan:
    model: ModelCount
    job: Job
    nodes: int
    gpu_memory: int | None
    headroom: float
    activations: _act.Activations | None
    activation_checkpointing: bool
    stages: tuple[StageEstimate, ...]  # stages 0-3, then every offload tier (memory.all_tiers: the ladder first)
    recommendation: Recommendation
    notes: tuple[str, ...]
    host_memory: int | None = None  # per node
    max_offload: str = "nvme"
    levels: tuple[LevelTraffic, ...] = ()  # traffic per step inside a node and across nodes (levels.py)

    @property
    def ranks_per_node(self) -> int:
        return self.job.world_size // self.nodes

    def stage(self, n: int, offload: str = "none") -> StageEstimate:
        """Stage ``n`` at the offload tier ``offload`` ("none", "opt=cpu", "opt=cpu,params=cpu", ...)."""
        opt, par = tier_options(offload)
        traits = stage_traits(n)
        if par is not None and (traits is None or not traits.shards_params):
            raise ValueError(f"offload_params needs stage 3 (stages 1-2 keep every parameter whole on every rank): "
                             f"{offload!r} is planned at stage 3 only")
        if traits is not None and not traits.shards_states and (opt, par) != (None, None):
            raise ValueError("stage 0 (DDP) has no offload tiers: they are planned at stages 1-3")
        found = find(self.stages, n, tier(opt, par))
        if found is None:
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {n!r}")
        return found

    def tiers(self) -> tuple[StageEstimate, ...]:
        """The offload tiers the recommendation tries, cheapest first (memory.LADDER)."""
        first = len(STAGE_TRAITS)  # after the stages without offload
        return self.stages[first:first + len(LADDER)]


def _count(name: str, value, minimum: int = 1, optional: bool = False) -> int | None:
    """A whole number >= minimum (7e9 is fine); ValueError/TypeError naming the option."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if value < minimum or value != int(value):
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return int(value)


def _flag(name: str, value) -> bool:
    """A True/False option (a string "False" would read as True): TypeError naming it otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def _size(name: str, value) -> int | None:
    """Bytes: a whole number >= 0, or None."""
    return _count(name, value, minimum=0, optional=True)


#: the most buckets a plan lays out (at 2**24 elements a bucket, 1.7e12 parameters)
MAX_BUCKETS = 100_000

#: the most layers a plan takes (the deepest models have a few hundred); with ``params`` each is a stage 3 unit
#: the plan lays out, as the optimizer keeps Python state and gathers per unit (1e9 took minutes and gigabytes)
MAX_LAYERS = 100_000


def estimate(params=None, *, model=None, world_size: int = 1, nodes: int = 1, param_dtype=None,
             reduce_dtype=None, bucket_numel: int = _DEFAULTS.bucket_numel, gpu_memory=None,
             headroom: float = 0.1, activations=None, seq_len=None, micro_batch=None, hidden=None,
             layers=None, heads=None, activation_checkpointing: bool = False,
             max_live_units: int = _DEFAULTS.max_live_units, reshard_after_forward: bool = True,
             units=None, min_unit_numel: int = _DEFAULTS.min_unit_numel, host_memory=None,
             offload_chunk_numel: int = _DEFAULTS.offload_chunk_numel,
             max_offload: str = "nvme", secondary_shard: int | None = None, param_comm: str | None = None,
             grad_comm: str | None = None, quant_block: int = _DEFAULTS.quant_block) -> Plan:
    """Plan the memory per rank of training ``params`` elements, or ``model`` (an nn.Module, best on meta).

    Sizes are bytes (``gpu_memory`` per GPU, ``host_memory`` per node, ``activations``);
    ``param_dtype`` and ``reduce_dtype`` are "bf16", "fp16", "fp32" or torch dtypes
    (``param_dtype`` None: the model's own, bf16 for ``params``). Every offload tier is planned;
    when no stage fits on the device the recommendation takes the cheapest tier that does (and
    whose host bytes fit ``host_memory`` among the node's ranks, when given), going no further
    than ``max_offload`` ("none", "cpu" or "nvme"). ``secondary_shard``: stage 3 with hpZ (ZeroConfig's;
    stages 1-2 are planned without it). ``param_comm`` ("int8": qwZ, stage 3's gathers; stages 1-2 are planned
    without it), ``grad_comm`` ("int8", "int4": qgZ) and ``quant_block``: the codecs (ZeroConfig's), whose payloads
    the traffic counts under comm_bytes()'s keys ("all_gather_int8", ...). ``Plan.levels`` splits each stage's
    traffic into inside a node and across nodes for flat ZeRO, HSDP and hpZ. Raises ValueError or TypeError
    saying what to change.
    """
    if (params is None) == (model is None):
        raise ValueError("give the model's size (params=7e9) or the model itself (model=...), exactly one")
    if units is not None and model is None:
        raise ValueError("units= names the model's stage 3 units (module classes): it needs model=; with params=, "
                         "give layers= for the number of units")
    activation_checkpointing = _flag("activation_checkpointing", activation_checkpointing)
    world_size = _count("world_size", world_size)
    nodes = _count("nodes", nodes)
    if world_size % nodes:
        raise ValueError(f"world_size {world_size} is not a multiple of nodes {nodes}: give the total number of "
                         "ranks, the same on every node")
    reshard_after_forward, secondary_shard = _stage3_gathers(reshard_after_forward, secondary_shard, world_size)
    job = Job(world_size, _count("bucket_numel", bucket_numel),
              None if reduce_dtype is None else dtype_name(reduce_dtype, "reduce_dtype"),
              _count("max_live_units", max_live_units), reshard_after_forward,
              _count("offload_chunk_numel", offload_chunk_numel),
              _count("min_unit_numel", min_unit_numel, minimum=0),
              secondary_shard, *_codecs(param_comm, grad_comm, quant_block))
    if max_offload not in OFFLOAD:
        raise ValueError(f"max_offload must be one of {', '.join(OFFLOAD)} (how far the recommendation may "
                         f"offload), got {max_offload!r}")
    pdt = None if param_dtype is None else dtype_name(param_dtype, "param_dtype")
    if model is None:
        count = flat_count(_count("params", params), pdt or "bf16")
    else:
        count = count_module(model, type(model).__name__, pdt, units, job.min_unit_numel)
    total = sum(s.numel for s in count.params)
    layers = check_layers(layers, total if model is None else None)
    if total // job.bucket_numel > MAX_BUCKETS:  # the plan lays out every bucket, as the optimizer would
        raise ValueError(f"{total:.3g} parameters in buckets of {job.bucket_numel} elements make "
                         f"{total // job.bucket_numel:.3g} buckets, more than {MAX_BUCKETS:.0e} (the optimizer keeps "
                         "Python state and launches a collective per bucket): pass a larger bucket_numel "
                         f"(at least {-(-total // MAX_BUCKETS)}), or check the parameter count")
    gpu_memory = _size("gpu_memory", gpu_memory)
    if gpu_memory == 0:
        raise ValueError("gpu_memory must be positive (bytes), e.g. 80 * 2**30 for 80 GiB")
    host_memory = _size("host_memory", host_memory)
    if host_memory == 0:
        raise ValueError("host_memory must be positive (bytes per node), e.g. 1024 * 2**30 for 1 TiB")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 1:
        raise ValueError(f"headroom must be a fraction in [0, 1), e.g. 0.1, got {headroom!r}")
    act = _activations(activations, seq_len, micro_batch, hidden, layers, heads, pdt or count.params[0].dtype)
    act_bytes = act.bytes(activation_checkpointing) if act else 0
    planned = [(n, None, None) for n, t in STAGE_TRAITS.items() if t.shards_states] + list(all_tiers())
    stages = (unsharded(count, job),) + tuple(flat_units(sharded(count, job, *t), count, job, layers) for t in planned)
    stages = tuple(with_activations(s, act_bytes) for s in stages)
    rec = recommend(stages, world_size, gpu_memory, headroom, host_memory, world_size // nodes, max_offload)
    return Plan(count, job, nodes, gpu_memory, float(headroom), act, bool(activation_checkpointing), stages, rec,
                _notes(count, act, layers, job), host_memory, max_offload, levels(count, job, nodes, layers))


def check_layers(layers, params: int | None = None) -> int | None:
    """``layers``: None, or a whole number from 1 to MAX_LAYERS and, given ``params`` (a flat count, whose
    layers are the stage 3 units), no more than the parameters: ValueError/TypeError saying why."""
    layers = _count("layers", layers, optional=True)
    if layers is not None and layers > MAX_LAYERS:
        raise ValueError(f"{layers} layers is more than {MAX_LAYERS} (the deepest models have a few hundred; the plan "
                         "lays out every layer, as the optimizer does each stage 3 unit): check the layer count")
    if layers is not None and params is not None and layers > params:
        raise ValueError(f"{layers} layers is more than the {params} parameters (each layer, a stage 3 unit, holds "
                         "at least one parameter): give fewer layers, or check the parameter count")
    return layers


def _stage3_gathers(reshard_after_forward, secondary_shard, world_size: int) -> tuple:
    """(reshard_after_forward, secondary_shard): hpZ's group size an int >= 2 dividing the world size (as the
    topology checks it), and the pair checked by ZeroConfig itself (a bool; hpZ needs the backward gathers)."""
    if secondary_shard is not None:
        secondary_shard = _count("secondary_shard", secondary_shard, minimum=2)
        if world_size % secondary_shard:
            raise ValueError(f"secondary_shard {secondary_shard} does not divide world_size {world_size}: give the "
                             "ranks per node")
    ZeroConfig(stage=3, reshard_after_forward=reshard_after_forward, secondary_shard=secondary_shard)
    return reshard_after_forward, secondary_shard


def _codecs(param_comm, grad_comm, quant_block) -> tuple:
    """(param_comm, grad_comm, quant_block), checked by ZeroConfig itself (at stage 3, which takes every codec)."""
    ZeroConfig(stage=3, param_comm=param_comm, grad_comm=grad_comm, quant_block=quant_block)
    return param_comm, grad_comm, quant_block


def _activations(given, seq_len, micro_batch, hidden, layers, heads, dtype):
    shape = {"seq_len": seq_len, "micro_batch": micro_batch, "hidden": hidden}
    if given is not None:
        if any(v is not None for v in shape.values()):
            raise ValueError("give activations (bytes) or seq_len/micro_batch/hidden/layers, not both")
        return _act.given(_size("activations", given))
    if all(v is None for v in shape.values()) and heads is None:  # layers alone: stage 3 units
        return None
    if any(v is None for v in shape.values()) or layers is None:
        raise ValueError("the transformer activation estimate needs seq_len, micro_batch, hidden and layers "
                         f"together (got {dict(shape, layers=layers, heads=heads)})")
    sizes = {k: _count(k, v) for k, v in dict(shape, layers=layers).items()}
    heads = _count("heads", heads, optional=True)
    if heads is not None and sizes["hidden"] % heads:
        raise ValueError(f"heads={heads} does not divide hidden={sizes['hidden']}: each head takes hidden / heads "
                         "of the width; pass the model's own head count")
    return _act.transformer(**sizes, heads=heads, dtype_bytes=4 if dtype == "fp32" else 2)


def _notes(count: ModelCount, act, layers, job: Job) -> tuple[str, ...]:
    notes = []
    if job.param_comm is not None:
        notes.append(f"param_comm={job.param_comm} (qwZ) quantizes stage 3's gathers: stages 1-2 gather once per step "
                     "into every rank's only copy of the parameters and are planned without it (the optimizer "
                     "refuses it there)")
    if not count.exact:
        notes.append("--params: one flat trainable buffer (per-parameter 64-element alignment, param groups and "
                     "frozen parameters unknown; pass --model for exact sizes)")
        notes.append(f"stage 3 gathered units: {layers} equal units (embeddings unknown)" if layers else
                     "stage 3 gathered units (and offload_params' staged shards) not counted: pass --layers (or "
                     "--model) to size them")
    if act is None:
        notes.append("activations not counted: pass --activations GiB or --seq-len/--micro-batch/--hidden/--layers")
    else:
        notes.append(f"activations: {act.source}")
    notes.append("stage 0 is DDP + torch AdamW (fp32 master for 16-bit params, gradient_as_bucket_view=True); "
                 "stages 2-3 briefly hold some not-yet-reduced .grad tensors during backward (not counted)")
    notes.append("offload tiers: host memory counts the staging buffers a GPU run pins; the NVMe state files hold "
                 "two slots (twice opt=nvme's states on disk) and go through the page cache (not counted)")
    return tuple(notes)
