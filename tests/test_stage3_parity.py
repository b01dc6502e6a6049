"""ZeRO stage 3 against DDP + torch.optim.AdamW on gloo ranks, over 20 steps.

Models: the example GPT with tied embeddings (units: its blocks; the tied embedding and
head stay in the root unit), TinyNet (every child a unit, three param groups, a branch
unused on every rank on even steps, a unit skipped by rank 1 every third step, a frozen
unit) and BNNet (BatchNorm running statistics as module buffers). Each spawn runs the
DDP reference and the sharded model in lockstep; the rank functions measure, the tests
assert.
"""
import copy
import os
import sys

import pytest
import torch

from _dist import run_ranks
from _models import (HYPER, BNNet, TinyNet, batch, ddp_reference, flags, grad_shard_error, grads_of, loss_fn,
                     param_groups, rel)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

STEPS = 12  # two whole cycles of flags(): every combination of unused branches, twice
TOL = 1e-5
GPT_CFG = GPTConfig(vocab=96, d_model=32, n_layer=3, n_head=2, seq_len=16)


#: one stage-3 unit per module (no merging of small units): these tests watch each unit's gathers
PER_MODULE = dict(min_unit_numel=0)


def _build(name: str):
    """(model, ShardedOptimizer kwargs, reference-groups flag)."""
    if name == "gpt":
        return GPT(GPT_CFG, seed=0), dict(bucket_numel=2000), False
    if name == "tiny":
        return TinyNet(), dict(bucket_numel=1000), True
    return BNNet(), dict(bucket_numel=1500), False


def _loss(name, model, step, rank):
    if name == "gpt":
        idx, tgt = synthetic_batch(GPT_CFG, 4, step=step, rank=rank)
        return model(idx, tgt)[1]
    x, y = batch(step, rank)
    return loss_fn(model(x, **flags(step, rank)), y)


def _comparable(name: str, p: torch.Tensor) -> torch.Tensor:
    """The parameter, without the GPT's key bias: its gradient is exactly zero in exact
    arithmetic (softmax is shift invariant), so the computed one is rounding noise that Adam
    scales up to ±lr per step, in DDP as anywhere else."""
    p = p.detach().clone()
    if name.endswith("attn.qkv.bias"):
        d = p.numel() // 3
        p[d:2 * d] = 0
    return p


def _run(rank, world_size, name, options):
    from fused_zero import ShardedOptimizer

    model, kwargs, groups = _build(name)
    kwargs.update(options)
    ref, ref_opt = ddp_reference(model, groups=groups)
    params = param_groups(model) if groups else model
    opt = ShardedOptimizer(params, **HYPER, stage=3, module=model, **kwargs, **PER_MODULE)
    # TinyNet's frozen unit, and units a rank's backward skips, stay gathered until the end of
    # backward (no gradient tells when their backward is over): the bound adds them.
    skipped = (model.frozen, model.branch, model.side) if name == "tiny" else ()
    extra = sum(u.nbytes for u in opt._stage.gatherer.units if u.modules[0] in skipped)
    out = {"loss": 0.0, "gathered_after_step": 0, "peak": 0, "pool": opt._stage.gatherer.pool_bytes() + extra,
           "units": len(opt._stage.gatherer.units)}
    for step in range(STEPS):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = _loss(name, model, step, rank)
        loss.backward()
        ref_loss = _loss(name, ref, step, rank)
        ref_loss.backward()
        out["peak"] = max(out["peak"], opt._stage.gatherer.peak_bytes)
        opt.step()  # reads the gradient shards, leaves them as they are
        if step == STEPS - 1:
            with opt.full_parameters():  # flat_full reads the parameters' shapes
                out["grad"] = grad_shard_error(opt, model, grads_of(ref.module), rank)
        ref_opt.step()
        out["loss"] = max(out["loss"], rel(loss.detach(), ref_loss.detach()))
        out["gathered_after_step"] = max(out["gathered_after_step"], opt._stage.gatherer.gathered_bytes())
    with opt.full_parameters():
        refs = dict(ref.module.named_parameters())
        out["param"] = max(rel(_comparable(n, p), _comparable(n, refs[n])) for n, p in model.named_parameters())
        out["tied"] = name != "gpt" or model.lm_head.weight is model.tok_emb.weight
    out["buffers"] = max([rel(b, dict(ref.module.named_buffers())[n])
                          for n, b in model.named_buffers() if b.is_floating_point()] or [0.0])
    model.eval()
    ref.module.eval()
    with torch.no_grad():
        out["eval"] = rel(_loss(name, model, STEPS, rank), _loss(name, ref.module, STEPS, rank))
    out["gathered_after_eval"] = opt._stage.gatherer.gathered_bytes()
    return out


CASES = [(name, ws) for name in ("gpt", "tiny", "bn") for ws in (2, 3, 4)]


@pytest.fixture(scope="module")
def parity():
    return {(name, ws): run_ranks(_run, ws, name, {}, timeout=240) for name, ws in CASES}


@pytest.mark.parametrize("name,ws", CASES)
def test_losses_and_params_match_ddp(parity, name, ws):
    for rank, r in enumerate(parity[(name, ws)]):
        assert r["loss"] <= TOL, (rank, r)
        assert r["param"] <= TOL, (rank, r)
        assert r["tied"]


@pytest.mark.parametrize("name,ws", CASES)
def test_reduce_scattered_gradient_is_ddps_average(parity, name, ws):
    for rank, r in enumerate(parity[(name, ws)]):
        assert r["grad"] <= TOL, (rank, r["grad"])


@pytest.mark.parametrize("name,ws", CASES)
def test_nothing_stays_gathered_and_peak_within_pool(parity, name, ws):
    for r in parity[(name, ws)]:
        assert r["units"] > 1
        assert r["gathered_after_step"] == 0 and r["gathered_after_eval"] == 0
        assert 0 < r["peak"] <= r["pool"], r


@pytest.mark.parametrize("ws", (2, 3))
def test_eval_under_no_grad_matches_ddp(parity, ws):
    # BatchNorm evaluates with running stats: DDP overwrote rank 1's with rank 0's, so only
    # rank 0's are the same model on both sides
    for r in parity[("bn", ws)][:1] + parity[("gpt", ws)]:
        assert r["eval"] <= TOL, r


def test_batchnorm_buffers_untouched(parity):
    # DDP broadcasts rank 0's buffers every forward; rank 0's running stats are its own in both
    assert parity[("bn", 2)][0]["buffers"] <= TOL


@pytest.mark.parametrize("options", [dict(reshard_after_forward=False), dict(max_live_units=1),
                                     dict(overlap=False, bucket_numel=700)])
def test_options_keep_parity(options):
    results = run_ranks(_run, 2, "tiny", options, timeout=240)
    for r in results:
        assert r["loss"] <= TOL and r["param"] <= TOL and r["grad"] <= TOL, r
        assert r["peak"] <= r["pool"]


def test_world_size_one_matches_torch_adamw():
    model, kwargs, _ = _build("gpt")
    ref = copy.deepcopy(model)
    from fused_zero import ShardedOptimizer
    opt = ShardedOptimizer(model, **HYPER, stage=3, **kwargs, **PER_MODULE)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER, foreach=False)
    for step in range(5):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            _loss("gpt", m, step, 0).backward()
            o.step()
    with opt.full_parameters():
        refs = dict(ref.named_parameters())
        assert max(rel(_comparable(n, p), _comparable(n, refs[n])) for n, p in model.named_parameters()) <= TOL
