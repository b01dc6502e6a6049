"""The offload tiers with the parameters on a GPU (skipped without CUDA): the paths the CPU tests
cannot run -- each bucket's gradient shard copied down on the side stream during backward, the host
update's chunks going up while the next chunk is updated ("cpu": the page-locked master, rounded on the
GPU; "nvme": pinned staging buffers the host rounds into).

World size 1, a bf16 TinyNet, stages 2 and 3 (stage 2 also with update_behind=True: the update then runs
behind step() bucket by bucket, its uploads and gathers on the copy stream, the next forward waiting per
module), 8 steps with accumulation (no_sync, then two synced
backwards), clip_grad_norm_ and plain steps, against the same run without offload. The update runs
on a different processor (torch's fused CPU AdamW against the Triton kernel), so the fp32 masters are
compared within a few ulps and the bf16 params within one bf16 ulp, not bitwise.
"""
import gc

import pytest
import torch

from _models import HYPER, TinyNet, batch, flags, loss_fn
from fused_zero import ShardedOptimizer
from fused_zero.plan import estimate
from fused_zero.plan.memory import tier as tier_name
from fused_zero.tiers.transfer import locked_bytes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TIERS = [dict(offload_optimizer="cpu"), dict(offload_optimizer="nvme"),
         dict(offload_optimizer="cpu", offload_params="cpu")]


def _run(stage, folder, with_model=False, **kw):
    model = TinyNet(dtype=torch.bfloat16).cuda()
    if kw.get("offload_params") and stage != 3:
        pytest.skip("offload_params needs stage 3")
    if "nvme" in kw.values():
        kw["nvme_path"] = str(folder)
    if with_model and kw and stage < 3:
        kw["update_behind"] = True
    gc.collect()  # an earlier run's page-locked buffers go now, not in the middle of this one
    locked = locked_bytes()
    opt = ShardedOptimizer(model if stage == 3 or with_model else model.parameters(), **HYPER, stage=stage,
                           bucket_numel=1000, offload_chunk_numel=700, **kw)
    assert (opt._stage.behind is not None) == (bool(kw) and (stage == 3 or with_model))
    for t in range(8):
        opt.zero_grad()
        micro = (0, 1, 2) if t % 2 else (0,)
        for m in micro:
            x, y = (v.cuda() for v in batch(t, 0, micro=m))
            if m == 0 and len(micro) > 1:
                with opt.no_sync():
                    loss_fn(model(x.bfloat16(), **flags(t, 0)).float(), y).backward()
            else:
                loss_fn(model(x.bfloat16(), **flags(t, 0)).float(), y).backward()
        if t % 2:
            opt.clip_grad_norm_(0.05)
        opt.step()
    torch.cuda.synchronize()
    masters = [opt.read_shard(i, "master", 0, part.layout.shard_numel) for i, part in enumerate(opt.partitions)]
    with opt.full_parameters():
        params = [p.detach().float().cpu() for p in model.parameters()]
    info = {"mem": opt.memory_bytes(), "pinned": all(part.grad_shard.is_pinned() for part in opt.partitions),
            "staging": opt._stage.staging.nbytes(),
            # page-locked now, and the device scratch accumulating backwards were added in (per pool buffer that
            # met one)
            "locked": locked_bytes() - locked, "scratch": sum(t.numel() * t.element_size()
                                                              for t in opt.grad_sync.pipe._scratch.values()),
            "scratch_on_device": all(t.is_cuda for t in opt.grad_sync.pipe._scratch.values()),
            "master_pinned": all(getattr(part.store, "tensors", {}).get("master", torch.empty(0)).is_pinned()
                                 for part in opt.partitions)}
    opt.close()
    return masters, params, info


@pytest.mark.parametrize("stage,with_model", [(2, False), (2, True), (3, True)], ids=["2", "2-behind", "3"])
@pytest.mark.parametrize("tier", TIERS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_offload_on_gpu_matches_the_run_without(stage, with_model, tier, tmp_path):
    ref_masters, ref_params, ref_info = _run(stage, tmp_path)
    masters, params, info = _run(stage, tmp_path, with_model, **tier)
    for a, b in zip(ref_masters, masters):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    for a, b in zip(ref_params, params):
        assert ((a - b).abs() <= a.abs() * 2.0 ** -7 + 1e-6).all()  # one bf16 ulp
    assert info["pinned"]  # the gradients came down to pinned memory
    # "nvme": the params went up through the staging buffers; "cpu": the page-locked master goes up as it is and
    # the GPU rounds it (with offload_params the host shard is written in place)
    assert (info["staging"] > 0) == (tier.get("offload_optimizer") == "nvme")
    assert info["master_pinned"] == (tier == dict(offload_optimizer="cpu"))  # what goes up is page-locked
    assert info["mem"]["grads"] == 0 and info["mem"]["host"] >= ref_info["mem"]["grads"]
    # page-locked host memory is the planner's; the device scratch is within its (an upper bound: one per pool
    # buffer) and this run accumulated, so some was made
    with torch.device("meta"):
        meta = TinyNet(dtype=torch.bfloat16)
    plan = estimate(model=meta, world_size=1, bucket_numel=1000, offload_chunk_numel=700).stage(
        stage, tier_name(tier.get("offload_optimizer"), tier.get("offload_params")))
    assert info["locked"] == plan.detail["host_pinned"]
    assert 0 < info["scratch"] <= plan.detail["grad_staging"] and info["scratch_on_device"]
