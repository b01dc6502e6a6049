"""``python -m fused_zero.plan``: which ZeRO stage (and offload tier) fits, per GPU, in a table, JSON or a picture.

    python -m fused_zero.plan --params 7e9 --world-size 8 --gpu-memory 80GiB \\
        --seq-len 4096 --micro-batch 1 --hidden 4096 --layers 32 --plot docs/plan_7b_8gpu.png
    python -m fused_zero.plan --model mypkg.models:build --model-path src --world-size 4 --json
    python -m fused_zero.plan --params 7e9 --gpu-memory 24GiB --host-memory 128GiB --layers 32
    python -m fused_zero.plan --params 7e9 --nodes 4 --gpus-per-node 8 --layers 32   # + traffic per level
    python -m fused_zero.plan --params 7e9 --nodes 4 --gpus-per-node 8 --layers 32 --grad-comm int8 --param-comm int8

Bad input ends with ``error: ...`` on stderr and exit code 2, as argparse does.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

from . import check_layers, estimate
from .count import DTYPES, load_model

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_BYTES = {"": 1 << 30, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def _number(text: str, units: dict, what: str) -> float:
    m = re.fullmatch(r"\s*([-+]?[0-9.]+(?:e[-+]?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in units:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    try:
        value = float(m.group(1)) * units[m.group(2)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative: give {what}")
    if not math.isfinite(value):  # 1e400, 1e300GiB: float infinity, which int() cannot take
        raise argparse.ArgumentTypeError(f"{text!r} is too large to be a number: give {what}")
    return value


def count(text: str) -> int:
    """7e9, 7B, 350M, 70000000000."""
    value = _number(text, _SUFFIX, "a parameter count (e.g. 7e9, 7B, 350M)")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a model needs at least one parameter")
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of parameters (1.5B or 1.5e9 for 1.5 "
                                         "billion)")
    return int(value)


def nbytes(text: str) -> int:
    """80GiB, 80GB, 141e9B; a plain number is GiB."""
    return int(_number(text, _BYTES, "a size (e.g. 80GiB, 80GB; a plain number is GiB)"))


def positive(text: str, minimum: int = 1) -> int:
    try:
        value = int(float(text)) if float(text).is_integer() else None
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= {minimum}")
    return value


def nonnegative(text: str) -> int:
    """A whole number >= 0."""
    return positive(text, minimum=0)


def layers(text: str) -> int:
    """A whole number from 1 to MAX_LAYERS (the plan's bound)."""
    value = positive(text)
    try:
        return check_layers(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in [0, 1) (e.g. 0.1 for 10%)")
    return value


#: The job's options: (flag, type, default, metavar, help).
_JOB = (
    ("--model-path", str, None, "DIR", "a folder added to sys.path to import --model"),
    ("--world-size", "positive", None, "N", "data-parallel ranks in total (default: nodes x gpus per node, or 1)"),
    ("--nodes", "positive", 1, "N", "nodes the ranks run on (default 1; --host-memory is shared by the "
                                    "world size / nodes ranks of a node); with more than one, the traffic per "
                                    "level (inside a node, across nodes) of flat ZeRO, HSDP and hpZ"),
    ("--gpus-per-node", "positive", None, "N", "ranks per node (default: world size / nodes)"),
    ("--param-dtype", tuple(DTYPES), None, None, "dtype of the parameters (default: the model's own; bf16 with "
                                                 "--params)"),
    ("--reduce-dtype", tuple(DTYPES), None, None, "gradient reduction dtype (default: the params')"),
    ("--bucket-numel", "positive", 1 << 24, "N", "elements per bucket (default 2**24)"),
    ("--max-live-units", "positive", 2, "N", "stage 3 units gathered at once besides the root (default 2)"),
    ("--min-unit-numel", "nonnegative", 1 << 20, "N", "stage 3: default units smaller than this many elements "
                                                      "are merged (default 2**20; 0: one unit per module)"),
    ("--param-comm", ("int8",), None, None, "stage 3: qwZ, the parameter gathers sent as int8 + an fp32 scale per "
                                            "block (stages 1-2 are planned without it)"),
    ("--grad-comm", ("int8", "int4"), None, None, "qgZ: the gradient reduce-scatters (and HSDP's all-reduce over the "
                                                  "replicas) sent as int8 or int4 + fp32 scales"),
    ("--quant-block", "positive", 256, "N", "values per fp32 scale of the codecs (default 256; a power of two from "
                                            "32 to 8192)"),
    ("--gpu-memory", "nbytes", None, "SIZE", "memory per GPU, e.g. 80GiB; needed for a recommendation"),
    ("--headroom", "fraction", 0.1, "F", "fraction of the GPU (and of the host memory) kept free (default 0.1)"),
)
_OFFLOAD = (
    ("--host-memory", "nbytes", None, "SIZE", "host memory per node, e.g. 512GiB: checks the offload tiers' host "
                                              "bytes (default: not checked)"),
    ("--max-offload", ("none", "cpu", "nvme"), "nvme", None, "how far the recommendation may offload when no stage "
                                                             "fits on the GPU: none, cpu (host memory) or nvme "
                                                             "(default nvme)"),
    ("--offload-chunk-numel", "positive", 1 << 20, "N", "offload_chunk_numel: elements per staged chunk (default "
                                                        "2**20)"),
)
_ACTIVATIONS = (
    ("--activations", "nbytes", None, "SIZE", "activation memory, e.g. 12GiB"),
    ("--seq-len", "positive", None, "N", "sequence length"),
    ("--micro-batch", "positive", None, "N", "sequences per micro-batch"),
    ("--hidden", "positive", None, "N", "hidden size"),
    ("--layers", "layers", None, "N", "transformer layers (with --params, also the number of stage 3 units)"),
    ("--heads", "positive", None, "N", "attention heads: counts the attention matrix (omit for flash attention)"),
)


def _add(group, options) -> None:
    types = {"positive": positive, "nonnegative": nonnegative, "nbytes": nbytes, "fraction": fraction,
             "layers": layers}
    for flag, kind, default, metavar, text in options:
        if isinstance(kind, tuple):
            group.add_argument(flag, choices=kind, default=default, help=text)
        else:
            group.add_argument(flag, type=types.get(kind, kind), default=default, metavar=metavar, help=text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fused_zero.plan",
                                description="Which ZeRO stage fits, in bytes per GPU: a table, JSON or a picture.")
    # "--params -7e9" reaches the count's own check ("is negative") rather than argparse taking "-7e9" for an option
    # (argparse knows negative numbers only without an exponent)
    p._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?[kKmMbBtT]?$")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=count, metavar="N", help="number of parameters (7e9, 7B): one flat buffer")
    what.add_argument("--model", metavar="MODULE:CALLABLE", help="a no-argument callable returning the model; "
                      "built on the meta device (no memory) and counted exactly")
    _add(p, _JOB)
    _add(p.add_argument_group("offload tiers (every tier is planned; these decide the recommendation)"), _OFFLOAD)
    act = p.add_argument_group("activations (per rank; default: not counted)")
    _add(act, _ACTIVATIONS)
    act.add_argument("--activation-checkpointing", action="store_true",
                     help="count checkpointed activations (each layer's input, one layer recomputed)")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON instead of the table")
    out.add_argument("--plot", metavar="FILE.png", help="also draw stacked bars per stage (needs matplotlib)")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.activation_checkpointing and args.seq_len is None:  # counted from the layer shapes, else ignored
        p.error("--activation-checkpointing counts checkpointed activations from the model's shape: give --seq-len, "
                "--micro-batch, --hidden and --layers with it (a size given with --activations is taken as it is)")
    if args.params is not None:  # more layers (stage 3 units) than parameters: an argparse error as the others
        try:
            check_layers(args.layers, args.params)
        except ValueError as e:
            p.error(f"argument --layers: {e}")
    try:
        if args.plot:  # before any output: no table followed by an error
            from .picture import check_path
            check_path(args.plot)
        world_size = _world_size(args.world_size, args.nodes, args.gpus_per_node)
        model = None if args.model is None else load_model(args.model, args.model_path)
        plan = estimate(args.params, model=model, world_size=world_size, nodes=args.nodes,
                        param_dtype=args.param_dtype, reduce_dtype=args.reduce_dtype, bucket_numel=args.bucket_numel,
                        gpu_memory=args.gpu_memory, headroom=args.headroom, activations=args.activations,
                        seq_len=args.seq_len, micro_batch=args.micro_batch, hidden=args.hidden, layers=args.layers,
                        heads=args.heads, activation_checkpointing=args.activation_checkpointing,
                        max_live_units=args.max_live_units, min_unit_numel=args.min_unit_numel,
                        host_memory=args.host_memory, param_comm=args.param_comm, grad_comm=args.grad_comm,
                        quant_block=args.quant_block, max_offload=args.max_offload,
                        offload_chunk_numel=args.offload_chunk_numel)
        if args.model is not None:
            plan = _named(plan, args.model)
    except (ValueError, TypeError, RuntimeError) as e:
        p.error(str(e))
    from .report import table, to_dict
    try:
        print(json.dumps(to_dict(plan), indent=2) if args.json else table(plan), flush=True)
    except BrokenPipeError:  # `... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if args.plot:
        from .picture import draw
        try:
            draw(plan, args.plot)
        except (OSError, ValueError) as e:  # a full disk, a folder removed since the check
            p.error(f"--plot {args.plot}: {e}")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _world_size(world_size: int | None, nodes: int, gpus_per_node: int | None) -> int:
    """--world-size, or --nodes x --gpus-per-node (both given: they must agree)."""
    if gpus_per_node is None:
        if world_size is None and nodes > 1:
            raise ValueError(f"--nodes {nodes} needs --gpus-per-node (or --world-size, the total number of ranks)")
        return 1 if world_size is None else world_size
    if world_size is not None and world_size != nodes * gpus_per_node:
        raise ValueError(f"--world-size {world_size} is not --nodes {nodes} x --gpus-per-node {gpus_per_node}: "
                         "give one of them, or make them agree")
    return nodes * gpus_per_node


def _named(plan, source: str):
    from dataclasses import replace
    return replace(plan, model=replace(plan.model, source=source))


if __name__ == "__main__":
    sys.exit(main())
