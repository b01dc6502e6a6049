"""The host update of offload_optimizer="cpu" for bf16 parameters, per million elements of the shard: what
the host does per chunk on a GPU run, timed on CPU.

    python -m pytest bench/bench_host_update.py --benchmark-only

- ``rounded_on_host``: fused_zero.ops.adamw_ with ``param_out`` (the bf16 params written by the host in a
  separate rounding pass, then copied up): the path before the master went up as it is;
- ``master_only``: the same update without ``param_out`` (the fp32 master chunk goes up page-locked and the
  GPU rounds it);
- ``master_only_unchecked``: that through ``ops.adamw_checked_``, what the optimizer runs per chunk now (the
  hyperparameters checked once per partition and step, the buffers when they were built);
- ``fp32_copy``: copying 1M fp32 elements (8 bytes each, read and write), the machine's yardstick.

Each update reads a bf16 gradient (widened to fp32 first: torch's fused CPU AdamW reads fp32) and the
three fp32 states and writes the states back; the host is memory-bound, so passes over memory are the cost.
64 chunks of 1M elements (the default offload_chunk_numel), round-robin so that no chunk stays in cache;
pytest-benchmark alternates nothing by itself, so read the ratio from one run.
"""
from __future__ import annotations

import pytest
import torch

from fused_zero import ops

N, CHUNKS = 1 << 20, 64


@pytest.fixture(scope="module")
def shard():
    g = torch.Generator().manual_seed(0)
    return dict(p=[torch.randn(N, generator=g) for _ in range(CHUNKS)],
                m=[torch.zeros(N) for _ in range(CHUNKS)], v=[torch.zeros(N) for _ in range(CHUNKS)],
                g=[torch.randn(N, generator=g).bfloat16() for _ in range(CHUNKS)],
                out=[torch.empty(N, dtype=torch.bfloat16) for _ in range(CHUNKS)],
                copy=[torch.empty(N) for _ in range(CHUNKS)])


@pytest.mark.parametrize("variant", ["rounded_on_host", "master_only", "master_only_unchecked", "fp32_copy"])
def test_host_update_per_million(benchmark, shard, variant):
    s, state = shard, {"i": 0}

    def one():
        i = state["i"] = (state["i"] + 1) % CHUNKS
        if variant == "fp32_copy":
            s["copy"][i].copy_(s["p"][i])
            return
        update = ops.adamw_checked_ if variant == "master_only_unchecked" else ops.adamw_
        update(s["p"][i], s["g"][i], s["m"][i], s["v"][i], step=3, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
               weight_decay=0.01, param_out=s["out"][i] if variant == "rounded_on_host" else None)
    for _ in range(CHUNKS):  # every chunk touched once before timing
        one()
    benchmark.pedantic(one, rounds=5 * CHUNKS, iterations=1, warmup_rounds=CHUNKS)
    benchmark.extra_info.update(variant=variant, numel=N, threads=torch.get_num_threads())
