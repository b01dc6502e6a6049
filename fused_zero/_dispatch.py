"""Which implementation runs a kernel: Triton or its pure-torch twin.

CUDA tensors use the Triton kernels and CPU tensors the twins (or, for
adamw_, torch's own fused CPU AdamW: see ``native.py``), unless
``FUSED_ZERO_BACKEND`` is ``triton`` or ``torch`` (the twin). Under
``TRITON_INTERPRET=1`` the Triton kernels run on CPU tensors: that is how the
tests exercise them on machines without a GPU.
"""
from __future__ import annotations

import os

import torch

_BACKENDS = ("triton", "torch")


def backend_for(device: torch.device) -> str:
    """'triton' or 'torch' for tensors on ``device``."""
    forced = os.environ.get("FUSED_ZERO_BACKEND", "").strip().lower()
    if forced:
        if forced not in _BACKENDS:
            raise ValueError(
                f"FUSED_ZERO_BACKEND must be 'triton' or 'torch', got {forced!r}"
            )
        if forced == "triton" and device.type != "cuda" and not interpreting():
            raise RuntimeError(
                "FUSED_ZERO_BACKEND=triton needs CUDA tensors, or TRITON_INTERPRET=1 "
                "(set before triton is imported) to run Triton on CPU tensors"
            )
        return forced
    return "triton" if device.type == "cuda" else "torch"


def forced() -> bool:
    """Whether FUSED_ZERO_BACKEND picks the implementation (then CPU runs the twin)."""
    return bool(os.environ.get("FUSED_ZERO_BACKEND", "").strip())


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
