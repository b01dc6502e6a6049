"""What the planner knows about a model: its parameters, counted without allocating them.

``--model MODULE:CALLABLE`` builds the model on the meta device (shapes and dtypes, no
memory) and keeps one ``ParamSpec`` per parameter, in ``model.parameters()`` order (a
tied parameter once), with the stage 3 unit that owns it (``fused_zero.sharding.units.plan_units``).
``--params N`` is one flat trainable parameter of N elements: the padded sizes are then
exact for one flat buffer, but the alignment of each real parameter (at most 63 elements
each) and the split into param groups, dtypes and units are unknown.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

import torch
from torch import nn

from fused_zero.sharding.units import plan_units

#: dtype names the planner accepts, and their torch dtypes (what ShardedOptimizer supports).
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NAMES = {v: k for k, v in DTYPES.items()}
#: dtypes a frozen parameter may also have (kept, never updated: a quantized base's integer weights, float64)
FROZEN_DTYPES = {"fp64": torch.float64, "u8": torch.uint8, "i8": torch.int8, "i16": torch.int16,
                 "i32": torch.int32, "i64": torch.int64, "bool": torch.bool}
FROZEN_NAMES = {v: k for k, v in FROZEN_DTYPES.items()}


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as the optimizer lays it out."""

    numel: int
    dtype: str  # a key of DTYPES (of FROZEN_DTYPES for a frozen parameter)
    trainable: bool
    unit: int  # the stage 3 unit that owns it (0: the root)


@dataclass(frozen=True)
class ModelCount:
    """The parameters of a model, and whether they are the real ones or one flat stand-in."""

    params: tuple[ParamSpec, ...]
    exact: bool  # True: per-parameter (from --model); False: one flat buffer (from --params)
    source: str  # "--params 7e9" or "MODULE:CALLABLE"

    def numel(self, trainable: bool | None = None, dtype: str | None = None) -> int:
        return sum(p.numel for p in self.params
                   if (trainable is None or p.trainable == trainable) and (dtype is None or p.dtype == dtype))

    def by_dtype(self) -> dict[str, dict[str, int]]:
        """{dtype: {"trainable": elements, "frozen": elements}}, dtypes in model order."""
        out: dict[str, dict[str, int]] = {}
        for p in self.params:
            entry = out.setdefault(p.dtype, {"trainable": 0, "frozen": 0})
            entry["trainable" if p.trainable else "frozen"] += p.numel
        return out


def dtype_name(value, what: str) -> str:
    """'bf16' for 'bf16', 'bfloat16' or torch.bfloat16; TypeError naming the choices otherwise."""
    if isinstance(value, torch.dtype) and value in NAMES:
        return NAMES[value]
    if isinstance(value, str):
        key = value.lower().replace("torch.", "")
        key = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}.get(key, key)
        if key in DTYPES:
            return key
    raise TypeError(f"{what} must be one of {', '.join(DTYPES)} (or the torch dtype), got {value!r}")


def flat_count(numel: int, dtype: str) -> ModelCount:
    """``--params``: one trainable flat parameter of ``numel`` elements."""
    shown = f"{numel:.4g}".replace("e+0", "e").replace("e+", "e")
    return ModelCount((ParamSpec(numel, dtype, True, 0),), exact=False, source=f"--params {shown}")


def count_module(model: nn.Module, source: str, dtype: str | None = None, units=None,
                 min_unit_numel: int = 0) -> ModelCount:
    """Every parameter of ``model`` with its unit (default units smaller than ``min_unit_numel`` merged, as
    the optimizer merges them); ``dtype`` plans them as if cast to it (the model is not touched)."""
    if not isinstance(model, nn.Module):
        raise TypeError("model must be a torch.nn.Module (best built on the meta device), "
                        f"got a {type(model).__name__}")
    plan = plan_units(model, units, min_unit_numel)
    unit_of = {p: ui for ui, ps in enumerate(plan.params) for p in ps}
    specs = []
    for name, p in model.named_parameters():
        if p.dtype not in NAMES and (p.requires_grad or p.dtype not in FROZEN_NAMES):
            raise TypeError(f"parameter {name} of {source} has dtype {p.dtype}; ShardedOptimizer supports "
                            "float32, bfloat16 and float16 parameters (pass --param-dtype to cast them; a frozen "
                            "one may also be float64 or an integer type)")
        if p.dtype in FROZEN_NAMES:  # frozen, kept as it is: never cast
            specs.append(ParamSpec(p.numel(), FROZEN_NAMES[p.dtype], False, unit_of[p]))
            continue
        specs.append(ParamSpec(p.numel(), dtype or NAMES[p.dtype], p.requires_grad, unit_of[p]))
    if not specs:
        raise ValueError(f"{source} has no parameters: there is nothing to plan")
    return ModelCount(tuple(specs), exact=True, source=source)


def load_model(spec: str, path: str | None = None) -> nn.Module:
    """Build ``MODULE:CALLABLE`` (no arguments) on the meta device; ValueError/TypeError on failure."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model takes MODULE:CALLABLE (e.g. mypkg.models:build_7b), got {spec!r}")
    if path is not None:
        sys.path.insert(0, path)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - the user's module: report, never trace back
        raise ValueError(f"could not import {module_name!r} for --model ({type(e).__name__}: {e}); "
                         "check the name, or add its folder with --model-path DIR") from e
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from --model {spec})")
    if not callable(fn):
        raise TypeError(f"--model {spec}: {attr} is a {type(fn).__name__}, not a callable returning a model")
    try:
        with torch.device("meta"):
            model = fn()
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"--model {spec}: calling {attr}() on the meta device raised {type(e).__name__}: {e}; "
                         "it must build the model with no arguments and without reading parameter data") from e
    if not isinstance(model, nn.Module):
        raise TypeError(f"--model {spec}: {attr}() returned a {type(model).__name__}, not a torch.nn.Module")
    return model
