"""Replaying step times measured inside ranks into pytest-benchmark.

The multi-rank suites (bench_step, bench_hf_trainer, bench_lightning) time each step inside the
ranks, barrier to barrier; pytest-benchmark then replays those times through ``ReplayClock``, a
virtual timer that the benchmarked callable advances by one measured step, so its min/median/
IQR/max columns are the in-rank figures. ``show`` prints a suite's table past pytest's capture.
"""
from __future__ import annotations


class ReplayClock:
    """pytest-benchmark's timer: a virtual time the benchmarked callable advances by one in-rank step."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def show(request, text: str) -> None:
    """Print ``text`` even under pytest's output capture (the suite's table, with -s or without)."""
    capman = request.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled():
        print("\n" + text)
