"""hpZ (``secondary_shard=``, ZeRO++'s hierarchical partitioning) at stage 3, on 4 gloo ranks standing for
2 nodes x 2 GPUs (secondary_shard=2: ranks {0, 1} and {2, 3}).

One spawn: stage 3 with hpZ (TinyNet of tests/test_mesh.py's HSDP test: odd sizes, three param groups, a
frozen parameter, a branch unused on even steps and a parameter unused on one rank, one unit per module,
two micro-batches accumulated under no_sync, clip_grad_norm_ every other step) equals DDP + torch AdamW to
1e-5 over 10 steps, with the param shards on the device and offloaded to the host (the node-local copies stay
on the device). Per level, every step: ``comm_bytes()``'s "all_gather" (the shard group, across nodes) is the
forward's gathers alone and "secondary_all_gather" (inside a node) is backward's, both as the planner predicts
(``estimate(secondary_shard=2)``, and its hpZ row of traffic per level, ``Plan.levels``: inside a node,
across nodes); ``memory_bytes()["secondary"]`` after a training forward is the planner's
figure and 0 after the backward. A checkpoint saved with hpZ loads into a stage-3 optimizer without it, one
saved without it loads into one with it, and both go on equal to DDP. Refused on every rank, naming the fix,
before any collective: a size that does not divide the shard group, hpZ with an HSDP mesh; and in one
process: stages 1-2, reshard_after_forward=False, non-int and < 2 sizes.
"""
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from _dist import run_ranks
from _models import TinyNet, batch, ddp_reference, flags, loss_fn, micro_steps, param_error, param_groups, HYPER
from fused_zero import ShardedOptimizer, ZeroConfig
from fused_zero import checkpoint as ckpt
from fused_zero.plan import estimate

OPTIONS = dict(**HYPER, stage=3, bucket_numel=1000, min_unit_numel=0)  # one unit per module: 11 units
K = 2  # micro-batches per step


def _planned(secondary_shard):
    with torch.device("meta"):
        model = TinyNet()
    plan = estimate(model=model, world_size=4, bucket_numel=1000, min_unit_numel=0, secondary_shard=secondary_shard)
    return plan.stage(3).detail


def _level(layout):
    with torch.device("meta"):
        model = TinyNet()
    plan = estimate(model=model, world_size=4, nodes=2, bucket_numel=1000, min_unit_numel=0)
    return next(r for r in plan.levels if (r.layout, r.stage) == (layout, 3))


def _refused(make) -> str | None:
    try:
        make()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _train(pairs, t, rank, clip=True):
    """One step of every (model, optimizer) pair, as tests/test_mesh.py's HSDP test steps."""
    for m, o in pairs:
        ours = isinstance(o, ShardedOptimizer)
        micro_steps(m, o, t, rank, k=K, sync_ctx=o.no_sync if ours else m.no_sync)
        if clip and t % 2:
            o.clip_grad_norm_(0.05) if ours else torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
        o.step()


def _hpz(rank, world_size, folder, offload_params):
    out = {}
    # refusals first: every rank raises, and the collectives after them still pair up
    out["divide"] = _refused(lambda: ShardedOptimizer(TinyNet(), **OPTIONS, secondary_shard=3))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out["hsdp"] = _refused(lambda: ShardedOptimizer(TinyNet(), **OPTIONS, mesh=mesh, secondary_shard=2))

    model = TinyNet(seed=rank)  # the optimizer takes rank 0's values, as DDP does
    ddp, ref_opt = ddp_reference(TinyNet(seed=0))
    opt = ShardedOptimizer(param_groups(model), **OPTIONS, module=model, secondary_shard=2,
                           offload_params=offload_params)
    errors, traffic, secondary = [], [], []
    for t in range(10):
        _train([(model, opt), (ddp, ref_opt)], t, rank)
        traffic.append(opt.comm_bytes())
        with opt.full_parameters():
            errors.append(param_error(model, ddp.module))
    # memory: the copies of the units the forward released, then none once the backward is done
    x, y = batch(10, rank)
    loss = loss_fn(model(x, **flags(10, rank)), y)
    secondary.append(opt.memory_bytes()["secondary"])
    loss.backward()
    secondary.append(opt.memory_bytes()["secondary"])
    opt.zero_grad()
    out.update(errors=errors, traffic=traffic, secondary=secondary)
    if offload_params is not None:
        opt.close()
        return out

    # a checkpoint saved with hpZ loads without it, and one saved without it loads with it
    tag = ckpt.save(folder, model, opt)
    plain_model = TinyNet(seed=7)
    plain = ShardedOptimizer(param_groups(plain_model), **OPTIONS, module=plain_model)
    ckpt.load(folder, plain_model, plain, tag=tag)
    _train([(model, opt), (plain_model, plain), (ddp, ref_opt)], 10, rank, clip=False)
    tag = ckpt.save(folder, plain_model, plain, tag="plain")
    back_model = TinyNet(seed=8)
    back = ShardedOptimizer(param_groups(back_model), **OPTIONS, module=back_model, secondary_shard=2)
    ckpt.load(folder, back_model, back, tag=tag)
    _train([(model, opt), (plain_model, plain), (back_model, back), (ddp, ref_opt)], 11, rank, clip=False)
    resumed = []
    for m, o in ((model, opt), (plain_model, plain), (back_model, back)):
        with o.full_parameters():
            resumed.append(param_error(m, ddp.module))
        o.close()
    out["resumed"] = resumed
    out["plain_traffic"] = plain.comm_bytes()
    return out


@pytest.mark.parametrize("offload_params", [None, "cpu"])
def test_hpz_equals_ddp_and_backward_gathers_stay_inside_a_node(offload_params, tmp_path):
    results = run_ranks(_hpz, 4, str(tmp_path), offload_params, timeout=300)
    hpz, flat = _planned(2), _planned(None)
    for r in results:
        assert r["divide"].startswith("ValueError") and "divide" in r["divide"] and "None" in r["divide"], r
        assert r["hsdp"].startswith("ValueError") and "not both" in r["hsdp"], r
        assert max(r["errors"]) < 1e-5, r["errors"]
        for t, traffic in enumerate(r["traffic"]):
            # across nodes: the forwards' gathers only (and, after the first step, the full_parameters() of the
            # check after the step before: every unit once, from the primary shards); inside a node: backward's
            forwards = K + (t > 0)
            assert traffic["all_gather"] == forwards * hpz["all_gather"], (t, traffic, hpz)
            assert traffic["secondary_all_gather"] == K * hpz["secondary_all_gather"] > 0, (t, traffic, hpz)
            assert forwards * hpz["all_gather"] + K * hpz["secondary_all_gather"] == \
                K * flat["all_gather"] + (t > 0) * hpz["all_gather"]  # flat ZeRO gathers as much, all across
            assert traffic["reduce_scatter"] == hpz["reduce_scatter"] and traffic["all_reduce"] == hpz["all_reduce"]
        assert r["secondary"] == [hpz["secondary"], 0] and hpz["secondary"] > 0, (r["secondary"], hpz["secondary"])
        # the planner's hpZ row of traffic per level (2 nodes x 2): one micro-batch's inside and across a node
        row = _level("hpz")
        traffic = r["traffic"][0]  # the first step: its K micro-batches, no full_parameters() before it
        assert K * row.inside == traffic["secondary_all_gather"] and row.secondary == hpz["secondary"]
        assert row.across == (traffic["all_gather"] // K + traffic["reduce_scatter"] + traffic["all_reduce"])
        assert row.across + row.inside == _level("flat").across  # flat ZeRO sends it all across
        if offload_params is None:
            assert max(r["resumed"]) < 1e-5, r["resumed"]
            assert "secondary_all_gather" not in r["plain_traffic"]


def test_hpz_refusals_name_the_fix():
    cases = {
        "stage": dict(stage=2, secondary_shard=2),
        "reshard": dict(stage=3, secondary_shard=2, reshard_after_forward=False),
        "type": dict(stage=3, secondary_shard=2.0),
        "bool": dict(stage=3, secondary_shard=True),
        "one": dict(stage=3, secondary_shard=1),
    }
    got = {k: _refused(lambda kw=kw: ZeroConfig(**kw)) for k, kw in cases.items()}
    assert got["stage"].startswith("ValueError") and "stage=3" in got["stage"], got
    assert got["reshard"].startswith("ValueError") and "reshard_after_forward=True" in got["reshard"], got
    assert got["type"].startswith("TypeError") and got["bool"].startswith("TypeError"), got
    assert got["one"].startswith("ValueError") and "None" in got["one"], got
    # the constructor takes it as a keyword (and refuses it there alike)
    assert _refused(lambda: ShardedOptimizer(TinyNet().parameters(), stage=2, secondary_shard=2)) == got["stage"]
    # a single rank: 2 does not divide 1
    single = _refused(lambda: ShardedOptimizer(TinyNet(), stage=3, secondary_shard=2))
    assert single.startswith("ValueError") and "divide" in single, single
