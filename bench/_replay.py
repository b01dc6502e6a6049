"""Replaying step times measured inside ranks into pytest-benchmark.

The multi-rank suites (bench_step, bench_hf_trainer, bench_lightning) time each step inside the
ranks, barrier to barrier; pytest-benchmark then replays those times through ``ReplayClock``, a
virtual timer that the benchmarked callable advances by one measured step, so its min/median/
IQR/max columns are the in-rank figures. ``summarize`` adds each variant's quartiles and its ratio
to the baseline of the same run; ``show`` prints a suite's table past pytest's capture.
"""
from __future__ import annotations

import statistics


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


def summarize(result: dict, baseline: str, ratio_key: str) -> None:
    """Add min/q1/median/q3/max (s) and ``ratio_key`` (median over the baseline's median) to every
    variant of ``result`` that has ``times`` (skipped variants have none)."""
    base = statistics.median(result[baseline]["times"])
    for res in result.values():
        if "times" in res:
            ts = sorted(res["times"])
            q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
            res.update(min_s=ts[0], q1_s=q[0], median_s=q[1], q3_s=q[2], max_s=ts[-1], **{ratio_key: q[1] / base})
