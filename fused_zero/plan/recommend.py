"""Which stage to pick: the seeds' flowchart, with the reason in one line.

Fits without sharding -> stage 0 on one GPU, stage 1 on several (the same 2Ψ of
communication as DDP, less memory); else several GPUs -> stage 2 if it fits (still 2Ψ),
else stage 3 (3Ψ); else the cheapest offload tier that fits (memory.LADDER: the optimizer
states to host memory at stage 2, then stage 3, then stage 3 with its params there too,
then the same on NVMe), no further than ``max_offload``; else more GPUs. "Fits" means the
peak device total stays within the GPU's memory less the headroom and, when the host
memory per node is given, the node's ranks' host bytes within it less the same headroom.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fused_zero.config import STAGE_TRAITS

from .memory import DDP, LADDER, StageEstimate, find, stage_where, tier, traffic

_UNITS = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"), (1, "B"))
_DEPTH = {"none": 0, "cpu": 1, "nvme": 2}


@dataclass(frozen=True)
class Recommendation:
    stage: int | None  # None: nothing fits, or no --gpu-memory to decide with
    offload: str  # the tier: "none", "opt=cpu", "opt=cpu,params=cpu", ... (memory.tier)
    fits: bool | None  # None without a GPU memory size
    usable: int | None  # bytes per GPU the plan may use (memory less headroom)
    reason: str
    host_usable: int | None = None  # host bytes per node the plan may use (None: not given, not checked)


def scale(n: int) -> tuple[int, str]:
    """The binary unit to show ``n`` bytes in: (bytes per unit, name)."""
    return next((size, name) for size, name in _UNITS if n >= size or size == 1)


def human(n: int) -> str:
    """``n`` bytes in the largest unit that keeps it >= 1 (GiB for GPU-sized figures)."""
    size, unit = scale(n)
    return f"{n / size:.1f} {unit}"


def options(s: StageEstimate) -> str:
    """The tier as ShardedOptimizer's options: 'offload_optimizer="cpu", offload_params="cpu"'."""
    opt, par = s.offload_optimizer, s.offload_params
    return ", ".join(f'{k}="{v}"' for k, v in (("offload_optimizer", opt), ("offload_params", par)) if v)


def depth(s: StageEstimate) -> int:
    """0 on the device, 1 host memory, 2 NVMe: the furthest place the tier puts anything."""
    return max(_DEPTH[s.offload_optimizer or "none"], _DEPTH[s.offload_params or "none"])


def recommend(stages: Sequence[StageEstimate], world_size: int, gpu_memory: int | None, headroom: float,
              host_memory: int | None = None, ranks_per_node: int = 1, max_offload: str = "nvme") -> Recommendation:
    by = {n: find(stages, n) for n in STAGE_TRAITS}
    host_usable = None if host_memory is None else int(host_memory * (1 - headroom))
    if gpu_memory is None:
        least = min(by.values(), key=lambda s: s.total)
        return Recommendation(None, "none", None, None, "no --gpu-memory given: cannot tell what fits; stage "
                              f"{least.stage} needs the least, {human(least.total)} per rank", host_usable)
    usable = int(gpu_memory * (1 - headroom))
    within = f"of {human(usable)} usable ({human(gpu_memory)} less {headroom:.0%} headroom)"

    def pick(stage: int, why: str) -> Recommendation:
        return Recommendation(stage, "none", True, usable, f"stage {stage}: {human(by[stage].total)} per rank {within}"
                              f"; {why}", host_usable)

    fits = {s: by[s].total <= usable for s in by}
    if fits[DDP]:
        alike = stage_where(shards_states=True, shards_grads=False)  # stage 1: DDP's .grad, less memory
        ddp = STAGE_TRAITS[alike].versus
        if world_size > 1 and by[alike].total <= by[ddp].total:
            return pick(alike, f"fits unsharded (stage {ddp}: {human(by[ddp].total)}), and stage {alike} sends the "
                               f"same {traffic(alike)} per step with less memory")
        return pick(DDP, "fits without sharding" + ("; one GPU has nothing to shard" if world_size == 1 else ""))
    for stage, traits in STAGE_TRAITS.items():  # the stages that shard gradients, least sharded first
        if traits.shards_grads and fits[stage]:
            before = traits.versus
            return pick(stage, f"stage {before} needs {human(by[before].total)}; {traffic(stage)} of communication "
                               "per step" + (" (1.5x DDP's)" if traits.shards_params else ", as DDP"))
    most = stage_where(shards_params=True)
    on_device = f"stage {most} needs {human(by[most].total)} per rank {within}"
    tiers = [s for s in (find(stages, st, tier(o, p)) for st, o, p in LADDER) if s is not None]
    allowed = [s for s in tiers if depth(s) <= _DEPTH[max_offload]]
    host_short = None
    for s in allowed:
        if s.total > usable:
            continue
        node_host = s.host * ranks_per_node
        if host_usable is not None and node_host > host_usable:
            host_short = host_short or s
            continue
        moved = "the optimizer states" + (", the parameter shards" if s.offload_params else "")
        moved = (f"{moved} and the gradient shard in host memory" if depth(s) == 1 else
                 f"{moved.replace(', ', ' and ')} on NVMe, the gradient shard in host memory")
        host = (f"host {human(node_host)} per node of {human(host_usable)} usable" if host_usable is not None else
                f"host {human(node_host)} per node, not checked (pass --host-memory)")
        nvme = f", NVMe {human(s.nvme * ranks_per_node)} per node" if s.nvme else ""
        return Recommendation(s.stage, s.offload, True, usable,
                              f"stage {s.stage} with {options(s)}: {human(s.total)} per rank {within}, {moved} "
                              f"({host}{nvme}); without offload stage {most} needs {human(by[most].total)}",
                              host_usable)
    if not allowed:
        return Recommendation(None, "none", False, usable, f"does not fit: {on_device}; --max-offload none rules "
                              "out offload: allow it, or use more GPUs", host_usable)
    if host_short is not None:
        return Recommendation(None, "none", False, usable, f"does not fit: {on_device}; stage {host_short.stage} with "
                              f"{options(host_short)} fits the GPU but needs {human(host_short.host * ranks_per_node)} "
                              f"of host memory per node, more than {human(host_usable)} usable: more host memory"
                              + (", --max-offload nvme" if max_offload != "nvme" else "") + " or more GPUs",
                              host_usable)
    last = allowed[-1]
    return Recommendation(None, "none", False, usable, f"does not fit: {on_device}, and stage {last.stage} with "
                          f"{options(last)} still {human(last.total)}: more GPUs"
                          + (" (or activation checkpointing, a smaller micro-batch)" if last.activations else ""),
                          host_usable)
