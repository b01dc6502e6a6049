"""memory_bytes() and comm_bytes() against the ZeRO paper's formulas, exactly.

With Ψ the padded element count (sum of the partitions' layout.numel), N the world size,
P the param (and grad) dtype bytes and R the reduce dtype bytes, on every rank:
    params = P·Ψ,  master = exp_avg = exp_avg_sq = 4·Ψ/N (master 0 for fp32 params: their own slices are the
    master, as in Megatron's distributed optimizer),
    grads  = P·Ψ_unpadded + R·Ψ/N (stage 1: full local .grad + reduced shard), R·Ψ/N (stage 2),
    buffers < 4·bucket bytes + P·Ψ/N,
and per step reduce_scatter = R·Ψ, all_gather = P·Ψ, all_reduce < 2 x (1 KiB + 4 B per parameter) (an
all-reduce counts twice its tensor, as the ZeRO paper counts 2Ψ)
(all 0 at world size 1), also when the step accumulates micro-batches under no_sync() or clips.
The model (PlainNet) has every parameter trainable and used every step.
"""
import pytest
import torch

from _dist import run_ranks
from _models import HYPER, PlainNet, is_initialized, micro_steps, param_groups
from fused_zero import ShardedOptimizer

BF16, FP32 = torch.bfloat16, torch.float32
# (stage, param dtype, reduce dtype)
CONFIGS = [(s, p, r) for s in (1, 2) for p, r in ((FP32, None), (BF16, None), (BF16, FP32), (FP32, BF16))]


def _name(cfg):
    s, p, r = cfg
    return f"stage{s}-{str(p)[6:]}-reduce_{str(r).replace('torch.', '')}"


def _measure(rank, ws):
    out = {}
    for cfg in CONFIGS:
        stage, pdt, rdt = cfg
        model = PlainNet(dtype=pdt)
        opt = ShardedOptimizer(param_groups(model), **HYPER, stage=stage, bucket_numel=1000, reduce_dtype=rdt)
        r = out[_name(cfg)] = {"mem": [], "comm": [], "grads_none": [], "grad_shard_dtype": None}
        for t in range(2):
            micro_steps(model, opt, t, rank, dtype=pdt)
            opt.step()
            r["mem"].append(opt.memory_bytes())
            r["comm"].append(opt.comm_bytes())
            r["grads_none"].append(all(p.grad is None for p in model.parameters()))
        # a step of 3 micro-batches under no_sync, then a step with clip_grad_norm_
        micro_steps(model, opt, 2, rank, k=3, sync_ctx=opt.no_sync, dtype=pdt)
        opt.step()
        r["comm_accum"] = opt.comm_bytes()
        micro_steps(model, opt, 3, rank, dtype=pdt)
        opt.clip_grad_norm_(1.0)
        opt.step()
        r["comm_clip"] = opt.comm_bytes()
        r["psi"] = sum(part.layout.numel for part in opt.partitions)
        r["unpadded"] = sum(p.numel() for part in opt.partitions for p in part.params)
        r["n_params"] = sum(len(g["params"]) for g in opt.param_groups)
        r["max_bucket"] = max(b.numel for part in opt.partitions for b in part.layout.buckets)
        r["world_size"] = [part.layout.world_size for part in opt.partitions]
        r["grad_shard_dtype"] = str(opt.partitions[0].grad_shard.dtype)
    return out


def _check(results, ws, cfg):
    stage, pdt, rdt = cfg
    P = torch.finfo(pdt).bits // 8
    R = torch.finfo(rdt or pdt).bits // 8
    for rank, res in enumerate(results):
        r = res[_name(cfg)]
        psi, n = r["psi"], ws
        assert r["world_size"] and set(r["world_size"]) == {ws}
        assert psi % n == 0 and psi >= r["unpadded"] > 0
        grads = (P * r["unpadded"] if stage == 1 else 0) + R * psi // n
        for mem in r["mem"]:
            expected = {"params": P * psi, "master": 0 if pdt == FP32 else 4 * psi // n, "exp_avg": 4 * psi // n,
                        "exp_avg_sq": 4 * psi // n, "grads": grads}
            got = {k: mem[k] for k in expected}
            assert got == expected, f"rank {rank}: memory_bytes {got} != {expected}"
            assert set(mem) == set(expected) | {"buffers"}, sorted(mem)
            bound = 4 * r["max_bucket"] * max(P, R) + P * psi // n
            assert 0 <= mem["buffers"] < bound, f"rank {rank}: buffers {mem['buffers']} >= {bound}"
        if stage == 2:
            assert all(r["grads_none"]), f"rank {rank}: stage 2 left .grad tensors after backward+step"
        for what in ("comm", "comm_accum", "comm_clip"):
            for comm in (r[what] if what == "comm" else [r[what]]):
                assert set(comm) == {"reduce_scatter", "all_gather", "all_reduce"}, sorted(comm)
                if ws == 1:
                    assert comm == {"reduce_scatter": 0, "all_gather": 0, "all_reduce": 0}, (what, comm)
                    continue
                assert comm["reduce_scatter"] == R * psi, f"rank {rank} {what}: {comm} vs R·Ψ = {R * psi}"
                assert comm["all_gather"] == P * psi, f"rank {rank} {what}: {comm} vs P·Ψ = {P * psi}"
                assert 0 <= comm["all_reduce"] < 2 * (1024 + 4 * r["n_params"]), f"rank {rank} {what}: {comm}"


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"ws{n}")
def measured(request):
    return request.param, run_ranks(_measure, request.param, timeout=180)


@pytest.mark.parametrize("cfg", CONFIGS, ids=_name)
def test_memory_and_comm_bytes(measured, cfg):
    ws, results = measured
    _check(results, ws, cfg)


def test_single_process_all_configs():
    """No process group at all: world size 1, every configuration, no communication."""
    assert not is_initialized()
    res = _measure(0, 1)
    for cfg in CONFIGS:
        _check([res], 1, cfg)
