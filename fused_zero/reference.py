"""Pure-torch twins of every Triton kernel: the CPU path and the test oracle.

Each twin computes the same function as its kernel, in the same order of
operations, with torch ops only.
"""
from __future__ import annotations

import torch  # noqa: F401

# --- adamw and norm twins (below) ---

# --- cast and pack twins (below) ---
