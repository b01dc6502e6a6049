"""A Plan as a readable table, or as a JSON-ready dict (``--json``). Bytes per rank throughout."""
from __future__ import annotations

from . import Plan
from .memory import StageEstimate
from .recommend import scale

ROWS = ("params", "grads", "optimizer", "buffers", "gathered", "activations", "total")
_LABELS = {"params": "params", "grads": "grads", "optimizer": "optimizer states", "buffers": "comm buffers",
           "gathered": "gathered units", "activations": "activations", "total": "total"}
_COMM = {0: "2Ψ all-reduce", 1: "2Ψ", 2: "2Ψ", 3: "3Ψ"}


def key(s: StageEstimate) -> str:
    """The stage's key in ``stages``: "2", or "2+host" once an offload tier exists."""
    return str(s.stage) if s.offload == "none" else f"{s.stage}+{s.offload}"


def fits(plan: Plan, s: StageEstimate) -> bool | None:
    usable = plan.recommendation.usable
    return None if usable is None else s.device <= usable


def stage_dict(plan: Plan, s: StageEstimate) -> dict:
    out = {"stage": s.stage, "offload": s.offload}
    out.update({row: getattr(s, row) for row in ROWS})
    out.update(comm_bytes=s.comm_bytes, fits=fits(plan, s), tiers={"device": s.device, "host": s.host, "nvme": s.nvme},
               detail=dict(s.detail))
    return out


def to_dict(plan: Plan) -> dict:
    m, job = plan.model, plan.job
    return {
        "model": {"source": m.source, "exact": m.exact, "params": m.numel(), "trainable": m.numel(True),
                  "frozen": m.numel(False), "by_dtype": m.by_dtype()},
        "job": {"world_size": job.world_size, "nodes": plan.nodes, "gpus_per_node": job.world_size // plan.nodes,
                "bucket_numel": job.bucket_numel, "reduce_dtype": job.reduce_dtype,
                "max_live_units": job.max_live_units, "gpu_memory": plan.gpu_memory, "headroom": plan.headroom,
                "activation_checkpointing": plan.activation_checkpointing},
        "activations": None if plan.activations is None else vars(plan.activations).copy(),
        "stages": {key(s): stage_dict(plan, s) for s in plan.stages},
        "recommendation": vars(plan.recommendation).copy(),
        "notes": list(plan.notes),
    }


def short_count(n: int) -> str:
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.3g}{suffix}"
    return str(n)


def table(plan: Plan) -> str:
    m, job = plan.model, plan.job
    size, unit = scale(max(s.total for s in plan.stages))
    dtypes = ", ".join(f"{d}: {short_count(v['trainable'])} trainable"
                       + (f" + {short_count(v['frozen'])} frozen" if v["frozen"] else "")
                       for d, v in m.by_dtype().items())
    nodes = f"{plan.nodes} node{'s' * (plan.nodes > 1)}"
    lines = [f"{short_count(m.numel())} parameters ({dtypes}) from {m.source}",
             f"{job.world_size} ranks on {nodes}, bucket {short_count(job.bucket_numel)} elements, reduce in "
             f"{job.reduce_dtype or 'the params dtype'}" + (", activation checkpointing"
                                                            if plan.activation_checkpointing else ""),
             ""]
    heads = [f"stage {key(s)}" + (" (DDP)" if s.stage == 0 else "") for s in plan.stages]
    lines.append(f"{'per rank, ' + unit:<18}" + "".join(f"{h:>13}" for h in heads))
    for row in ROWS:
        cells = ["-" if row == "gathered" and s.stage != 3 else f"{getattr(s, row) / size:.2f}" for s in plan.stages]
        lines.append(f"{_LABELS[row]:<18}" + "".join(f"{c:>13}" for c in cells))
    if plan.gpu_memory is not None:
        usable = plan.recommendation.usable
        label = f"fits {usable / size:.1f} {unit}"
        lines.append(f"{label:<18}" + "".join(f"{'yes' if fits(plan, s) else 'no':>13}" for s in plan.stages))
    comm_size, comm_unit = scale(max(max(s.comm_bytes for s in plan.stages), 1))
    comm = "".join(f"{s.comm_bytes / comm_size:>13.2f}" for s in plan.stages)
    lines.append(f"{'comm/step, ' + comm_unit:<18}" + comm)
    lines.append(f"{'':<18}" + "".join(f"{_COMM[s.stage]:>13}" for s in plan.stages))
    lines += ["", f"recommendation: {plan.recommendation.reason}"]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


__all__ = ["table", "to_dict", "key", "scale", "short_count"]
