"""Replaying step times measured inside ranks into pytest-benchmark.

The multi-rank suites (bench_step, bench_hf_trainer, bench_lightning) time each step inside the
ranks, barrier to barrier; pytest-benchmark then replays those times through ``ReplayClock``, a
virtual timer that the benchmarked callable advances by one measured step, so its min/median/
IQR/max columns are the in-rank figures. ``summarize`` adds each variant's quartiles and its ratio
to the baseline of the same run; ``show`` prints a suite's table past pytest's capture.

The suites share the rest of that path too: ``spawn`` starts the ranks on a free local port and
returns what rank 0 wrote with ``finish``; ``replay`` feeds one variant's times to pytest-benchmark
with its figures as extra_info; ``same_model`` checks that a variant trained the baseline's model.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp


class ReplayClock:
    """pytest-benchmark's timer: a virtual time the benchmarked callable advances by one in-rank step."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def replay(benchmark, clock: ReplayClock, res: dict, keys=None, **info) -> None:
    """Replay ``res["times"]`` through ``clock`` (the benchmark's timer), one measured step a round; extra_info
    takes ``res``'s figures named in ``keys`` (default: all but the times), the times and ``info``."""
    times = iter(res["times"])
    benchmark.pedantic(lambda: clock.advance(next(times)), rounds=len(res["times"]), iterations=1)
    figures = {k: v for k, v in res.items() if k != "times"} if keys is None else {k: res[k] for k in keys}
    benchmark.extra_info.update(figures, step_times_s=res["times"], **info)


def same_model(result: dict, baseline: str, name: str, rtol: float = 1e-3) -> None:
    """Variant ``name`` ends at the baseline's final loss, within ``rtol``: it trains the same model."""
    base = result[baseline]["final_loss"]
    assert abs(result[name]["final_loss"] - base) <= rtol * abs(base), "variant trains a different model"


def spawn(worker, args: tuple, nprocs: int) -> dict:
    """Run ``worker(rank, port, *args, out)`` in ``nprocs`` spawned ranks, ``port`` a free local one for the
    process group; return the JSON rank 0 wrote to the file ``out`` (see ``finish``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(port, *args, out), nprocs=nprocs)
        with open(out) as f:
            return json.load(f)


def finish(rank: int, result, out: str) -> None:
    """The end of a spawned rank: rank 0 writes ``result`` to ``out`` for ``spawn``; every rank leaves the group."""
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def shown(request, result: dict, table) -> dict:
    """``result``, after showing ``table(result)`` (a suite's fixture: run once, print the table, hand it on)."""
    show(request, table(result))
    return result


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
