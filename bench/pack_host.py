"""Host cost of one pack call at bench_pack's CUDA case, measurable without a GPU.

    TRITON_INTERPRET=1 python bench/pack_host.py [rounds]

1000 tensors, 3e7 elements (fp32 or bf16) on CPU tensors, an fp32 bucket, a reused plan,
the triton backend selected and its kernel launch stubbed out (``_pack_kernel`` replaced):
what is timed is everything a call does on the host up to the launch, which on a GPU runs
before (and, once longer than the kernel, instead of) the copy. Triton's own launch cost is
not in it. Variants: ``pack_`` (every call checks what pack_plan checked) and
``pack_checked_`` (the optimizer's path), each with the same tensors every call and with
two tensor lists at different addresses taken in turn (new .grad tensors every step).
Each figure is the median of ``rounds`` (default 300) calls; launches are per call.
The device time it compares with: 3e7 elements at the H200's measured copy bandwidth.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["FUSED_ZERO_BACKEND"] = "triton"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _host_cost import LaunchStub, median_us  # noqa: E402
from bench_pack import ALIGN, _sizes  # noqa: E402

from fused_zero import ops  # noqa: E402
from fused_zero.kernels import pack as kpack  # noqa: E402

TOTAL = 3 * 10**7
H200_COPY_GBPS = 4117.11  # bench/results/h200_2026-11-26_bench.json


def main(rounds: int = 300) -> None:
    stub = kpack._pack_kernel = LaunchStub()
    sizes = _sizes(TOTAL)
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += -(-n // ALIGN) * ALIGN
    bucket = torch.zeros(pos)
    print(f"{len(sizes)} tensors, {sum(sizes)} elements, fp32 bucket; host microseconds per call (median of {rounds})")
    for dtype in (torch.float32, torch.bfloat16):
        lists = [[torch.randn(n).to(dtype) for n in sizes] for _ in range(2)]
        tensors = lists[0]
        plan = ops.pack_plan(tensors, offsets, bucket)
        turn = [0]

        def alternate(call):
            def fn():
                turn[0] ^= 1
                call(lists[turn[0]])
            return fn

        calls = {
            "pack_ same tensors": lambda: ops.pack_(tensors, bucket, plan=plan),
            "pack_checked_ same tensors": lambda: ops.pack_checked_(plan, tensors, bucket),
            "pack_checked_ new addresses": alternate(lambda ts: ops.pack_checked_(plan, ts, bucket)),
            "pack_ new addresses": alternate(lambda ts: ops.pack_(ts, bucket, plan=plan)),
        }
        device_us = TOTAL * (dtype.itemsize + 4) / (H200_COPY_GBPS * 1e3)
        print(f"{dtype} -> fp32 (device time at H200 copy bandwidth: {device_us:.1f} us)")
        for name, fn in calls.items():
            us = median_us(fn, rounds if "new" not in name else max(20, rounds // 5))
            stub.grids.clear()
            fn()
            print(f"  {name:30s} {us:8.1f} us   launches {len(stub.grids)}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
