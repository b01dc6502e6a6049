"""Which stage to pick: the seeds' flowchart, with the reason in one line.

Fits without sharding -> stage 0 on one GPU, stage 1 on several (the same 2Ψ of
communication as DDP, less memory); else several GPUs -> stage 2 if it fits (still 2Ψ),
else stage 3 (3Ψ); else it does not fit: offload (not available yet) or more GPUs.
"Fits" means the peak total stays within the GPU's memory less the headroom.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .memory import StageEstimate

_UNITS = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"), (1, "B"))
_COMM = {0: "2Ψ", 1: "2Ψ", 2: "2Ψ", 3: "3Ψ"}


@dataclass(frozen=True)
class Recommendation:
    stage: int | None  # None: nothing fits, or no --gpu-memory to decide with
    offload: str  # the tier ("none" until offload exists)
    fits: bool | None  # None without a GPU memory size
    usable: int | None  # bytes per GPU the plan may use (memory less headroom)
    reason: str


def scale(n: int) -> tuple[int, str]:
    """The binary unit to show ``n`` bytes in: (bytes per unit, name)."""
    return next((size, name) for size, name in _UNITS if n >= size or size == 1)


def human(n: int) -> str:
    """``n`` bytes in the largest unit that keeps it >= 1 (GiB for GPU-sized figures)."""
    size, unit = scale(n)
    return f"{n / size:.1f} {unit}"


def recommend(stages: Sequence[StageEstimate], world_size: int, gpu_memory: int | None,
              headroom: float) -> Recommendation:
    by = {s.stage: s for s in stages}
    if gpu_memory is None:
        least = min(stages, key=lambda s: s.total)
        return Recommendation(None, "none", None, None, "no --gpu-memory given: cannot tell what fits; stage "
                              f"{least.stage} needs the least, {human(least.total)} per rank")
    usable = int(gpu_memory * (1 - headroom))
    within = f"of {human(usable)} usable ({human(gpu_memory)} less {headroom:.0%} headroom)"

    def pick(stage: int, why: str) -> Recommendation:
        return Recommendation(stage, "none", True, usable, f"stage {stage}: {human(by[stage].total)} per rank {within}"
                              f"; {why}")

    fits = {s: by[s].total <= usable for s in by}
    if fits[0]:
        if world_size > 1 and by[1].total <= by[0].total:
            return pick(1, f"fits unsharded (stage 0: {human(by[0].total)}), and stage 1 sends the same "
                           f"{_COMM[1]} per step with less memory")
        return pick(0, "fits without sharding" + ("; one GPU has nothing to shard" if world_size == 1 else ""))
    for stage in (2, 3):
        if fits[stage]:
            before = 0 if stage == 2 else 2
            return pick(stage, f"stage {before} needs {human(by[before].total)}; {_COMM[stage]} of communication "
                               "per step" + (" (1.5x DDP's)" if stage == 3 else ", as DDP"))
    return Recommendation(None, "none", False, usable, f"does not fit: stage 3 needs {human(by[3].total)} per rank "
                          f"{within}; offload (not available yet) or more GPUs")
