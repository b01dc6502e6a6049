"""fp32 -> bf16 / fp16 casting: fused_zero.ops.cast_ against dst.copy_(src).

    python -m pytest bench/bench_cast.py --benchmark-only      # add -s -v for the table

Sizes: 2**28 elements on CUDA (1 GiB of fp32 read, 0.5 GiB written), 2**20 on CPU.
Variants: torch copy_ (round to nearest even), fused_zero cast_ (on CUDA the Triton kernel,
on CPU its torch twin: the Triton interpreter cannot be timed) and cast_ with stochastic
rounding (bf16). Bytes moved: 4 read + 2 written per element. extra_info holds GB/s and %
of the device's fp32 copy bandwidth (bench/_bandwidth.py).
"""
from __future__ import annotations

import pytest
import torch
from _bandwidth import device, measure

from fused_zero import ops

CUDA = torch.cuda.is_available()
NUMEL = 2**28 if CUDA else 2**20

CASES = [("copy_", torch.bfloat16), ("cast_", torch.bfloat16), ("cast_stochastic", torch.bfloat16),
         ("copy_", torch.float16), ("cast_", torch.float16)]


@pytest.mark.parametrize("impl,dtype", CASES, ids=[f"{i}-{str(d)[6:]}" for i, d in CASES])
def test_cast(benchmark, impl, dtype):
    src = torch.randn(NUMEL, device=device())
    dst = torch.empty(NUMEL, dtype=dtype, device=src.device)
    if impl == "copy_":
        def fn():
            dst.copy_(src)
    elif impl == "cast_":
        def fn():
            ops.cast_(src, dst)
    else:
        def fn():
            ops.cast_(src, dst, stochastic=True, seed=1)

    fn()
    if impl == "cast_":
        assert torch.equal(dst, src.to(dtype))
    measure(benchmark, fn, bytes_moved=NUMEL * (4 + dst.element_size()), rounds=20 if CUDA else 10, impl=impl,
           dtype=str(dtype), numel=NUMEL, backend="triton" if CUDA else "torch twin")
