"""One rank: stages 2-3 pack each bucket's gradients straight into the gradient shard (``BucketPipe.direct``:
nothing to reduce, no pool buffer, no copy), without offload and, on a CPU-only run, with the states offloaded
(the host shard is where the gradients are). It must give bitwise what the pool path gives (pack into a pool
buffer, then the one-rank reduce-scatter's copy, added when a backward accumulates) and what torch AdamW gives,
for fp32 and bf16 parameters, buckets that split parameters, accumulation under ``no_sync()`` and by two
backwards, parameters without a gradient, and hold no pool.

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
