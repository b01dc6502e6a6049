"""Squared grad norm + non-finite flag: fused_zero.ops.norm_stats vs torch.

    python -m pytest bench/bench_norm.py --benchmark-only      # add -s -v for the table

Sizes: 1e6, 1e7, 1e8 elements on CUDA; 1e5, 1e6 on CPU; fp32 and bf16 input.
Variants:
  norm_stats   one pass, deterministic two-stage reduction (on CUDA the Triton kernels;
               on CPU the torch twin: the Triton interpreter cannot be timed)
  torch        torch.linalg.vector_norm(x, dtype=fp32) ** 2 and torch.isfinite(x).all():
               two passes over x
extra_info: bytes that must move (one read of x), GB/s and % of the device's measured copy
bandwidth (bench/_bandwidth.py).
"""
from __future__ import annotations

import pytest
import torch
from _bandwidth import device, measure

from fused_zero import ops

CUDA = torch.cuda.is_available()
SIZES = [10**6, 10**7, 10**8] if CUDA else [10**5, 10**6]


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"{n:.0e}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["norm_stats", "torch"])
def test_norm(benchmark, variant, dtype, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device(), dtype)
    out = ops.NormStats(torch.empty((), device=x.device), torch.empty((), device=x.device))
    if variant == "norm_stats":
        def fn():
            ops.norm_stats(x, out=out)
    else:
        def fn():
            sq = torch.linalg.vector_norm(x, dtype=torch.float32) ** 2
            bad = ~torch.isfinite(x).all()
            return sq, bad

    fn()
    if variant == "norm_stats":
        exact = torch.linalg.vector_norm(x.double()) ** 2
        assert abs(out.sq_sum.double().item() / exact.item() - 1) < 1e-5
        assert out.nonfinite.item() == 0.0
    measure(benchmark, fn, bytes_moved=n * x.element_size(), rounds=20 if CUDA else 10, variant=variant, numel=n,
           dtype=str(dtype), backend=("triton" if CUDA else "torch twin")
           if variant == "norm_stats" else "torch")
