"""One rank: stages 2-3 pack each bucket's gradients straight into the gradient shard (``BucketPipe.direct``:
nothing to reduce, no pool buffer, no copy), without offload and, on a CPU-only run, with the states offloaded
(the host shard is where the gradients are). It must give bitwise what the pool path gives (pack into a pool
buffer, then the one-rank reduce-scatter's copy, added when a backward accumulates) and what torch AdamW gives,
for fp32 and bf16 parameters, buckets that split parameters, accumulation under ``no_sync()`` and by two
backwards, parameters without a gradient, and hold no pool. Neighbouring buckets pack in one launch
(``comm/direct_runs.py``): bitwise what a pack per bucket gives, with the launches and run sizes it promises.

One process, no process group."""
import copy

import pytest
import torch

from _models import HYPER, TinyNet, batch, flags, loss_fn, param_groups, rel
from fused_zero import ShardedOptimizer
from fused_zero.comm.grad_buckets import BucketPipe


def _train(model, opt, steps: int, mode: str) -> list:
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        k = 1 if mode == "plain" else 3
        for m in range(k):
            x, y = batch(step, 0, m, dtype=next(model.parameters()).dtype)
            ctx = opt.no_sync() if mode == "no_sync" and m < k - 1 else _Null()
            with ctx:
                loss = loss_fn(model(x, **flags(step, 0)), y) / k
                loss.backward()
            losses.append(float(loss.detach()))
        opt.step()
    return losses


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


MODES = ("plain", "no_sync", "two_backwards")
# (offload_optimizer, param dtype, mode): offloaded in fp32 (the pack is all the tier changes here)
CASES = [(None, dt, m) for dt in (torch.float32, torch.bfloat16) for m in MODES] + \
        [(o, torch.float32, m) for o in ("cpu", "nvme") for m in MODES]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("offload,dtype,mode", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_direct_pack_equals_the_pool_path_bitwise(stage, offload, dtype, mode, monkeypatch, tmp_path):
    base = TinyNet(seed=3).to(dtype)
    tier = {} if offload is None else {"offload_optimizer": offload, "offload_chunk_numel": 700,
                                       **({"nvme_path": str(tmp_path)} if offload == "nvme" else {})}
    runs = {}
    for direct in (True, False):
        if not direct:
            monkeypatch.setattr(BucketPipe, "direct", lambda self, part: False)
        model = copy.deepcopy(base)
        opt = ShardedOptimizer(model if stage == 3 else param_groups(model), **HYPER, stage=stage,
                               bucket_numel=1000, **({} if stage < 3 else {"min_unit_numel": 0}), **tier)
        losses = _train(model, opt, 4, mode)
        pool = opt.grad_sync.buffer_bytes()
        with opt.full_parameters() if stage == 3 else _Null():
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        runs[direct] = (losses, params, pool)
        opt.close()
    (l1, p1, pool1), (l0, p0, pool0) = runs[True], runs[False]
    assert pool1 == 0 < pool0  # the direct path never takes a pool buffer
    assert l1 == l0
    for name in p1:
        assert torch.equal(p1[name], p0[name]), name


@pytest.mark.parametrize("stage", [2, 3])
def test_direct_pack_trains_as_torch_adamw(stage):
    model = TinyNet(seed=5)
    ref = copy.deepcopy(model)
    opt = ShardedOptimizer(model if stage == 3 else model.parameters(), **HYPER, stage=stage, bucket_numel=1000)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER, foreach=False)
    _train(model, opt, 5, "no_sync")
    _train(ref, ref_opt, 5, "plain_k3")
    with opt.full_parameters() if stage == 3 else _Null():
        refs = dict(ref.named_parameters())
        assert max(rel(p, refs[n]) for n, p in model.named_parameters()) < 1e-6


def _count_packs(monkeypatch) -> list:
    """Every ``ops.pack_checked_`` call the gradient buckets make, as the number of tensors it packs."""
    from fused_zero import ops
    calls, real = [], ops.pack_checked_

    def counting(plan, tensors, bucket, **kw):
        calls.append(len(tensors))
        return real(plan, tensors, bucket, **kw)
    monkeypatch.setattr(ops, "pack_checked_", counting)
    return calls


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", MODES)
def test_direct_runs_equal_one_pack_per_bucket_bitwise(stage, dtype, mode, monkeypatch):
    """One rank packs buckets in runs (comm/direct_runs.py): fewer launches, the same shards bit for bit as a pack per
    bucket, over steps where some parameters get no gradient (their bucket waits for the end of backward), buckets
    that split parameters, and backwards that add to the shard."""
    from fused_zero.comm import grad_sync
    base = TinyNet(seed=4).to(dtype)
    runs, packs = {}, {}
    for together in (True, False):
        if not together:
            monkeypatch.setattr(grad_sync, "direct_runs", lambda buckets, pipe, bounded: {})
        calls = _count_packs(monkeypatch)
        model = copy.deepcopy(base)
        opt = ShardedOptimizer(model if stage == 3 else param_groups(model), **HYPER, stage=stage,
                               bucket_numel=1000, **({} if stage < 3 else {"min_unit_numel": 0}))
        losses = _train(model, opt, 4, mode)
        packs[together] = len(calls)
        with opt.full_parameters() if stage == 3 else _Null():
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        runs[together] = (losses, params, opt.grad_sync.direct_runs())
        opt.close()
    (l1, p1, made), (l0, p0, _) = runs[True], runs[False]
    assert l1 == l0
    for name in p1:
        assert torch.equal(p1[name], p0[name]), name
    saved = sum(len(r.buckets) - 1 for r in made.values())
    assert saved > 0
    assert packs[True] < packs[False]


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype,reduce_dtype,per_run", [(torch.float32, None, 2), (torch.bfloat16, None, 2),
                                                        (torch.bfloat16, torch.float32, 4)],
                         ids=["fp32", "bf16", "bf16-reduce-fp32"])
def test_direct_runs_launches_and_bound(stage, dtype, reduce_dtype, per_run, monkeypatch):
    """Launches per step: one per partition at stage 1 (``.grad`` is kept until the step anyway); at stage 2 one per
    run of at most the pool's bytes (MAX_INFLIGHT buckets in the reduce dtype: 2 buckets of fp32 or bf16 gradients
    reduced in their own dtype, 4 of bf16 reduced in fp32), every bucket of equal size here."""
    import torch.nn as nn
    model = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(12)]).to(dtype)  # 1024 elements each
    opt = ShardedOptimizer(model.parameters(), lr=1e-3, stage=stage, bucket_numel=1024, reduce_dtype=reduce_dtype)
    calls = _count_packs(monkeypatch)
    x = torch.randn(4, 32, dtype=dtype)
    for _ in range(3):
        calls.clear()
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        if stage == 1:
            assert calls == [12]
        else:
            assert calls == [per_run] * (12 // per_run)
    runs = opt.grad_sync.direct_runs()
    assert [len(r.buckets) for r in runs.values()] == ([12] if stage == 1 else [per_run] * (12 // per_run))
    opt.close()
