"""Public kernel entry points: validate arguments, then dispatch.

CUDA tensors run the Triton kernels in ``fused_zero.kernels``; CPU tensors run
the pure-torch twins in ``fused_zero.reference`` (see ``_dispatch``).
"""
from __future__ import annotations

from ._dispatch import backend_for  # noqa: F401  (used by every op below)

# --- adamw and norm ops (below) ---

# --- cast and pack ops (below) ---
