"""Host cost of one codec call at bench_quant's sizes, measurable without a GPU.

    python bench/quant_host.py [rounds]

2**26 elements in 8 chunks, block 256 (bench_quant.py's cases), CPU tensors, the triton backend
selected (TRITON_INTERPRET=1, set here) and the kernels' launch stubbed out (``_quantize_kernel``
and ``_dequantize_kernel`` replaced): what is timed is everything ``ops.quantize_`` /
``ops.dequantize_`` do on the host up to the launch (checks, geometry, views, backend dispatch,
the launch wrapper). Triton's own launch cost (its argument binding and the driver call) is not
in it. Each figure is the median of ``rounds`` (default 2000) calls, with the launches per call.
The device time it compares with: the case's bytes at the H200's measured copy bandwidth.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["FUSED_ZERO_BACKEND"] = "triton"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _host_cost import LaunchStub, median_us  # noqa: E402

from fused_zero import ops  # noqa: E402
from fused_zero.kernels import quant as kquant  # noqa: E402

NUMEL, CHUNKS, BLOCK = 2**26, 8, 256
H200_COPY_GBPS = 4152.78  # bench/results/h200_2026-11-26_bench_quant.json


def main(rounds: int = 2000) -> None:
    stubs = [LaunchStub(), LaunchStub()]
    kquant._quantize_kernel, kquant._dequantize_kernel = stubs
    n = NUMEL // CHUNKS
    print(f"{NUMEL} elements, {CHUNKS} chunks, block {BLOCK}; host microseconds per call (median of {rounds}),"
          " kernel launch stubbed")
    for bits in (8, 4):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.empty(NUMEL, dtype=dtype)
            payload = torch.empty(CHUNKS * ops.payload_bytes(n, bits, BLOCK), dtype=torch.uint8)
            out, part = torch.empty_like(x), torch.empty(n, dtype=dtype)
            cases = {
                "quantize": (lambda: ops.quantize_(x, payload, bits=bits, block=BLOCK, chunks=CHUNKS),
                             x.nbytes + payload.numel()),
                "dequantize": (lambda: ops.dequantize_(payload, out, bits=bits, block=BLOCK, chunks=CHUNKS),
                               x.nbytes + payload.numel()),
                "sum8": (lambda: ops.dequantize_(payload, part, bits=bits, block=BLOCK, chunks=CHUNKS,
                                                 sum_chunks=True), part.nbytes + payload.numel()),
            }
            for mode, (fn, moved) in cases.items():
                us = median_us(fn, rounds)
                for s in stubs:
                    s.grids.clear()
                fn()
                device_us = moved / (H200_COPY_GBPS * 1e3)
                print(f"  int{bits} {str(dtype)[6:]:9s} {mode:10s} host {us:6.1f} us   device at H200 copy "
                      f"{device_us:6.1f} us   launches {sum(len(s.grids) for s in stubs)}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
