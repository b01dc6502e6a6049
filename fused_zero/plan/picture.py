"""``--plot FILE.png``: stacked bars of bytes per GPU for each stage, the GPU's memory as a line.

Stages 0-3 without offload, and the recommended offload tier when there is one (its host and
NVMe bytes per node written above its bar).

matplotlib is an optional extra (``pip install matplotlib``, or ``pip install -e '.[plot]'`` in a checkout); it is imported only here,
only when a picture is drawn.
"""
from __future__ import annotations

import os

from . import Plan
from .memory import aka, find, traffic
from .report import ROWS, scale, short_count

_PARTS = ROWS[:-1]  # every row but the total, bottom to top
_COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "buffers": "#8172B3",
           "gathered": "#CCB974", "staging": "#937860", "activations": "#64B5CD"}
_NAMES = {"params": "params", "grads": "grads", "optimizer": "optimizer states (fp32)", "buffers": "comm buffers",
          "gathered": "gathered units (stage 3)", "staging": "offload staging", "activations": "activations"}


def figure_class():
    """matplotlib's Figure (drawn straight to a file: no pyplot, no backend switched); RuntimeError naming
    the extra when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib, an optional extra: pip install matplotlib "
                           "(or, in the fused_zero checkout, pip install -e '.[plot]')") from e
    return Figure


def check_path(path: str) -> None:
    """ValueError unless ``path`` names a file the picture can be written to: a format matplotlib writes (its
    suffix), in a folder that exists, not a folder itself. Checked before anything is printed."""
    formats = sorted(figure_class()().canvas.get_supported_filetypes())
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if os.path.isdir(path):
        raise ValueError(f"--plot {path} is a folder: name the picture's file, e.g. {os.path.join(path, 'plan.png')}")
    if suffix not in formats:
        raise ValueError(f"--plot {path}: the file's suffix picks the format, one of {', '.join(formats)} "
                         "(e.g. plan.png)")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--plot {path}: the folder {folder} does not exist")


def _label(s) -> str:
    size, unit = scale(max(s.comm_bytes, 1))
    name = f"ZeRO-{s.stage}" + aka(s.stage) + ("" if s.offload == "none" else f"\n{s.offload}")
    return name + f"\ncomm {traffic(s.stage)}: {s.comm_bytes / size:.1f} {unit}"


def bars(plan: Plan) -> list:
    """What the picture shows: stages 0-3, and the recommended offload tier."""
    rec = plan.recommendation
    shown = [s for s in plan.stages if s.offload == "none"]
    if rec.stage is not None and rec.offload != "none":
        shown.append(plan.stage(rec.stage, rec.offload))
    return shown


def draw(plan: Plan, path: str) -> None:
    """Write the picture of ``plan`` to ``path`` (format from its suffix, e.g. .png)."""
    figure = figure_class()
    shown = bars(plan)
    size, unit = scale(max([s.total for s in shown] + [plan.gpu_memory or 0]))
    rec = plan.recommendation
    chosen = find(plan.stages, rec.stage, rec.offload)
    fig = figure(figsize=(10, 5.4), dpi=120)
    ax = fig.subplots()
    xs = range(len(shown))
    bottoms = [0.0] * len(shown)
    for part in _PARTS:
        heights = [getattr(s, part) / size for s in shown]
        if any(heights):
            ax.bar(xs, heights, 0.6, bottom=bottoms, color=_COLORS[part], label=_NAMES[part], edgecolor="white")
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    for x, s in zip(xs, shown):
        best = s is chosen
        off = "".join(f"\n+ {getattr(s, t) * plan.ranks_per_node / size:.1f} {unit} {t}/node" for t in ("host", "nvme")
                      if getattr(s, t))
        ax.text(x, s.total / size, f"{s.total / size:.1f} {unit}" + off + ("\nrecommended" if best else ""),
                ha="center", va="bottom", fontsize=10 if not off else 8, fontweight="bold" if best else "normal",
                bbox=dict(facecolor="white", alpha=0.85, edgecolor="none", pad=1) if off else None)
    if plan.gpu_memory is not None:
        ax.axhline(plan.gpu_memory / size, color="#C44E52", linewidth=2,
                   label=f"GPU memory {plan.gpu_memory / size:.0f} {unit}")
        ax.axhline(rec.usable / size, color="#C44E52", linewidth=1, linestyle="--",
                   label=f"usable ({plan.headroom:.0%} headroom)")
    ax.set_xticks(list(xs), [_label(s) for s in shown])
    ax.set_ylabel(f"{unit} per GPU")
    top = max([s.total for s in shown] + [plan.gpu_memory or 0]) / size
    ax.set_ylim(0, top * 1.18)
    job = plan.job
    dtypes = "/".join(plan.model.by_dtype())
    ax.set_title(f"{short_count(plan.model.numel())} parameters ({dtypes}) on {job.world_size} "
                 f"GPU{'s' * (job.world_size > 1)}: memory per GPU by ZeRO stage", fontsize=11)
    handles, labels = ax.get_legend_handles_labels()  # lines first, then the bars top to bottom as stacked
    lines = 2 if plan.gpu_memory is not None else 0
    order = list(range(lines)) + list(range(len(handles) - 1, lines - 1, -1))
    ax.legend([handles[i] for i in order], [labels[i] for i in order], loc="upper left", bbox_to_anchor=(1.01, 1),
              fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    fig.text(0.01, 0.01, f"recommendation: {rec.reason}", fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path)
