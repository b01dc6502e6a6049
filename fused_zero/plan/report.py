"""A Plan as a readable table, or as a JSON-ready dict (``--json``). Bytes per rank throughout,
but for the offload tiers' host and NVMe columns of the table, per node (as DeepSpeed's estimators)."""
from __future__ import annotations

from fused_zero.config import STAGE_TRAITS

from . import Plan
from .levels import LAYOUTS
from .memory import StageEstimate, aka, find, traffic
from .recommend import options, scale

ROWS = ("params", "grads", "optimizer", "buffers", "gathered", "staging", "activations", "total")
_LABELS = {"params": "params", "grads": "grads", "optimizer": "optimizer states", "buffers": "comm buffers",
           "gathered": "gathered units", "staging": "offload staging", "activations": "activations",
           "total": "total"}


def key(s: StageEstimate) -> str:
    """The stage's key in ``stages``: "2", or "2+opt=cpu", "3+opt=cpu,params=cpu" for an offload tier."""
    return str(s.stage) if s.offload == "none" else f"{s.stage}+{s.offload}"


def fits_device(plan: Plan, s: StageEstimate) -> bool | None:
    usable = plan.recommendation.usable
    return None if usable is None else s.device <= usable


def fits_host(plan: Plan, s: StageEstimate) -> bool | None:
    usable = plan.recommendation.host_usable
    return None if usable is None else s.host * plan.ranks_per_node <= usable


def fits(plan: Plan, s: StageEstimate) -> bool | None:
    """On the device and, when --host-memory is given, in the node's host memory."""
    device, host = fits_device(plan, s), fits_host(plan, s)
    return device if device is None or host is None else device and host


def stage_dict(plan: Plan, s: StageEstimate) -> dict:
    out = {"stage": s.stage, "offload": s.offload, "offload_optimizer": s.offload_optimizer,
           "offload_params": s.offload_params}
    out.update({row: getattr(s, row) for row in ROWS})
    out.update(comm_bytes=s.comm_bytes, fits=fits(plan, s), fits_device=fits_device(plan, s),
               fits_host=fits_host(plan, s),
               tiers={"device": s.device, "host": s.host, "nvme": s.nvme},
               per_node={"host": s.host * plan.ranks_per_node, "nvme": s.nvme * plan.ranks_per_node},
               detail=dict(s.detail))
    return out


def to_dict(plan: Plan) -> dict:
    m, job = plan.model, plan.job
    return {
        "model": {"source": m.source, "exact": m.exact, "params": m.numel(), "trainable": m.numel(True),
                  "frozen": m.numel(False), "by_dtype": m.by_dtype()},
        "job": {"world_size": job.world_size, "nodes": plan.nodes, "gpus_per_node": plan.ranks_per_node,
                "bucket_numel": job.bucket_numel, "reduce_dtype": job.reduce_dtype,
                "max_live_units": job.max_live_units, "gpu_memory": plan.gpu_memory,
                "host_memory": plan.host_memory, "headroom": plan.headroom,
                "offload_chunk_numel": job.offload_chunk_numel, "max_offload": plan.max_offload,
                "activation_checkpointing": plan.activation_checkpointing},
        "activations": None if plan.activations is None else vars(plan.activations).copy(),
        "stages": {key(s): stage_dict(plan, s) for s in plan.stages},
        "recommendation": vars(plan.recommendation).copy(),
        "notes": list(plan.notes),
        "levels": [row._asdict() for row in plan.levels],
    }


def short_count(n: int) -> str:
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.3g}{suffix}"
    return str(n)


def _yes(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "no"


def table(plan: Plan) -> str:
    m, job = plan.model, plan.job
    base = [s for s in plan.stages if s.offload == "none"]
    size, unit = scale(max(s.total for s in base))
    dtypes = ", ".join(f"{d}: {short_count(v['trainable'])} trainable"
                       + (f" + {short_count(v['frozen'])} frozen" if v["frozen"] else "")
                       for d, v in m.by_dtype().items())
    nodes = f"{plan.nodes} node{'s' * (plan.nodes > 1)}"
    lines = [f"{short_count(m.numel())} parameters ({dtypes}) from {m.source}",
             f"{job.world_size} rank{'s' * (job.world_size > 1)} on {nodes}, bucket {short_count(job.bucket_numel)} elements, reduce in "
             f"{job.reduce_dtype or 'the params dtype'}" + (", activation checkpointing"
                                                            if plan.activation_checkpointing else ""),
             ""]
    heads = [f"stage {key(s)}" + aka(s.stage) for s in base]
    lines.append(f"{'per rank, ' + unit:<18}" + "".join(f"{h:>13}" for h in heads))
    for row in ROWS:
        if row == "staging":
            continue  # offload only: in the tiers' block
        cells = ["-" if row == "gathered" and not STAGE_TRAITS[s.stage].shards_params else f"{getattr(s, row) / size:.2f}" for s in base]
        lines.append(f"{_LABELS[row]:<18}" + "".join(f"{c:>13}" for c in cells))
    if plan.gpu_memory is not None:
        usable = plan.recommendation.usable
        label = f"fits {usable / size:.1f} {unit}"
        lines.append(f"{label:<18}" + "".join(f"{_yes(fits_device(plan, s)):>13}" for s in base))
    comm_size, comm_unit = scale(max(max(s.comm_bytes for s in base), 1))
    comm = "".join(f"{s.comm_bytes / comm_size:>13.2f}" for s in base)
    lines.append(f"{'comm/step, ' + comm_unit:<18}" + comm)
    lines.append(f"{'':<18}" + "".join(f"{_traffic(s):>13}" for s in base))
    lines += [""] + tiers_table(plan)
    lines += levels_table(plan)
    lines += ["", f"recommendation: {plan.recommendation.reason}"]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _traffic(s: StageEstimate) -> str:
    """The comm row's label: 2Ψ or 3Ψ, and how an unsharded stage (DDP) sends it."""
    return traffic(s.stage) + ("" if STAGE_TRAITS[s.stage].shards_states else " all-reduce")


def tiers_table(plan: Plan) -> list[str]:
    """The offload tiers the recommendation tries, one per line: GPU per rank, host and NVMe per node."""
    tiers = plan.tiers()
    size, unit = scale(max(max(s.total, s.host * plan.ranks_per_node, s.nvme * plan.ranks_per_node)
                           for s in tiers))
    n = plan.ranks_per_node
    host = "" if plan.host_memory is None else f", host {plan.recommendation.host_usable / size:.1f} {unit} usable"
    lines = [f"offload tiers, {unit} (host and NVMe per node of {n} rank{'s' * (n > 1)}{host})",
             f"{'per GPU':>9}{'host':>10}{'NVMe':>10}{'fits':>11}   ShardedOptimizer options"]
    rec = plan.recommendation
    chosen = find(plan.stages, rec.stage, rec.offload)
    for s in tiers:
        ok = fits(plan, s)
        why = " (host)" if ok is False and fits_device(plan, s) else ""
        best = "   <- recommended" if s is chosen else ""
        lines.append(f"{s.total / size:>9.2f}{s.host * n / size:>10.2f}{s.nvme * n / size:>10.2f}"
                     f"{_yes(ok) + why:>11}   stage={s.stage}, {options(s)}{best}")
    return lines


def levels_table(plan: Plan) -> list[str]:
    """Traffic per step per level (plan/levels.py), one line per stage and layout; nothing with one node."""
    if not plan.levels:
        return []
    size, unit = scale(max(max(r.inside, r.across) for r in plan.levels) or 1)
    g = plan.ranks_per_node
    job = plan.job
    codecs = ([f"grad_comm={job.grad_comm}"] if job.grad_comm else []) + \
        ([f"param_comm={job.param_comm} (stage 3)"] if job.param_comm else [])
    lines = ["", f"traffic per level, {unit} per rank per step (one micro-batch; {plan.nodes} nodes x {g} ranks; "
                 f"HSDP: shard group = a node; hpZ: secondary_shard={g})"]
    if codecs:  # the codecs' payloads apart: how much of each level they carry
        lines.append(f"codecs: {', '.join(codecs)}, quant_block={job.quant_block}; "
                     "coded: of those, the codecs' payloads")
    lines.append(f"{'':<18}{'inside a node':>15}{'across nodes':>15}{'hpZ copies':>13}"
                 + (f"{'coded inside':>15}{'coded across':>15}" if codecs else ""))
    for r in plan.levels:
        copies = f"{r.secondary / size:.2f}" if r.layout == "hpz" else "-"
        coded = f"{r.coded_inside / size:>15.2f}{r.coded_across / size:>15.2f}" if codecs else ""
        lines.append(f"{f'stage {r.stage} {LAYOUTS[r.layout]}':<18}{r.inside / size:>15.2f}{r.across / size:>15.2f}"
                     f"{copies:>13}{coded}")
    return lines


__all__ = ["table", "to_dict", "key", "scale", "short_count", "fits", "tiers_table", "levels_table"]
