"""Packing 1000 tensors of mixed sizes into one flat bucket: fused_zero.ops.pack_ against torch.

    python -m pytest bench/bench_pack.py --benchmark-only      # add -s -v for the table

The tensors: 1000 sizes drawn log-uniform from 64 to 1e5 elements and scaled to sum to
about 3e7 on CUDA (as a real grad bucket), or to about 3e5 on CPU. Each is placed at a
64-element aligned offset of the bucket (the layout fused_zero uses), except in the
"unaligned" variant, where they follow each other with no gap.

Variants, each for fp32 -> fp32 and bf16 -> fp32:
  fused_zero     ops.pack_ with a reused plan: on CUDA the Triton kernel (one launch per
                 bucket), on CPU its torch twin (the Triton interpreter cannot be timed);
                 every call checks each tensor's address, dtype, numel and contiguity
  fused_zero_checked  ops.pack_checked_, the optimizer's path: the same launch, only the
                 addresses read per call
  unaligned      the same as fused_zero with unaligned offsets (CUDA only: the kernel loses
                 128-bit access)
  torch.cat      torch.cat of the tensors into a new tensor (out= a new fp32 tensor)
  foreach_copy   torch._foreach_copy_ onto precomputed views of the bucket

Every variant moves the same bytes: each element read once (src dtype) and written once
(fp32). extra_info holds GB/s and % of the device's copy bandwidth (bench/_bandwidth.py),
and on CUDA host_us and device_ms per call, device_pct_of_copy and host_bound: where
host_us exceeds device_ms the figure measures the host (bench/pack_host.py takes the host
cost apart without a GPU); launches per call for the fused_zero variants.
"""
from __future__ import annotations

import math

import pytest
import torch
from _bandwidth import device, measure

from fused_zero import ops

N_TENSORS = 1000
ALIGN = 64
CUDA = torch.cuda.is_available()
TOTAL = 3 * 10**7 if CUDA else 3 * 10**5


def _sizes(total: int) -> list[int]:
    gen = torch.Generator().manual_seed(0)
    logs = torch.empty(N_TENSORS, dtype=torch.float64).uniform_(math.log(64), math.log(1e5), generator=gen)
    sizes = logs.exp()
    sizes = (sizes * (total / sizes.sum())).round().clamp(min=1).long()
    return sizes.tolist()


def _case(src_dtype: torch.dtype, aligned: bool):
    dev = device()
    sizes = _sizes(TOTAL)
    tensors = [torch.randn(n, device=dev).to(src_dtype) for n in sizes]
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += -(-n // ALIGN) * ALIGN if aligned else n
    bucket = torch.zeros(pos, device=dev)
    bytes_moved = sum(sizes) * (torch.empty((), dtype=src_dtype).element_size() + 4)
    return tensors, offsets, bucket, bytes_moved


def _sync():
    if CUDA:
        torch.cuda.synchronize()


IMPLS = ["fused_zero", "fused_zero_checked", "torch.cat", "foreach_copy"] + (["unaligned"] if CUDA else [])


def _launches(fn) -> int | None:
    """Kernel launches of one ``fn()`` (the Triton backend only: None elsewhere)."""
    if not CUDA:
        return None
    from fused_zero.kernels import pack as kpack

    real, count = kpack._launch, []
    kpack._launch = lambda *a, **k: count.append(1) or real(*a, **k)
    try:
        fn()
    finally:
        kpack._launch = real
    return len(count)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=["fp32-fp32", "bf16-fp32"])
@pytest.mark.parametrize("impl", IMPLS)
def test_pack(benchmark, impl, src_dtype):
    tensors, offsets, bucket, bytes_moved = _case(src_dtype, aligned=impl != "unaligned")
    extra = {}
    if impl in ("fused_zero", "unaligned"):
        plan = ops.pack_plan(tensors, offsets, bucket)

        def fn():
            ops.pack_(tensors, bucket, plan=plan)
        extra["launches"] = _launches(fn)
    elif impl == "fused_zero_checked":
        plan = ops.pack_plan(tensors, offsets, bucket)

        def fn():
            ops.pack_checked_(plan, tensors, bucket)
        extra["launches"] = _launches(fn)
    elif impl == "torch.cat":
        total = sum(t.numel() for t in tensors)

        def fn():
            return torch.cat(tensors, out=torch.empty(total, device=bucket.device))
    else:
        views = [bucket[o:o + t.numel()] for t, o in zip(tensors, offsets)]

        def fn():
            torch._foreach_copy_(views, tensors)

    fn()
    _sync()
    if impl != "torch.cat":  # every variant writes the same values
        for t, o in zip(tensors[:50], offsets):
            assert torch.equal(bucket[o:o + t.numel()], t.float())
    measure(benchmark, fn, bytes_moved=bytes_moved, rounds=5 if not CUDA else 20, impl=impl,
            n_tensors=N_TENSORS, numel=sum(t.numel() for t in tensors),
            backend="triton" if CUDA else "torch twin", **extra)
