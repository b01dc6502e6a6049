"""Copy bandwidth of this device, the yardstick for memory-bound kernels.

Bandwidth counts bytes read plus bytes written. On CUDA it is timed with
triton.testing.do_bench (median); on CPU with a wall clock over repeats.
"""
from __future__ import annotations

import functools
import time

import torch


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def time_ms(fn, *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of ``fn()``."""
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < 5 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3


@functools.lru_cache(maxsize=None)
def copy_gbps(numel: int = 1 << 26) -> float:
    """GB/s of a large fp32 device-to-device copy (read + write bytes)."""
    dev = device()
    src = torch.randn(numel, device=dev)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * numel * 4 / (ms * 1e-3) / 1e9


def record(benchmark, *, bytes_moved: int, ms: float, **extra) -> None:
    """Put GB/s and % of copy bandwidth into pytest-benchmark's extra_info."""
    gbps = bytes_moved / (ms * 1e-3) / 1e9
    copy = copy_gbps()
    benchmark.extra_info.update(
        device=device_name(),
        bytes_moved=bytes_moved,
        median_ms=ms,
        gbps=round(gbps, 2),
        copy_gbps=round(copy, 2),
        pct_of_copy=round(100 * gbps / copy, 1),
        **extra,
    )


def measure(benchmark, fn, *, bytes_moved: int, rounds: int, **extra) -> None:
    """Time ``fn`` (median, see time_ms), let pytest-benchmark time it too
    (synchronised on CUDA), and record GB/s and % of copy bandwidth."""
    ms = time_ms(fn)

    def timed():
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    benchmark.pedantic(timed, rounds=rounds, iterations=1, warmup_rounds=1)
    record(benchmark, bytes_moved=bytes_moved, ms=ms, **extra)
