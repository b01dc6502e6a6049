"""estimate(): the ZeRO paper's closed forms, the flowchart's recommendation, counting and errors."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fused_zero.plan import estimate
from test_plan_measured import GPT_CFG, gpt, mixed_net

GIB = 1 << 30


def _closed_form_cases():
    # Ψ and buckets multiples of 64·N: no padding, so the figures are the paper's exactly.
    for n in (1, 2, 3, 4, 8):
        yield n, 64 * n * 1000 * 5, 64 * n * 1000


@pytest.mark.parametrize("n,psi,bucket", list(_closed_form_cases()), ids=lambda v: str(v))
def test_closed_forms_bf16(n, psi, bucket):
    plan = estimate(psi, world_size=n, bucket_numel=bucket, param_dtype="bf16")
    s0, s1, s2, s3 = (plan.stage(k) for k in range(4))
    assert s0.model_states == (2 + 2 + 12) * psi
    # stage 1 is the paper's (2 + 2 + 12/N)Ψ plus the reduced gradient shard fused_zero keeps besides .grad
    assert s1.params + s1.detail["grad_full"] + s1.optimizer == (2 + 2) * psi + 12 * psi // n
    assert s1.detail["grad_shard"] == 2 * psi // n
    assert s2.model_states == 2 * psi + 14 * psi // n
    assert s3.model_states == 16 * psi // n
    comm = [s.detail.get("reduce_scatter", 0) + s.detail.get("all_gather", 0) for s in (s1, s2, s3)]
    if n == 1:
        assert [s.comm_bytes for s in (s0, s1, s2, s3)] == [0, 0, 0, 0]
    else:  # 2Ψ, 2Ψ, 2Ψ, 3Ψ elements of 2 bytes
        assert [s0.comm_bytes] + comm == [4 * psi, 4 * psi, 4 * psi, 6 * psi]


def test_closed_forms_fp32():
    n, psi = 4, 64 * 4 * 1000 * 5
    plan = estimate(psi, world_size=n, bucket_numel=64 * 4 * 1000, param_dtype="fp32")
    assert plan.stage(0).model_states == 16 * psi  # 4 params + 4 grads + 8 moments: no separate master
    assert plan.stage(1).optimizer == 12 * psi // n  # fused_zero keeps an fp32 master for fp32 params too
    assert plan.stage(2).model_states == 4 * psi + 16 * psi // n
    assert plan.stage(3).params == 0  # the fp32 master shard is what stage 3 gathers from
    assert plan.stage(3).model_states == 16 * psi // n


def test_buffers_are_the_pool_and_param_shard():
    psi, bucket = 10 * 2**20, 2**20
    plan = estimate(psi, world_size=2, bucket_numel=bucket)
    pool = 2 * bucket * 2  # two bf16 bucket buffers
    assert plan.stage(1).buffers == plan.stage(2).buffers == pool + 2 * psi // 2
    assert plan.stage(3).buffers == pool
    fp32 = estimate(psi, world_size=2, bucket_numel=bucket, reduce_dtype="fp32")
    assert fp32.stage(3).buffers == 2 * bucket * 4


@pytest.mark.parametrize("params,n,gib,stage", [
    (7e9, 8, 80, 2),     # 16Ψ = 104 GiB does not fit; (2 + 14/8)Ψ = 24 GiB does
    (1e9, 8, 80, 1),     # fits unsharded: stage 1, same communication, less memory
    (1e9, 1, 80, 0),     # one GPU: nothing to shard
    (70e9, 16, 80, 3),   # stage 2 needs 148 GiB; 16Ψ/16 = 65 GiB
    (70e9, 8, 80, None),  # even stage 3 needs 130 GiB
])
def test_recommendation(params, n, gib, stage):
    rec = estimate(params, world_size=n, gpu_memory=gib * GIB).recommendation
    assert rec.stage == stage, rec
    assert rec.fits is (stage is not None)
    assert "\n" not in rec.reason
    assert (f"stage {stage}:" in rec.reason) if stage is not None else ("offload" in rec.reason)


def test_headroom_and_activations_decide():
    # stage 2 of 7B on 8 GPUs: 24.4 GiB of model states
    assert estimate(7e9, world_size=8, gpu_memory=30 * GIB).recommendation.stage == 2
    assert estimate(7e9, world_size=8, gpu_memory=30 * GIB, headroom=0.3).recommendation.stage == 3
    heavy = dict(world_size=8, gpu_memory=80 * GIB, seq_len=4096, micro_batch=8, hidden=4096, layers=32)
    assert estimate(7e9, **heavy).recommendation.stage is None  # 136 GiB of activations
    ckpt = estimate(7e9, activation_checkpointing=True, **heavy)
    assert ckpt.stage(2).activations < ckpt.activations.full and ckpt.recommendation.stage == 2
    assert estimate(7e9, gpu_memory=80 * GIB, activations=100 * GIB).stage(3).activations == 100 * GIB
    assert estimate(7e9).recommendation.stage is None and estimate(7e9).recommendation.fits is None


def test_transformer_activations():
    act = estimate(1e9, seq_len=2048, micro_batch=2, hidden=2048, layers=24).activations
    sbh = 2048 * 2 * 2048
    assert act.full == 24 * 34 * sbh and act.checkpointed == 24 * 2 * sbh + 34 * sbh
    heads = estimate(1e9, seq_len=2048, micro_batch=2, hidden=2048, layers=24, heads=16).activations
    assert heads.full == 24 * (34 * sbh + 5 * 16 * 2048 * 2048 * 2)


def test_model_counting():
    with torch.device("meta"):
        model = mixed_net()
    plan = estimate(model=model, world_size=2)
    real = mixed_net()
    by = plan.model.by_dtype()
    assert by["bf16"]["frozen"] == real.frozen.weight.numel() + real.frozen.bias.numel()
    assert by["bf16"]["trainable"] == sum(p.numel() for p in real.blocks[1].parameters())
    assert sum(v["trainable"] + v["frozen"] for v in by.values()) == sum(p.numel() for p in real.parameters())
    assert plan.model.exact and plan.stage(3).gathered > 0
    with torch.device("meta"):
        tied = gpt()
    assert plan.model.numel() > 0 and estimate(model=tied).model.numel() == sum(p.numel() for p in gpt().parameters())
    assert estimate(model=tied, param_dtype="bf16").model.by_dtype().keys() == {"bf16"}
    assert next(tied.parameters()).dtype == torch.float32  # planning as bf16 does not touch the model
    assert GPT_CFG.tie_weights


def test_plan_is_frozen():
    plan = estimate(1e6)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.stages = ()


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(params=-5), ValueError, "params must be a whole number >= 1"),
    (dict(params=0), ValueError, "params"),
    (dict(params="7B"), TypeError, "params must be a number"),
    (dict(params=1e9, world_size=0), ValueError, "world_size"),
    (dict(params=1e9, world_size=8, nodes=3), ValueError, "multiple of nodes"),
    (dict(params=1e9, param_dtype="int8"), TypeError, "param_dtype must be one of bf16, fp16, fp32"),
    (dict(params=1e9, reduce_dtype=torch.int32), TypeError, "reduce_dtype"),
    (dict(params=1e9, gpu_memory=-1), ValueError, "gpu_memory"),
    (dict(params=1e9, gpu_memory=0), ValueError, "gpu_memory must be positive"),
    (dict(params=1e9, headroom=1.0), ValueError, "headroom"),
    (dict(params=1e9, bucket_numel=0), ValueError, "bucket_numel"),
    (dict(params=1e9, seq_len=128), ValueError, "seq_len, micro_batch, hidden and layers together"),
    (dict(params=1e9, activations=1, hidden=2), ValueError, "not both"),
    (dict(), ValueError, "exactly one"),
    (dict(params=1e9, model=torch.nn.Linear(2, 2)), ValueError, "exactly one"),
    (dict(model="gpt"), TypeError, "model must be a torch.nn.Module"),
    (dict(model=torch.nn.Embedding(4, 4).to(torch.float64)), TypeError, "supports float32, bfloat16 and float16"),
])
def test_errors_say_what_to_change(kwargs, error, words):
    params = kwargs.pop("params", None)
    with pytest.raises(error, match=words.replace("(", r"\(")):
        estimate(params, **kwargs)
