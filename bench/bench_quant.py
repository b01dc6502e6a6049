"""Block-wise int8 / int4 quantize and dequantize (the communication codecs): fused_zero.ops.quantize_ /
dequantize_ on CUDA, in GB/s and % of the device's copy bandwidth (skipped without CUDA: the Triton
interpreter cannot be timed, and the torch twins are the oracle, not a fast path).

    python -m pytest bench/bench_quant.py --benchmark-only      # add -s -v for the table

Size: a 2**26-element bucket cut into 8 chunks (one per peer of an all-to-all), block size 256; the sum of 8
("sum8") at 2**29 elements (an output of 2**26): at 2**26 it moves ~half the bytes of dequantize (12-24 us
at copy bandwidth, 26-37 us measured) and was host-bound (33-54 us of host time a call, H200 2026-11-26), so
its percentages measured the launch as much as the kernel; at 2**29 its device time (~100-200 us) dominates.
Bytes moved count what each kernel must touch: quantize reads the input (4 bytes fp32, 2 bf16) and
writes the payload; dequantize reads the payload and writes the output; the all-to-all's reduction
("sum8") reads 8 payloads and writes one chunk. The issue's bar: 80% of copy bandwidth or more.

Each case records (extra_info, and one line printed with -s): ``pct_of_copy`` (do_bench's median, each call
after a 256 MB L2 flush: host work shorter than the flush is hidden, longer shows as device time),
``device_pct_of_copy`` (the kernel alone: calls queued behind a sleep kernel, back to back), ``host_us``
(one call's host time, Triton's launch included) and ``host_bound`` (host_us above the device time: the
call cannot go faster than the host issues it, whatever the kernel). bench/quant_host.py measures the host
part before the launch without a GPU.
"""
from __future__ import annotations

import pytest
import torch
from _bandwidth import measure

from fused_zero import ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (kernels are timed on a GPU)")

NUMEL = 2**26
SUM8_NUMEL = 2**29  # (the docstring says why)
CHUNKS = 8
BLOCK = 256
CASES = [(bits, dtype, mode) for bits in (8, 4) for dtype in (torch.float32, torch.bfloat16)
         for mode in ("quantize", "dequantize", "sum8")]


@pytest.mark.parametrize("bits,dtype,mode", CASES, ids=[f"int{b}-{str(d)[6:]}-{m}" for b, d, m in CASES])
def test_quant(benchmark, bits, dtype, mode):
    numel = SUM8_NUMEL if mode == "sum8" else NUMEL
    x = torch.randn(numel, device="cuda").to(dtype)
    n = numel // CHUNKS
    payload = torch.empty(CHUNKS * ops.payload_bytes(n, bits, BLOCK), dtype=torch.uint8, device="cuda")
    ops.quantize_(x, payload, bits=bits, block=BLOCK, chunks=CHUNKS)
    width = x.element_size()
    if mode == "quantize":
        def fn():
            ops.quantize_(x, payload, bits=bits, block=BLOCK, chunks=CHUNKS)
        moved = numel * width + payload.numel()
    elif mode == "dequantize":
        out = torch.empty_like(x)

        def fn():
            ops.dequantize_(payload, out, bits=bits, block=BLOCK, chunks=CHUNKS)
        moved = payload.numel() + numel * width
    else:
        out = torch.empty(n, dtype=dtype, device="cuda")

        def fn():
            ops.dequantize_(payload, out, bits=bits, block=BLOCK, chunks=CHUNKS, sum_chunks=True)
        moved = payload.numel() + n * width
    measure(benchmark, fn, bytes_moved=moved, rounds=20, bits=bits, dtype=str(dtype), mode=mode, numel=numel,
            block=BLOCK, chunks=CHUNKS)
    info = benchmark.extra_info
    print(f"\nint{bits} {str(dtype)[6:]} {mode}: do_bench {info['pct_of_copy']}% of copy, device "
          f"{info.get('device_pct_of_copy')}% ({info.get('device_ms')} ms), host {info.get('host_us')} us, "
          f"host_bound {info.get('host_bound')}")
