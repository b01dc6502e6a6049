"""What the host-cost scripts share (bench/pack_host.py, bench/quant_host.py): a stand-in for a Triton kernel
that launches nothing, and the median of a call's wall time."""
from __future__ import annotations

import time


class LaunchStub:
    """Stands in for a kernel: records each launch's grid, launches nothing."""

    def __init__(self):
        self.grids = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.grids.append(grid)


def median_us(fn, rounds: int) -> float:
    """The median wall time of ``fn()`` over ``rounds`` calls after one warm-up, in microseconds."""
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6
