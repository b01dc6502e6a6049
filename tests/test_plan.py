"""estimate(): the ZeRO paper's closed forms, the flowchart's recommendation, counting and errors."""
from __future__ import annotations

import dataclasses

import numpy as np
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
    # stages 1-2: the master of fp32 params is their own slices of the flat buffer, as in Megatron's optimizer
    assert plan.stage(1).optimizer == 8 * psi // n
    assert plan.stage(2).model_states == 4 * psi + 12 * psi // n
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


@pytest.mark.parametrize("params,n,gib,stage,offload", [
    (7e9, 8, 80, 2, "none"),     # 16Ψ = 104 GiB does not fit; (2 + 14/8)Ψ = 24 GiB does
    (1e9, 8, 80, 1, "none"),     # fits unsharded: stage 1, same communication, less memory
    (1e9, 1, 80, 0, "none"),     # one GPU: nothing to shard
    (70e9, 16, 80, 3, "none"),   # stage 2 needs 148 GiB; 16Ψ/16 = 65 GiB
    (70e9, 8, 80, 3, "opt=cpu"),  # stage 3 needs 130 GiB; 2 + 2 bytes per element / 8 = 33 GiB with states on the host
    (7e9, 1, 80, 2, "opt=cpu"),  # stage 2 of one GPU: 2Ψ params = 13 GiB on the device; 14Ψ (states, grads) host
    (7e9, 1, 24, 2, "opt=cpu"),  # the same fits 24 GiB: the gradient shard went to the host with the states
    (20e9, 1, 24, 3, "opt=cpu,params=cpu"),  # 2Ψ = 37 GiB of params do not fit: stage 3 with them on the host
    (70e9, 1, 80, 3, "opt=cpu,params=cpu"),  # ZeRO-Infinity's promise: a 70B model on one GPU (host unchecked)
    (7e9, 1, 0.01, None, None),  # 10 MiB: not even the communication buffers fit, whatever the tier
])
def test_recommendation(params, n, gib, stage, offload):
    rec = estimate(params, world_size=n, gpu_memory=int(gib * GIB)).recommendation
    assert (rec.stage, rec.offload) == (stage, offload or "none"), rec
    assert rec.fits is (stage is not None)
    assert "\n" not in rec.reason
    if offload not in (None, "none"):
        assert rec.reason.startswith(f"stage {stage} with offload_optimizer=") and "host memory" in rec.reason
    else:
        assert (f"stage {stage}:" in rec.reason) if stage is not None else ("more GPUs" in rec.reason)


def _flat(psi, n, **kw):
    return estimate(psi, world_size=n, bucket_numel=64 * n * 1000, param_dtype="bf16", **kw)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_offload_closed_forms_bf16(n):
    """The optimizer states 12Ψ/N move from the device to the host / NVMe; stage 3's params 2Ψ/N too."""
    psi, chunk = 64 * n * 1000 * 5, 1 << 20
    plan = _flat(psi, n)
    pool = 2 * (64 * n * 1000) * 2  # GradSync's pool: two bf16 buffers of a bucket (of five)
    direct = 0 if n == 1 else pool  # one rank without offload packs straight into the shard: no pool
    assert plan.stage(3).buffers == direct
    host_chunks = 0  # HostStore: the page-locked master itself goes up (counted in its states)
    # NvmeStore: three blocks of each state kind (a block holds the shard, smaller than a chunk), two pinned bf16
    # chunks of params going up
    nvme_chunks = 3 * 3 * 4 * min(chunk, psi // n) + 2 * chunk * 2
    # on the device, where an accumulating backward is added before it goes down: a bf16 bucket shard per pool buffer
    scratch = 2 * (64 * 1000) * 2
    grads = 2 * psi // n  # the bf16 gradient shard, on the host with the states
    for stage in (1, 2, 3):
        none, cpu, nvme = (plan.stage(stage, t) for t in ("none", "opt=cpu", "opt=nvme"))
        for s, where, staging in ((cpu, "host", host_chunks), (nvme, "nvme", nvme_chunks)):
            assert s.optimizer == 0 and s.detail[f"{where}_states"] == 12 * psi // n == none.optimizer
            assert s.detail["host_grads"] == grads and s.grads == none.grads - grads  # stage 1: the full .grad stays
            assert s.comm_bytes == none.comm_bytes and s.staging == scratch == s.detail["grad_staging"]
            assert s.detail["host_staging"] == staging and none.staging == 0
            # stages 1-2: the update writes the params in place (no param shard beside them); stage 3 keeps it
            assert s.buffers == pool and none.buffers == direct + (2 * psi // n if stage < 3 else 0)
            assert s.params == none.params
        assert cpu.host == 12 * psi // n + grads + host_chunks and cpu.nvme == 0
        # page-locked with a GPU: the gradient shard, and what goes up ("cpu": the master itself;
        # "nvme": two bf16 chunks of params)
        assert cpu.detail["host_pinned"] == grads + 4 * psi // n
        assert nvme.detail["host_pinned"] == grads + 2 * chunk * 2
        assert nvme.host == grads + nvme_chunks and nvme.nvme == 12 * psi // n
    s2 = plan.stage(2, "opt=cpu")
    assert s2.params + s2.grads + s2.optimizer == 2 * psi and s2.buffers == pool  # the params only
    s3 = plan.stage(3, "opt=cpu")
    assert s3.model_states == 2 * psi // n and s3.total == 2 * psi // n + pool + scratch
    for opt, where in (("cpu", "host"), ("nvme", "nvme")):
        s = plan.stage(3, f"opt={opt},params={opt}")
        assert s.params == 0 and s.model_states == 0  # nothing of the model stays on the device between uses
        assert s.detail[f"{where}_states"] + s.detail[f"{where}_params"] == 14 * psi // n
        assert s.staging == scratch  # no --layers: the units in flight, like the gathered bytes, are unknown
        assert s.host == (14 * psi // n if where == "host" else 0) + grads + s.detail["host_staging"]
        assert s.nvme == (14 * psi // n if where == "nvme" else 0)
        # "cpu": the host param shard is written in place (the master stays unlocked); "nvme": the chunks going up
        assert s.detail["host_pinned"] == grads + (2 * psi // n if where == "host" else 2 * chunk * 2)
    assert plan.stage(3, "params=cpu").detail["host_params"] == 2 * psi // n  # states stay: 12Ψ/N on the device
    assert plan.stage(3, "params=cpu").optimizer == 12 * psi // n


def test_offload_fp32_and_chunks():
    n, psi = 4, 64 * 4 * 1000 * 5
    plan = estimate(psi, world_size=n, bucket_numel=64 * 4 * 1000, param_dtype="fp32", offload_chunk_numel=100)
    assert plan.stage(3).params == 0  # gathered from the fp32 master on the device
    assert plan.stage(3, "opt=cpu").params == 4 * psi // n  # the master left: a param shard to gather from
    assert plan.stage(3, "params=cpu").host == 0  # nothing to move: the master is the gather source
    assert plan.stage(3, "opt=cpu,params=cpu").detail["host_params"] == 4 * psi // n
    # 100 elements round up to 128: NvmeStore's two fp32 chunks going up and three blocks per state kind
    assert plan.stage(2, "opt=nvme").detail["host_staging"] == 128 * (4 + 4) + 3 * 3 * 4 * 128
    assert plan.stage(2, "opt=cpu").detail["host_staging"] == 0  # HostStore's master goes up as it is


def test_small_layers_merge_into_units_as_the_optimizer_merges_them():
    psi, layers = 2 ** 19 * 32, 32  # 2**19 elements a layer: two make the default min_unit_numel (2**20)
    merged = estimate(psi, world_size=8, bucket_numel=64 * 8 * 1000, layers=layers).stage(3, "params=nvme")
    apart = estimate(psi, world_size=8, bucket_numel=64 * 8 * 1000, layers=layers,
                     min_unit_numel=0).stage(3, "params=nvme")
    per_layer = psi // layers
    assert apart.gathered == 2 * 2 * per_layer  # bf16: two live units of one layer
    assert merged.gathered == 2 * 2 * (2 * per_layer)  # two live units of two layers each
    assert merged.detail["partitions"] == apart.detail["partitions"] // 2 == 16  # one a unit
    # a layer one element short: three make a unit, and the last two join the tenth (five layers)
    odd = estimate(psi - layers, world_size=8, bucket_numel=64 * 8 * 1000, layers=layers).stage(3)
    assert odd.gathered == 2 * (5 + 3) * (2 ** 19 - 1) and odd.detail["partitions"] == 10
    assert merged.staging == 2 * apart.staging  # the in-flight units' shards, twice the size
    with pytest.raises(ValueError, match="min_unit_numel must be a whole number >= 0"):
        estimate(psi, min_unit_numel=-1)


def test_offload_units_and_nodes():
    psi, layers = 64 * 8 * 1000 * 32, 32  # 512k elements a layer: units of their own only with min_unit_numel=0
    plan = estimate(psi, world_size=8, nodes=2, bucket_numel=64 * 8 * 1000, layers=layers, max_live_units=2,
                    min_unit_numel=0)
    one = estimate(psi, world_size=8, nodes=2, bucket_numel=64 * 8 * 1000)
    s, flat = plan.stage(3, "opt=nvme,params=nvme"), one.stage(3, "opt=nvme,params=nvme")
    shard = 2 * psi // 8
    # two live units and the one read ahead, and the scratch an accumulating backward is added in, per pool buffer
    assert s.staging == 3 * shard // layers + s.detail["grad_staging"] and s.detail["grad_staging"] > 0
    # the chunk staging is the optimizer's, shared by the 32 units' partitions; the units in flight are read to the host
    assert s.detail["host_staging"] == flat.detail["host_staging"] - flat.detail["device_staging"] + 3 * shard // layers
    assert plan.ranks_per_node == 4
    # stage 3 needs 13.1 GiB per GPU; with the states and gradients on the host 1.7 GiB, and 14Ψ/8 = 11.4 GiB of
    # host per rank: 46 GiB on each of 2 nodes of 4 ranks fits 64 GiB (57.6 usable), 91 GiB on one node of 8 does not
    kw = dict(world_size=8, gpu_memory=12 * GIB, host_memory=64 * GIB)
    two = estimate(7e9, nodes=2, **kw).recommendation
    assert (two.stage, two.offload, two.host_usable) == (3, "opt=cpu", int(64 * GIB * 0.9))
    assert "45.6 GiB per node of 57.6 GiB usable" in two.reason
    assert (estimate(7e9, nodes=1, **kw).recommendation.offload) == "opt=nvme"


def test_host_memory_check_and_max_offload():
    kw = dict(world_size=1, gpu_memory=24 * GIB, layers=32)
    assert estimate(7e9, **kw).recommendation.offload == "opt=cpu"  # 13 GiB of params on the device
    small = estimate(7e9, host_memory=64 * GIB, **kw).recommendation  # 91 GiB on the host: NVMe instead
    assert (small.stage, small.offload) == (2, "opt=nvme") and "57.6 GiB usable" in small.reason
    none = estimate(7e9, max_offload="none", **kw).recommendation
    assert none.stage is None and "--max-offload none" in none.reason
    cpu = estimate(7e9, max_offload="cpu", host_memory=64 * GIB, **kw).recommendation
    assert cpu.stage is None and "host memory per node" in cpu.reason and "--max-offload nvme" in cpu.reason
    tiny = estimate(7e9, max_offload="nvme", host_memory=1 * GIB, **kw).recommendation
    assert tiny.stage is None and "--max-offload" not in tiny.reason


def test_every_tier_is_planned_and_refused_combinations():
    plan = estimate(1e9, world_size=2)
    keys = {(s.stage, s.offload) for s in plan.stages}
    assert len(keys) == len(plan.stages) == 4 + 2 * 2 + 8  # stages 0-3; opt at 1-2; 3x3 - 1 at stage 3
    assert [(s.stage, s.offload) for s in plan.tiers()] == [
        (2, "opt=cpu"), (3, "opt=cpu"), (3, "opt=cpu,params=cpu"), (2, "opt=nvme"), (3, "opt=nvme"),
        (3, "opt=nvme,params=nvme")]
    with pytest.raises(ValueError, match="offload_params needs stage 3"):
        plan.stage(2, "params=cpu")
    with pytest.raises(ValueError, match="stage 0 .DDP. has no offload tiers"):
        plan.stage(0, "opt=cpu")
    with pytest.raises(ValueError, match="not an offload tier"):
        plan.stage(2, "opt=disk")
    with pytest.raises(ValueError, match="not an offload tier"):
        plan.stage(2, "cpu")
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        plan.stage(4)
    from fused_zero.plan.memory import Job, sharded
    with pytest.raises(ValueError, match="offload_params='cpu' needs stage 3"):
        sharded(plan.model, Job(2, 1 << 24, None, 2), 2, None, "cpu")


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
    with pytest.raises(ValueError, match="heads=12 does not divide hidden=2048"):
        estimate(1e9, seq_len=2048, micro_batch=2, hidden=2048, layers=24, heads=12)
    with pytest.raises(ValueError, match="needs seq_len, micro_batch, hidden and layers together"):
        estimate(1e9, heads=16)  # the heads of an estimate that was never asked for: not silently dropped


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


def test_hpz_moves_backward_gathers_inside_a_node_for_copies_of_one_node_share():
    """secondary_shard=s at stage 3: the same gathers, backward's under "secondary_all_gather"; the copies hold 1/s
    of every unit backward gathers again (all but the root and the last), counted with the gathered units."""
    with torch.device("meta"):
        model = mixed_net()
    flat = estimate(model=model, world_size=4, bucket_numel=1000, min_unit_numel=0)
    hpz = estimate(model=model, world_size=4, bucket_numel=1000, min_unit_numel=0, secondary_shard=2)
    f, h = flat.stage(3).detail, hpz.stage(3).detail
    assert h["all_gather"] + h["secondary_all_gather"] == f["all_gather"] and h["secondary_all_gather"] > 0
    assert h["secondary"] * 2 == h["secondary_all_gather"] and f["secondary"] == f["secondary_all_gather"] == 0
    assert hpz.stage(3).gathered == flat.stage(3).gathered + h["secondary"]
    assert hpz.stage(3).comm_bytes == flat.stage(3).comm_bytes
    for n in (1, 2):  # stages 1-2 are planned without it (the optimizer refuses it there)
        assert hpz.stage(n) == flat.stage(n)
    # --params with --layers: backward gathers every layer but the last inside the node
    big = estimate(8e9, world_size=16, nodes=2, layers=8, secondary_shard=8).stage(3).detail
    assert big["secondary_all_gather"] == big["param_full"] * 7 // 8 == big["secondary"] * 8


def test_levels_split_each_layouts_traffic_inside_and_across_nodes():
    """4 ranks on 2 nodes: flat ZeRO sends everything across; HSDP (shard group = a node) all of ZeRO's
    collectives inside and the reduced shards' all-reduce across; hpZ backward's gathers inside."""
    with torch.device("meta"):
        model = mixed_net()
    plan = estimate(model=model, world_size=4, nodes=2, bucket_numel=1000, min_unit_numel=0)
    rows = {(r.layout, r.stage): r for r in plan.levels}
    assert list(rows) == [("flat", 1), ("hsdp", 1), ("flat", 2), ("hsdp", 2), ("flat", 3), ("hsdp", 3), ("hpz", 3)]
    for (layout, stage), r in rows.items():
        assert r.inside + r.across == sum(r.comm.values())
    flat3 = plan.stage(3).detail
    assert rows["flat", 3].across == flat3["reduce_scatter"] + flat3["all_gather"] + flat3["all_reduce"]
    assert rows["flat", 3].inside == 0
    node = estimate(model=model, world_size=2, bucket_numel=1000, min_unit_numel=0).stage(3).detail
    assert rows["hsdp", 3].inside == node["reduce_scatter"] + node["all_gather"] + node["all_reduce"]
    assert rows["hsdp", 3].across == rows["hsdp", 3].comm["replicate_all_reduce"] > 0
    hpz = rows["hpz", 3]
    assert hpz.inside == hpz.comm["secondary_all_gather"] > 0 and hpz.secondary > 0
    assert hpz.across + hpz.inside == rows["flat", 3].across  # the same bytes, backward's gathers moved inside
    assert estimate(model=model, world_size=4).levels == ()  # one node: nothing crosses


def test_codecs_closed_forms():
    """Ψ = 4 buckets of 2**24 bf16 elements on 8 ranks (shards of 2**21, no padding), quant_block 256: qgZ sends
    8 payloads of a shard per bucket (int8: a byte a value + one fp32 scale per 256; int4: half a byte), qwZ
    the same for each stage-3 gather (forward, and backward again: one flat unit), HSDP over 2 nodes of 8 two
    exchanges of 2 payloads of half a shard; hpZ's backward gathers stay exact, inside the node."""
    psi, shard, scales = 4 << 24, 1 << 21, 4 * (1 << 21) // 256
    base = estimate(psi, world_size=8)
    for codec, values in (("int8", shard), ("int4", shard // 2)):
        plan = estimate(psi, world_size=8, grad_comm=codec)
        for n in (1, 2, 3):
            d = plan.stage(n).detail
            assert d["reduce_scatter"] == 0 and d[f"reduce_scatter_{codec}"] == 8 * 4 * (values + scales)
            assert plan.stage(n).comm_bytes == base.stage(n).comm_bytes - base.stage(n).detail["reduce_scatter"] \
                + d[f"reduce_scatter_{codec}"]
    qwz = estimate(psi, world_size=8, param_comm="int8")
    d = qwz.stage(3).detail
    assert d["all_gather"] == 0 and d["all_gather_int8"] == 2 * 8 * 4 * (shard + scales)
    assert qwz.stage(3).comm_bytes == d["reduce_scatter"] + d["all_gather_int8"] + d["all_reduce"]
    for n in (1, 2):  # stages 1-2 are planned without it (the optimizer refuses it there), and the note says so
        assert qwz.stage(n) == base.stage(n)
    assert any("stages 1-2 gather once per step" in note for note in qwz.notes)
    assert "reduce_scatter_int8" not in estimate(psi, grad_comm="int8").stage(2).detail  # alone: nothing coded
    rows = {(r.layout, r.stage): r for r in estimate(psi, world_size=16, nodes=2, grad_comm="int8",
                                                   param_comm="int8", layers=4).levels}
    hsdp = rows["hsdp", 2]
    assert hsdp.comm["replicate_all_reduce_int8"] == 4 * 2 * 2 * (shard // 2 + scales // 2)
    assert hsdp.coded_across == hsdp.comm["replicate_all_reduce_int8"] == \
        hsdp.across - hsdp.comm["replicate_all_reduce"]
    assert hsdp.coded_inside == hsdp.comm["reduce_scatter_int8"] == 8 * 4 * (shard + scales)
    hpz = rows["hpz", 3]  # forward's gathers coded across nodes, backward's (3 of 4 layers) exact inside
    assert hpz.coded_inside == 0 and hpz.inside == hpz.comm["secondary_all_gather"] == 2 * psi * 3 // 4
    assert hpz.coded_across == hpz.comm["reduce_scatter_int8"] + hpz.comm["all_gather_int8"]
    assert hpz.comm["all_gather_int8"] == 16 * 4 * ((shard // 2) + scales // 2)


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
    (dict(params=1e9, host_memory=0), ValueError, "host_memory must be positive"),
    (dict(params=1e9, host_memory=-1), ValueError, "host_memory"),
    (dict(params=1e9, max_offload="disk"), ValueError, "max_offload must be one of none, cpu, nvme"),
    (dict(params=1e9, offload_chunk_numel=0), ValueError, "offload_chunk_numel"),
    (dict(params=1e9, seq_len=128), ValueError, "seq_len, micro_batch, hidden and layers together"),
    (dict(params=1e9, activations=1, hidden=2), ValueError, "not both"),
    (dict(params=1e9, layers=100_001), ValueError, "100001 layers is more than 100000"),
    (dict(params=10, layers=20), ValueError, "20 layers is more than the 10 parameters"),
    (dict(params=1e9, layers=0), ValueError, "layers must be a whole number >= 1"),
    (dict(params=1e9, layers="32"), TypeError, "layers must be a number"),
    (dict(params=1e9, world_size=4, secondary_shard=3), ValueError, "does not divide world_size 4"),
    (dict(params=1e9, world_size=4, secondary_shard=1), ValueError, "secondary_shard must be a whole number >= 2"),
    (dict(params=1e9, world_size=4, secondary_shard="2"), TypeError, "secondary_shard must be a number"),
    (dict(params=1e9, param_comm="int4"), ValueError, 'param_comm must be None or "int8"'),
    (dict(params=1e9, grad_comm="fp8"), ValueError, 'grad_comm must be None, "int8" or "int4"'),
    (dict(params=1e9, grad_comm="int8", quant_block=100), ValueError, "quant_block must be a power of two"),
    (dict(), ValueError, "exactly one"),
    (dict(params=1e9, model=torch.nn.Linear(2, 2)), ValueError, "exactly one"),
    (dict(model="gpt"), TypeError, "model must be a torch.nn.Module"),
    (dict(model=torch.nn.Embedding(4, 4).to(torch.float64)), TypeError, "supports float32, bfloat16 and float16"),
    (dict(params=1e9, activation_checkpointing="False"), TypeError, "activation_checkpointing must be True or False"),
    (dict(params=1e9, reshard_after_forward="False"), TypeError, "reshard_after_forward must be True or False"),
    (dict(params=1e9, world_size=8, secondary_shard=8, reshard_after_forward=False), ValueError,
     "secondary_shard=8 with reshard_after_forward=False"),
    (dict(params=1e9, units=[torch.nn.Linear]), ValueError, "units= names the model's stage 3 units"),
])
def test_errors_say_what_to_change(kwargs, error, words):
    params = kwargs.pop("params", None)
    with pytest.raises(error, match=words.replace("(", r"\(")):
        estimate(params, **kwargs)


def test_numpy_counts_are_taken_and_a_bool_is_no_stage():
    """numpy integers (as ZeroConfig takes them) plan as ints; Plan.stage(True) is no stage 1 (True == 1)."""
    plan = estimate(np.int64(10**9), world_size=np.int64(8))
    assert plan.job.world_size == 8 and isinstance(plan.job.world_size, int)
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3, got True"):
        plan.stage(True)


def test_a_plan_of_too_many_buckets_is_refused_at_once():
    """The plan lays out every bucket: 1e14 parameters in 2**24-element buckets (6e6 buckets) took minutes and
    gigabytes before; now it is refused, naming the bucket size that would do."""
    with pytest.raises(ValueError, match="bucket_numel"):
        estimate(params=1e14)
    estimate(params=7e9)  # 418 buckets: planned as usual
