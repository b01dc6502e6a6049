"""Which implementation runs an op: a small registry of backends per op.

Every op registers up to three implementations with one signature:

- ``triton``: the launcher in ``fused_zero.kernels.<module>``, imported on its
  first call (``kernels``, the only import of the Triton kernels). CPU-only
  users, who may have no triton at all, never import it.
- ``native``: a torch built-in doing the same work faster on CPU (adamw_:
  torch's fused CPU AdamW).
- ``torch``: the pure-torch twin, the CPU path and the test oracle.

Selection (``select``): CUDA tensors run ``triton``; CPU tensors run
``native`` where the op has one, else ``torch``; other devices ``torch``.
``FUSED_ZERO_BACKEND=triton|torch`` forces one for every device; under
``TRITON_INTERPRET=1`` (set before triton is imported) Triton runs on CPU
tensors: that is how the tests exercise the kernels without a GPU.
"""
from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType

import torch

BACKENDS = ("triton", "native", "torch")
_FORCEABLE = ("triton", "torch")
_REGISTRY: dict[str, dict[str, Callable]] = {}


def register(op: str, **impls: Callable) -> None:
    """Register ``op``'s implementations by backend name (``triton=``, ``native=``, ``torch=``)."""
    unknown = set(impls) - set(BACKENDS)
    if unknown:
        raise ValueError(f"unknown backends {sorted(unknown)} for {op!r}; known: {BACKENDS}")
    if "triton" not in impls or "torch" not in impls:
        raise ValueError(f"{op!r} needs a triton and a torch implementation")
    _REGISTRY[op] = dict(impls)


def registered(op: str) -> tuple[str, ...]:
    """The backends ``op`` has, in ``BACKENDS`` order."""
    return tuple(b for b in BACKENDS if b in _REGISTRY[op])


def forced() -> str:
    """The backend FUSED_ZERO_BACKEND names ('' when unset); ValueError for other values."""
    name = os.environ.get("FUSED_ZERO_BACKEND", "").strip().lower()
    if name and name not in _FORCEABLE:
        raise ValueError(f"FUSED_ZERO_BACKEND must be 'triton' or 'torch', got {name!r}")
    return name


def interpreting() -> bool:
    """Whether Triton runs under its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def select(op: str, device: torch.device) -> str:
    """The backend that runs ``op`` on tensors on ``device``."""
    name = forced()
    if name == "triton" and device.type != "cuda" and not interpreting():
        raise RuntimeError(
            "FUSED_ZERO_BACKEND=triton needs CUDA tensors, or TRITON_INTERPRET=1 "
            "(set before triton is imported) to run Triton on CPU tensors"
        )
    if name:
        return name
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu" and "native" in _REGISTRY[op]:
        return "native"
    return "torch"


def implementation(op: str, device: torch.device) -> Callable:
    """The callable that runs ``op`` on tensors on ``device`` (see ``select``)."""
    return _REGISTRY[op][select(op, device)]


def kernels(module: str) -> ModuleType:
    """``fused_zero.kernels.<module>``, imported (with triton) on first use only."""
    return importlib.import_module(f"fused_zero.kernels.{module}")


def kernel(module: str, name: str) -> Callable:
    """A stand-in for the launcher ``fused_zero.kernels.<module>.<name>`` that imports
    it when first called, so registering it imports nothing."""

    def launch(*args, **kwargs):
        return getattr(kernels(module), name)(*args, **kwargs)

    launch.__name__ = launch.__qualname__ = f"kernels.{module}.{name}"
    return launch
