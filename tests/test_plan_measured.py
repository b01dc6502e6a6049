"""Planned against measured: ``estimate(model=...)`` equals ``ShardedOptimizer.memory_bytes()``.

Every configuration is built for real on 1, 2 and 3 gloo ranks, trained one step, then a
second backward runs and ``memory_bytes()`` is read (params, grads, master, exp_avg,
exp_avg_sq, buffers); ``comm_bytes()`` after that step. The plan of the same model, built on
the meta device, must give the same params + grads + optimizer (exactly here; the contract
is 1%), the same buffers (the reducer's pool and the narrow param shard) and the same
reduce-scatter and all-gather bytes, at every stage (GradSync's pool never grows past
MAX_INFLIGHT buffers per reduce dtype). The offload tiers (optimizer states to cpu / nvme at
stages 1-3, stage-3 param shards to cpu / nvme, with and without offloaded states) on 1 and 2
ranks: the same, plus memory_bytes()'s "host" and "nvme", and NvmeStore's staging blocks.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _dist import run_ranks
from _models import LoraNet, lora_batch
from fused_zero import ShardedOptimizer
from fused_zero.comm.grad_buckets import BucketPipe
from fused_zero.tiers.store_host import HostStore
from fused_zero.plan import estimate, tier

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

GPT_CFG = GPTConfig(vocab=256, d_model=64, n_layer=3, n_head=4, seq_len=16)


class MixedNet(nn.Module):
    """fp32 and bf16 parameters, a frozen bf16 layer, blocks in a ModuleList (stage 3 units)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64)) for _ in range(3))
        self.blocks[1].to(torch.bfloat16)
        self.frozen = nn.Linear(64, 64).to(torch.bfloat16).requires_grad_(False)
        self.head = nn.Linear(64, 8, bias=False)

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h.to(b[0].weight.dtype)).float()
        h = self.frozen(h.to(torch.bfloat16)).float()
        return None, F.mse_loss(self.head(h), y)


def mixed_net() -> nn.Module:
    return MixedNet()


def gpt() -> nn.Module:
    return GPT(GPT_CFG)


def gpt_bf16() -> nn.Module:
    return GPT(GPT_CFG).to(torch.bfloat16)


def _batch(name, rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    if name == "lora":
        return lora_batch(step, rank)
    if name.startswith("gpt"):
        idx = torch.randint(0, GPT_CFG.vocab, (2, GPT_CFG.seq_len + 1), generator=g)
        return idx[:, :-1], idx[:, 1:]
    return torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)


def lora() -> nn.Module:
    return LoraNet()


class QuantBase(nn.Module):
    """A frozen base stored as uint8 (a quantized model's weights) and float64, with trainable adapters."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.ParameterList([nn.Parameter(torch.zeros(64, 16, dtype=torch.uint8), requires_grad=False),
                                   nn.Parameter(torch.zeros(64, 8, dtype=torch.float64), requires_grad=False)])
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(64, 8)

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        h = x @ self.q[0].float().t() / 255
        return None, F.mse_loss(self.head(h) + h @ self.q[1].float(), y)


MODELS = {"gpt": gpt, "gpt_bf16": gpt_bf16, "mixed": mixed_net, "lora": lora,  # lora: 98.5% frozen (issue 24)
          "quant_base": QuantBase}
# (model, stage, bucket_numel, reduce dtype)
CONFIGS = [(m, s, b, r) for m in MODELS for s in (1, 2, 3) for b, r in ((1000, None), (1 << 24, torch.float32))]


def _id(cfg):
    m, s, b, r = cfg
    return f"{m}-stage{s}-bucket{b}-reduce_{str(r).replace('torch.', '')}"


def _two_steps(name, model, opt, rank) -> dict:
    """Two training steps; what ``memory_bytes()`` reports after the second backward (before its step)."""
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        _, loss = model(*_batch(name, rank, step))
        loss.backward()
        if step == 1:
            mem = opt.memory_bytes()
        opt.step()
    return mem


def _measure(rank, ws):
    out = {}
    for cfg in CONFIGS:
        name, stage, bucket, reduce = cfg
        model = MODELS[name]()
        opt = ShardedOptimizer(model if stage == 3 else model.parameters(), stage=stage, bucket_numel=bucket,
                               reduce_dtype=reduce)
        out[_id(cfg)] = {"mem": _two_steps(name, model, opt, rank), "comm": opt.comm_bytes()}
    return out


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"ws{n}")
def measured(request):
    return request.param, run_ranks(_measure, request.param, timeout=300)


def _planned(cfg, ws):
    name, stage, bucket, reduce = cfg
    with torch.device("meta"):
        model = MODELS[name]()
    return estimate(model=model, world_size=ws, bucket_numel=bucket, reduce_dtype=reduce).stage(stage)


@pytest.mark.parametrize("cfg", CONFIGS, ids=_id)
def test_planned_equals_measured(measured, cfg):
    ws, results = measured
    plan = _planned(cfg, ws)
    for rank, res in enumerate(results):
        mem, comm = res[_id(cfg)]["mem"], res[_id(cfg)]["comm"]
        got = {"params": mem["params"], "grads": mem["grads"],
               "optimizer": mem["master"] + mem["exp_avg"] + mem["exp_avg_sq"]}
        want = {"params": plan.params, "grads": plan.grads, "optimizer": plan.optimizer}
        assert got == want, f"rank {rank}: measured {got} != planned {want}"
        assert mem["buffers"] == plan.buffers, (rank, mem["buffers"], plan.buffers)
        d = plan.detail
        assert (comm["reduce_scatter"], comm["all_gather"]) == (d["reduce_scatter"], d["all_gather"]), (rank, comm, d)
        assert comm["all_reduce"] == d["all_reduce"], (rank, comm, d)


@pytest.mark.parametrize("stage", [1, 3])
def test_train_gpt_prints_planned_next_to_measured(stage):
    """examples/train_gpt.py prints both columns after step 1; one process, so they agree exactly."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_gpt.py")
    done = subprocess.run([sys.executable, script, "--steps", "1", "--n-layer", "2", "--d-model", "64",
                           "--stage", str(stage), "--dtype", "bf16"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "planned   measured" in line)
    rows = {line.split()[0]: line.split()[1:] for line in lines[start + 1:start + 6]}
    assert list(rows) == ["params", "grads", "optimizer", "buffers", "total"]
    assert all(planned == measured for planned, measured in rows.values()), rows
    # one rank: the gradients pack straight into the shard, so stage 3 holds no buffer (stage 1 its narrow shard)
    assert all(float(planned) > 0 for name, (planned, _) in rows.items() if name != "buffers" or stage < 3), rows


# -- the offload tiers --------------------------------------------------------------------------------------------
CHUNK = 1000  # offload_chunk_numel: the stores round it up to 1024
# (model, stage, offload_optimizer, offload_params): mixed has fp32, bf16 and frozen partitions
OFFLOAD_TIERS = [(1, "cpu", None), (2, "cpu", None), (2, "nvme", None), (3, "cpu", None), (3, "nvme", None),
                 (3, None, "cpu"), (3, None, "nvme"), (3, "cpu", "cpu"), (3, "nvme", "nvme")]
OFFLOAD_CONFIGS = [(m, *t) for m in ("gpt_bf16", "mixed") for t in OFFLOAD_TIERS]


def _offload_id(cfg):
    m, s, o, p = cfg
    return f"{m}-stage{s}-opt_{o}-params_{p}"


def _measure_offload(rank, ws, folder):
    # the planner plans the GPU's way: the gradients reduce in a pool buffer on the device and go down to the host
    # shard (on a CPU-only run one rank packs them straight into it: BucketPipe.direct, no pool buffer)
    BucketPipe.copy_down = True
    HostStore.copy_up = True  # and keeps a host master beside the GPU's parameters (on CPU they would be the master)
    out = {}
    for cfg in OFFLOAD_CONFIGS:
        name, stage, opt, par = cfg
        model = MODELS[name]()
        sharded = ShardedOptimizer(model if stage == 3 else model.parameters(), stage=stage, bucket_numel=1000,
                                   offload_optimizer=opt, offload_params=par, nvme_path=folder,
                                   offload_chunk_numel=CHUNK)
        mem = _two_steps(name, model, sharded, rank)
        blocks = sharded._stage.staging.nbytes()  # the stores' shared staging (no uploads: the params are on the host)
        out[_offload_id(cfg)] = {"mem": mem, "comm": sharded.comm_bytes(), "blocks": blocks,
                                 "partitions": len(sharded.partitions)}
        sharded.close()
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=lambda n: f"ws{n}")
def measured_offload(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("nvme"))
    return request.param, run_ranks(_measure_offload, request.param, folder, timeout=300)


@pytest.mark.parametrize("cfg", OFFLOAD_CONFIGS, ids=_offload_id)
def test_offload_tiers_planned_equal_measured(measured_offload, cfg):
    ws, results = measured_offload
    name, stage, opt, par = cfg
    with torch.device("meta"):
        model = MODELS[name]()
    plan = estimate(model=model, world_size=ws, bucket_numel=1000, offload_chunk_numel=CHUNK)
    s = plan.stage(stage, tier(opt, par))
    assert (s.offload_optimizer, s.offload_params) == (opt, par)
    d = s.detail
    for rank, res in enumerate(results):
        mem, comm = res[_offload_id(cfg)]["mem"], res[_offload_id(cfg)]["comm"]
        got = {"params": mem["params"], "grads": mem["grads"],
               "optimizer": mem["master"] + mem["exp_avg"] + mem["exp_avg_sq"], "buffers": mem["buffers"],
               "host": mem.get("host", 0), "nvme": mem.get("nvme", 0)}
        want = {"params": s.params, "grads": s.grads, "optimizer": s.optimizer, "buffers": s.buffers,
                "host": d["host_states"] + d["host_params"] + d["host_grads"],
                "nvme": d["nvme_states"] + d["nvme_params"]}
        assert got == want, f"rank {rank}: measured {got} != planned {want}"
        assert s.host == want["host"] + d["host_staging"] and s.nvme == want["nvme"]
        assert res[_offload_id(cfg)]["partitions"] == d["partitions"]
        # NvmeStore's three blocks per state kind are host memory memory_bytes() leaves out; the plan counts them,
        # once for all partitions (staging.Staging)
        assert res[_offload_id(cfg)]["blocks"] == (3 * 3 * 4 * 1024 if opt == "nvme" else 0)
        assert (comm["reduce_scatter"], comm["all_gather"], comm["all_reduce"]) == \
            (d["reduce_scatter"], d["all_gather"], d["all_reduce"]), (rank, comm, d)
    none = plan.stage(stage)  # the states move off the device, nothing else grows there
    assert s.optimizer == (0 if opt else none.optimizer)
    # offloaded, every partition's master is a copy (on the device, fp32 at stages 1-2 use their own slices)
    assert d["host_states"] + d["nvme_states"] == (3 * none.detail["exp_avg"] if opt else 0)
    assert s.comm_bytes == none.comm_bytes
