"""Copy bandwidth of this device, the yardstick for memory-bound kernels.

Bandwidth counts bytes read plus bytes written. On CUDA it is timed with
triton.testing.do_bench (median); on CPU with a wall clock over repeats.

do_bench times each call between two events with only an L2 flush before it, so
a call whose host work outlasts the flush (a 256 MB ``zero_``) is timed partly on
the host. ``split_times`` tells the two apart: the host microseconds per call
(no synchronisation) and the device milliseconds per call, timed with the GPU
held by a sleep kernel until the host has queued every call. ``pct_of_copy``
stays do_bench's figure (what a caller sees); ``device_pct_of_copy`` is the
kernel's alone.
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


def split_times(fn, reps: int = 20) -> tuple[float, float | None]:
    """(host microseconds per call, device milliseconds per call; None on CPU), medians of ``reps``.

    Host: ``fn()`` timed without synchronising (on CPU it is the whole call). Device: a
    ``torch.cuda._sleep`` kernel holds the stream while the host queues ``reps`` calls between
    events, so the events time the device alone (back to back: L2 is not flushed between calls).
    """
    fn()
    host = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
    host.sort()
    host_us = host[reps // 2] * 1e6
    if not torch.cuda.is_available():
        return host_us, None
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda._sleep(int(_cycles_per_ms() * (2 * sum(host) * 1e3 + 1)))
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    device = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return host_us, device[reps // 2]


@functools.lru_cache(maxsize=None)
def _cycles_per_ms() -> float:
    """Clock cycles of ``torch.cuda._sleep`` per millisecond on this GPU."""
    torch.cuda._sleep(10**6)  # warm up
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(10**7)
    e.record()
    torch.cuda.synchronize()
    return 10**7 / s.elapsed_time(e)


@functools.lru_cache(maxsize=None)
def copy_gbps(numel: int = 1 << 26) -> float:
    """GB/s of a large fp32 device-to-device copy (read + write bytes)."""
    dev = device()
    src = torch.randn(numel, device=dev)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * numel * 4 / (ms * 1e-3) / 1e9


def record(benchmark, *, bytes_moved: int, ms: float, host_us: float | None = None,
           device_ms: float | None = None, **extra) -> None:
    """Put GB/s and % of copy bandwidth into pytest-benchmark's extra_info (and, where given,
    the host microseconds and device milliseconds per call with the device's % of copy)."""
    gbps = bytes_moved / (ms * 1e-3) / 1e9
    copy = copy_gbps()
    if host_us is not None:
        extra["host_us"] = round(host_us, 1)
    if device_ms is not None:
        extra["device_ms"] = device_ms
        extra["device_pct_of_copy"] = round(100 * bytes_moved / (device_ms * 1e-3) / 1e9 / copy, 1)
        extra["host_bound"] = host_us is not None and host_us * 1e-3 > device_ms
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
    (synchronised on CUDA), and record GB/s and % of copy bandwidth, with the host
    and device times per call (``split_times``)."""
    ms = time_ms(fn)
    host_us, device_ms = split_times(fn)

    def timed():
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    benchmark.pedantic(timed, rounds=rounds, iterations=1, warmup_rounds=1)
    record(benchmark, bytes_moved=bytes_moved, ms=ms, host_us=host_us, device_ms=device_ms, **extra)
