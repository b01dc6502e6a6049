"""ZeRO on a device mesh (``mesh=``): hybrid sharding, the data-parallel dimension of a tp x dp mesh, and
what is refused.

HSDP: 4 gloo ranks as 2 replicas x 2 shards (a ("replicate", "shard") mesh stands for 2 nodes x 2 GPUs):
stages 1-3 equal DDP over all 4 ranks + torch.optim.AdamW to 1e-5 over 10 steps (TinyNet: odd sizes,
three param groups, a frozen parameter, a branch unused on even steps and a parameter unused on one rank,
two micro-batches accumulated under no_sync, clip_grad_norm_ every other step), and at stages 2-3 with
the optimizer states offloaded (the gradient shard copied down, the stage-3 update behind step()); every
all-gather and
reduce-scatter stays inside the shard group, and only the reduced gradient shards cross between replicas
(``comm_bytes()``'s "replicate_all_reduce", the same on every rank), each key as the planner's HSDP row of
traffic per level predicts (``Plan.levels``: inside a node, across nodes). A checkpoint of the HSDP optimizer
(written by one replica: one file per shard) loads on 4 flat ranks and on the 2 x 2 mesh again, and both
go on equal to DDP; it also loads in one process with no process group (parameters bitwise as saved, and at
stages 1-2 the state_dict() the ranks gave at the save) and consolidates into a model and AdamW state_dict.

4 gloo ranks as a 2 x 2 ("tp", "dp") mesh, the ZeRO paper's 3-D layout in small: a Megatron-style MLP
whose first Linear is column-parallel and second row-parallel over "tp" (hand-written, its all-reduce's
backward the identity), ZeRO-1 and ZeRO-2 over ``mesh["dp"]``. After 10 steps (odd sizes, two param
groups, a 1000-element bucket that splits parameters, two micro-batches accumulated under no_sync) every
rank's tensor-parallel shards equal the unsharded model trained by torch.optim.AdamW in one process on
both data-parallel batches, to 1e-5. Refused on every rank, naming the fix: a mesh that is not a
DeviceMesh, mesh= with process_group=, a 2-D mesh of other names, a mesh of another device type, ranks of one group passing differently named
meshes, and ranks given groups that would not pair (an HSDP mesh on some ranks and none or a flat one on others, a
group on some and none on others, optimizers built in another order): through the store, before any collective.
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from _dist import run_ranks
from _models import TinyNet, ddp_reference, micro_steps, param_error, param_groups, HYPER
from fused_zero import ShardedOptimizer
from fused_zero import checkpoint as ckpt
from fused_zero.behind import UpdateBehind
from fused_zero.comm.grad_buckets import BucketPipe
from fused_zero.plan import estimate

D, H, OUT, BATCH = 13, 22, 5, 6  # odd sizes: the tp halves of H are 11
LR = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8)


class _SumOverTP(torch.autograd.Function):
    """Row-parallel output: all-reduce (sum) forward, identity backward (every tp rank's gradient is whole)."""

    @staticmethod
    def forward(ctx, y, group):
        y = y.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _full_weights():
    g = torch.Generator().manual_seed(0)
    return {"w1": torch.randn(H, D, generator=g) * 0.3, "b1": torch.randn(H, generator=g) * 0.1,
            "w2": torch.randn(D, H, generator=g) * 0.3, "b2": torch.randn(D, generator=g) * 0.1,
            "head": torch.randn(OUT, D, generator=g) * 0.3}


class MLP(nn.Module):
    """The whole model (tp_size 1), or this tp rank's shards of it: w1, b1 by rows, w2 by columns."""

    def __init__(self, tp_rank=0, tp_size=1, group=None):
        super().__init__()
        full, n = _full_weights(), H // tp_size
        rows = slice(tp_rank * n, (tp_rank + 1) * n)
        self.w1 = nn.Parameter(full["w1"][rows].clone())
        self.b1 = nn.Parameter(full["b1"][rows].clone())
        self.w2 = nn.Parameter(full["w2"][:, rows].clone())
        self.b2 = nn.Parameter(full["b2"].clone())
        self.head = nn.Parameter(full["head"].clone())
        self.group, self.tp_size = group, tp_size

    def forward(self, x):
        y = F.gelu(x @ self.w1.T + self.b1) @ self.w2.T
        if self.tp_size > 1:
            y = _SumOverTP.apply(y, self.group)
        return torch.tanh(y + self.b2) @ self.head.T


def _batch(t, dp_rank, micro):
    g = torch.Generator().manual_seed(100 * t + 10 * dp_rank + micro)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, OUT, generator=g)


def _groups(model):
    return [{"params": [model.w1, model.w2, model.head]}, {"params": [model.b1, model.b2], "weight_decay": 0.0}]


def _tp_dp(rank, world_size, stage):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
    tp, dp = mesh["tp"], mesh["dp"]
    model = MLP(tp.get_local_rank(), 2, tp.get_group())
    opt = ShardedOptimizer(_groups(model), **LR, weight_decay=0.05, stage=stage, bucket_numel=100, mesh=dp)
    ref = MLP()
    ref_opt = torch.optim.AdamW(_groups(ref), **LR, weight_decay=0.05, foreach=False)
    for t in range(10):
        opt.zero_grad()
        with opt.no_sync():
            x, y = _batch(t, dp.get_local_rank(), 0)
            (F.mse_loss(model(x), y) / 2).backward()
        x, y = _batch(t, dp.get_local_rank(), 1)
        (F.mse_loss(model(x), y) / 2).backward()
        opt.step()
        ref_opt.zero_grad()
        for d in range(2):  # the same data, in one process: the mean over both dp ranks' micro-batches
            for micro in range(2):
                x, y = _batch(t, d, micro)
                (F.mse_loss(ref(x), y) / 4).backward()
        ref_opt.step()
    n, i = H // 2, tp.get_local_rank()
    want = {"w1": ref.w1[i * n:(i + 1) * n], "b1": ref.b1[i * n:(i + 1) * n], "w2": ref.w2[:, i * n:(i + 1) * n],
            "b2": ref.b2, "head": ref.head}
    err = max(((getattr(model, k) - v).abs().max() / v.abs().max()).item() for k, v in want.items())
    opt.close()
    return err


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_on_the_dp_dimension_of_a_tp_dp_mesh_equals_the_unsharded_run(stage):
    errors = run_ranks(_tp_dp, 4, stage, timeout=180)
    assert max(errors) < 1e-5, errors


def _refusals(rank, world_size):
    out = {}
    params = list(MLP().parameters())

    def refused(**kw):
        try:
            ShardedOptimizer(params, **kw)
        except (TypeError, ValueError) as e:
            return f"{type(e).__name__}: {e}"
        return None
    out["not a mesh"] = refused(mesh=dist.group.WORLD)
    one_d = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    out["mesh as group"] = refused(process_group=one_d)  # FSDP's habit of passing the mesh where a group goes
    out["str as group"] = refused(process_group="gloo")
    out["both"] = refused(mesh=one_d, process_group=dist.group.WORLD)
    out["2-D"] = refused(mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp")))
    try:  # a CUDA mesh over CPU parameters (where torch lets a CUDA mesh be described without a GPU)
        cuda_mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda", mesh_dim_names=("dp",))
    except Exception:
        cuda_mesh = None
    out["device"] = refused(mesh=cuda_mesh) if cuda_mesh is not None else "(no CUDA mesh here) 'cuda'"
    # ranks that pass differently named meshes over one group: refused on every rank
    other = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("dp" if rank else "data",))
    try:
        ShardedOptimizer(params, mesh=other)
        out["differ"] = None
    except ValueError as e:
        out["differ"] = str(e)
    opt = ShardedOptimizer(MLP().parameters(), mesh=one_d, stage=2)  # a 1-D mesh: its group
    out["world"] = opt.comm.world_size
    opt.close()
    return out


def test_bad_meshes_are_refused_on_every_rank_with_the_fix():
    for r in run_ranks(_refusals, 4, timeout=180):
        assert r["not a mesh"].startswith("TypeError") and "DeviceMesh" in r["not a mesh"]
        assert r["mesh as group"].startswith("TypeError") and "goes to mesh=" in r["mesh as group"]
        assert r["str as group"].startswith("TypeError") and "got str" in r["str as group"]
        assert r["both"].startswith("ValueError") and "not both" in r["both"]
        assert 'mesh["dp"]' in r["2-D"]
        assert "'cuda'" in r["device"]
        assert r["differ"] is not None and "mesh" in r["differ"]
        assert r["world"] == 4


def _given_groups(rank, world_size, how):
    """Each rank builds with the groups ``how`` gives it (every rank makes every group and mesh, as torch needs)."""
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    world_again = dist.new_group([0, 1, 2, 3])
    first_three, first_two = dist.new_group([0, 1, 2]), dist.new_group([0, 1])
    given = {
        "an HSDP mesh on some ranks, none on others": [{"mesh": hsdp}] * 2 + [{}] * 2,
        "an HSDP mesh on some ranks, a flat one on others": [{"mesh": hsdp}] * 2 + [{"mesh": flat}] * 2,
        "a flat mesh on one rank": [{"mesh": hsdp}] * 3 + [{"mesh": flat}],
        "a group over every rank on some, none on others": [{"process_group": world_again}] * 2 + [{}] * 2,
        "a group over three ranks on one, none on the others": [{"process_group": first_three}] + [{}] * 3,
    }
    try:
        if how == "optimizers built in another order":  # rank 1 builds the world's optimizer first
            order = [[{"process_group": first_two}, {}], [{}, {"process_group": first_two}], [{}], [{}]][rank]
            for kw in order:
                ShardedOptimizer(MLP().parameters(), stage=2, **kw)
        elif how == "a subgroup's optimizer first, then the world's":  # served: ranks 2-3 wait for 0-1
            if rank < 2:
                ShardedOptimizer(MLP().parameters(), stage=2, process_group=first_two)
            ShardedOptimizer(MLP().parameters(), stage=2)
        else:
            ShardedOptimizer(MLP().parameters(), stage=2, **given[how][rank])
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("how", [
    "an HSDP mesh on some ranks, none on others", "an HSDP mesh on some ranks, a flat one on others",
    "a flat mesh on one rank", "a group over every rank on some, none on others",
    "a group over three ranks on one, none on the others", "optimizers built in another order",
    "a subgroup's optimizer first, then the world's"])
def test_ranks_given_different_groups_are_refused_on_every_rank_before_any_collective(how):
    """Their collectives would run over groups that never pair (waiting until the group's timeout): each rank's
    groups are compared through the store first, and every rank raises, naming two ranks' groups and the fix."""
    results = run_ranks(_given_groups, 4, how, timeout=90)
    if how.startswith("a subgroup's"):
        assert results == [None] * 4
        return
    for message in results:
        assert message is not None and "given different groups" in message, results
        assert "pass the same process_group= or mesh= on every rank" in message, message


def _hsdp(rank, world_size, stage, folder, offload=None):
    BucketPipe.copy_down = UpdateBehind.on_cpu = True  # offloaded: the GPU's ways (copy down, update behind)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = TinyNet(seed=rank)  # different on every rank: the optimizer takes rank 0's values, as DDP does
    ddp, ref_opt = ddp_reference(TinyNet(seed=0))
    opt = ShardedOptimizer(param_groups(model), **HYPER, stage=stage, bucket_numel=1000, mesh=mesh,
                           module=model if stage == 3 else None, offload_optimizer=offload)
    errors, traffic = [], []
    for t in range(10):
        micro_steps(model, opt, t, rank, k=2, sync_ctx=opt.no_sync)
        micro_steps(ddp, ref_opt, t, rank, k=2, sync_ctx=ddp.no_sync)
        if t % 2:
            opt.clip_grad_norm_(0.05)
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05)
        opt.step()
        ref_opt.step()
        traffic.append(opt.comm_bytes())
        with opt.full_parameters():
            errors.append(param_error(model, ddp.module))
    # a checkpoint written by the first replica loads on 4 flat ranks, and back on the 2 x 2 mesh
    tag = ckpt.save(folder, model, opt)
    with opt.full_parameters():  # what the checkpoint holds: one rank loads it alone below (the test)
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
        saved_state = opt.state_dict() if stage < 3 else None
    flat_model = TinyNet(seed=7)
    flat = ShardedOptimizer(param_groups(flat_model), **HYPER, stage=stage, bucket_numel=1000,
                            module=flat_model if stage == 3 else None)
    ckpt.load(folder, flat_model, flat, tag=tag)
    hsdp_model = TinyNet(seed=8)
    hsdp = ShardedOptimizer(param_groups(hsdp_model), **HYPER, stage=stage, bucket_numel=1000, mesh=mesh,
                            module=hsdp_model if stage == 3 else None, offload_optimizer=offload)
    ckpt.load(folder, hsdp_model, hsdp, tag=tag)
    for t in range(10, 12):  # all three go on in lockstep with DDP
        for m, o in ((model, opt), (flat_model, flat), (hsdp_model, hsdp)):
            micro_steps(m, o, t, rank, k=2, sync_ctx=o.no_sync)
            o.step()
        micro_steps(ddp, ref_opt, t, rank, k=2, sync_ctx=ddp.no_sync)
        ref_opt.step()
    resumed = []
    for m, o in ((model, opt), (flat_model, flat), (hsdp_model, hsdp)):
        with o.full_parameters():
            resumed.append(param_error(m, ddp.module))
        o.close()
    files = sorted(os.listdir(os.path.join(folder, tag)))
    return max(errors), traffic[-1], resumed, files, tag, saved, saved_state


def _load_alone(stage: int, folder: str, tag: str) -> tuple[dict, dict, ShardedOptimizer]:
    """The HSDP checkpoint loaded by one process with no process group (world size 1)."""
    model = TinyNet(seed=9)
    opt = ShardedOptimizer(param_groups(model), **HYPER, stage=stage, bucket_numel=1000,
                           module=model if stage == 3 else None)
    ckpt.load(folder, model, opt, tag=tag)
    with opt.full_parameters():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, opt.state_dict(), opt


@pytest.mark.parametrize("stage,offload", [(1, None), (2, None), (3, None), (2, "cpu"), (3, "cpu")])
def test_hsdp_equals_ddp_over_every_rank(stage, offload, tmp_path):
    results = run_ranks(_hsdp, 4, stage, str(tmp_path), offload, timeout=240)
    for err, traffic, resumed, files, *_ in results:
        assert err < 1e-5, [r[0] for r in results]
        assert traffic["replicate_all_reduce"] > 0  # the reduced shards, across the replicas
        assert max(resumed) < 1e-5, resumed  # resumed from the checkpoint: flat 4 ranks and HSDP again
        assert sorted(f for f in files if f.startswith("shards-")) == [f"shards-rank{r:05d}-of-00002.safetensors" for r in (0, 1)], files  # one replica wrote its 2 shards
    assert len({r[1]["replicate_all_reduce"] for r in results}) == 1
    # the planner's HSDP row (shard group = a node of 2): what crosses nodes and what stays inside, per key
    with torch.device("meta"):
        model = TinyNet()
    row = next(r for r in estimate(model=model, world_size=4, nodes=2, bucket_numel=1000).levels
               if (r.layout, r.stage) == ("hsdp", stage))
    keys = ["replicate_all_reduce", "reduce_scatter", "all_reduce"] + (["all_gather"] if stage < 3 else [])
    for _, traffic, *_ in results:  # (stage 3's all-gathers count each micro-batch and the full_parameters() check)
        assert {k: traffic[k] for k in keys} == {k: row.comm[k] for k in keys}, (traffic, row)
        assert row.across == traffic["replicate_all_reduce"]
    # ... and on one rank alone: the parameters bitwise as saved, the optimizer state as the ranks' state_dict()
    tag, saved, saved_state = results[0][4:]
    params, state, opt = _load_alone(stage, str(tmp_path), tag)
    for name, value in saved.items():
        assert torch.equal(params[name], value), name
    if saved_state is not None:
        for i, s in saved_state["state"].items():
            for key, value in s.items():
                assert torch.equal(state["state"][i][key], value), (i, key)
    opt.close()
    model_sd, optim_sd = ckpt.consolidate(str(tmp_path), tag)  # and consolidates into torch's formats
    for name, value in saved.items():
        assert torch.equal(model_sd[name], value), name
    assert optim_sd["state"].keys() == state["state"].keys()


def _lone_calls_under_hsdp(rank, world_size, shape, call, folder):
    from fused_zero import checkpoint
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    model = MLP()
    opt = ShardedOptimizer(_groups(model), module=model, stage=2, mesh=mesh)

    def step(t):
        opt.zero_grad()
        x, y = _batch(t, rank, 0)
        F.mse_loss(model(x), y).backward()
        opt.step()
    step(0)
    sd = opt.state_dict()
    checkpoint.save(folder, model, opt, tag="first")
    step(1)
    error = None
    if rank == 0:  # one rank alone: one replica group of a (4, 1) mesh, half of one of a (2, 2) mesh
        try:
            {"load_state_dict": lambda: opt.load_state_dict(sd),
             "checkpoint.save": lambda: checkpoint.save(folder, model, opt, tag="lone"),
             "checkpoint.load": lambda: checkpoint.load(folder, model, opt, tag="first")}[call]()
        except RuntimeError as e:
            error = str(e)
    step(2)  # nothing was disturbed: the replicas stay identical
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = [torch.empty_like(params) for _ in range(world_size)]
    dist.all_gather(everyone, params)
    return error, all(torch.equal(everyone[0], e) for e in everyone)


@pytest.mark.parametrize("shape", [(4, 1), (2, 2)])
@pytest.mark.parametrize("call", ["load_state_dict", "checkpoint.save", "checkpoint.load"])
def test_hsdp_lone_calls_are_refused_and_replicas_stay_identical(shape, call, tmp_path):
    """The collective calls meet over every rank of the mesh, not one shard group: under a (4, 1) mesh (shard
    groups of one rank) rank 0's lone load_state_dict() was taken alone and left the replicas apart."""
    results = run_ranks(_lone_calls_under_hsdp, 4, shape, call, str(tmp_path), timeout=180)
    assert results[0][0] is not None and f"{call}() is collective" in results[0][0], results[0][0]
    assert all(same for _, same in results)


def _lone_call_under_subgroups(rank, world_size, folder, how):
    """Global rank 2 alone saves a checkpoint while its group of 2 trains on: the refusal names the peer by its
    global rank (3), not by its rank inside the group (1, a rank of the other group)."""
    if how == "groups":
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        kw = {"process_group": groups[rank // 2]}
    else:  # the dp sub-mesh of a (tp, dp) mesh: dp groups {0, 1} and {2, 3}
        kw = {"mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))["dp"]}
    model = MLP()
    opt = ShardedOptimizer(model.parameters(), stage=2, **kw)
    error = None
    for t in range(2):
        opt.zero_grad()
        x, y = _batch(t, rank, 0)
        F.mse_loss(model(x), y).backward()
        opt.step()
        if t == 0 and rank == 2:
            try:
                ckpt.save(folder, model, opt)
            except RuntimeError as e:
                error = str(e)
    opt.close()
    return error


@pytest.mark.parametrize("how", ["groups", "dp sub-mesh"])
def test_a_lone_call_under_subgroups_names_the_global_rank(how, tmp_path):
    results = run_ranks(_lone_call_under_subgroups, 4, str(tmp_path), how, timeout=120)
    assert results[2] is not None and "rank(s) [3] did not call it" in results[2], results[2]
    assert results[:2] == [None, None] and results[3] is None


def _mesh_without_this_rank(rank, world_size):
    mesh = DeviceMesh("cpu", [0, 1])
    try:
        ShardedOptimizer(MLP().parameters(), mesh=mesh)
    except ValueError as e:
        return str(e)
    return None


def test_a_mesh_without_this_rank_is_refused_there():
    results = run_ranks(_mesh_without_this_rank, 4, timeout=120)
    assert results[:2] == [None, None]
    assert all(r is not None and "not this rank" in r for r in results[2:]), results


# --- HSDP with everyday habits: two optimizers, options differing on one rank, a frozen base out of the groups --

class _TwoPart(nn.Module):
    """An embedding-like input layer and a head (optimizer A) around a trunk of blocks (optimizer B)."""

    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.inp = nn.Linear(D, H)
        self.trunk = nn.Sequential(*(nn.Sequential(nn.Linear(H, H), nn.Tanh()) for _ in range(3)))
        self.head = nn.Linear(H, OUT)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x):
        return self.head(self.trunk(self.inp(x)))


def _two_optimizers_hsdp(rank, world_size, stage_a, stage_b):
    from torch.nn.parallel import DistributedDataParallel as DDP
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, ref = _TwoPart(), DDP(_TwoPart())
    split = lambda m: ([p for n, p in m.named_parameters() if not n.startswith("trunk.")], list(m.trunk.parameters()))
    a, b = split(model)
    ra, rb = split(ref.module)
    kw_b = dict(module=model.trunk, min_unit_numel=0) if stage_b == 3 else {}
    opt_a = ShardedOptimizer(a, stage=stage_a, mesh=mesh, bucket_numel=300, weight_decay=0.1, **LR)
    opt_b = ShardedOptimizer(b, stage=stage_b, mesh=mesh, bucket_numel=300, weight_decay=0.0, **LR, **kw_b)
    ref_a = torch.optim.AdamW(ra, weight_decay=0.1, **LR)
    ref_b = torch.optim.AdamW(rb, weight_decay=0.0, **LR)
    for t in range(4):
        x = torch.randn(BATCH, D, generator=torch.Generator().manual_seed(10 * t + rank))
        model(x).square().mean().backward()
        ref(x).square().mean().backward()
        norms = [float(opt_a.clip_grad_norm_(0.3)), float(opt_b.clip_grad_norm_(0.3))]
        ref_norms = [float(torch.nn.utils.clip_grad_norm_(ra, 0.3)), float(torch.nn.utils.clip_grad_norm_(rb, 0.3))]
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        for o in (opt_a, opt_b, ref_a, ref_b):
            o.step()
            o.zero_grad()
    with opt_b.full_parameters() if stage_b == 3 else torch.no_grad():
        error = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.module.parameters()))
    opt_a.close(), opt_b.close()
    return error


@pytest.mark.parametrize("stage_a,stage_b", [(1, 2), (2, 2), (2, 3)])
def test_two_optimizers_over_one_hsdp_mesh_train_as_ddp(stage_a, stage_b):
    """Each optimizer reduces over groups of its own, the replicas' too: before, the second reduced its buckets
    over the first's replicate group, the two interleaved as their buckets landed, and gloo aborted on
    mismatched sizes (or equal sizes would have mixed the two models' gradients)."""
    errors = run_ranks(_two_optimizers_hsdp, 4, stage_a, stage_b, timeout=180)
    assert max(errors) < 1e-5, errors


def _one_rank_differs_under_hsdp(rank, world_size, what):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    kw = dict(stage=2, mesh=mesh, lr=1e-2)
    if rank == 3:
        kw.update({"lr": 2e-3} if what == "lr" else {"stage": 1})
    try:
        ShardedOptimizer(MLP().parameters(), **kw)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("what", ["lr", "stage"])
def test_an_option_differing_on_one_rank_under_hsdp_is_refused_on_every_rank(what):
    """Before, the shard group holding rank 3 raised and the other one waited for it in the replicas' check."""
    for message in run_ranks(_one_rank_differs_under_hsdp, 4, what, timeout=120):
        assert message is not None and "differ across ranks" in message and "rank 3 has" in message, message


def _frozen_outside_the_groups(rank, world_size, stage, hsdp):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    model = _TwoPart(seed=rank)  # every rank starts elsewhere, as DDP allows
    model.trunk.requires_grad_(False)  # a frozen base, left out of the groups (peft's habit)
    opt = ShardedOptimizer([p for p in model.parameters() if p.requires_grad], module=model, stage=stage,
                           mesh=mesh, lr=1e-2)
    values = torch.cat([p.detach().flatten() for p in model.parameters()])
    opt.close()
    return values


@pytest.mark.parametrize("stage,hsdp", [(1, False), (2, False), (2, True)])
def test_the_build_gives_frozen_parameters_outside_the_groups_rank_0s_values(stage, hsdp):
    """As DDP's constructor does for every parameter of the module; before, stages 1-2 broadcast only the
    parameters in the groups, and the ranks trained on different frozen weights."""
    values = run_ranks(_frozen_outside_the_groups, 4, stage, hsdp, timeout=120)
    want = torch.cat([p.detach().flatten() for p in _TwoPart(seed=0).parameters()])
    for v in values:
        assert torch.equal(v, want)


def _dtensor_params(rank, world_size):
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    model = parallelize_module(torch.nn.Linear(8, 6), mesh, ColwiseParallel())
    try:
        ShardedOptimizer(model.parameters(), lr=1e-3)
    except TypeError as e:
        return str(e)
    return None


def test_dtensor_parameters_from_torchs_tensor_parallel_are_refused_naming_the_way():
    """parallelize_module's DTensor parameters: refused when built, naming the hand-sharded path (before: "share
    memory (views of one tensor)" from every DTensor's data_ptr, or torch's "mixed torch.Tensor and DTensor")."""
    for message in run_ranks(_dtensor_params, 2, timeout=120):
        assert message is not None and "is a DTensor" in message and "mesh['dp']" in message, message


def _clip_over_dp_warns(rank, world_size):
    import warnings
    out = {}
    for name, mesh in (("tp x dp", init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))["dp"]),
                       ("hsdp", init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))):
        for how in ("clip", "max_grad_norm"):
            model = MLP()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt = ShardedOptimizer(model.parameters(), **LR, mesh=mesh,
                                       **({"max_grad_norm": 1.0} if how == "max_grad_norm" else {}))
                x, y = _batch(0, rank, 0)
                F.mse_loss(model(x), y).backward()
                for _ in range(2):
                    if how == "clip":
                        opt.clip_grad_norm_(1.0)
                opt.step()
            out[name, how] = sum("drift apart" in str(w.message) for w in caught)
            opt.close()
    return out


def test_a_norm_clip_over_the_dp_sub_mesh_of_a_tp_dp_mesh_warns_once():
    """clip_grad_norm_() and max_grad_norm over mesh["dp"] of a tp x dp mesh measure the dp group's norm only (the tp
    ranks' slices are not summed, so they clip apart and drift, mesh port): warned once per optimizer, saying so;
    an HSDP mesh (every rank of the root) is not warned."""
    for out in run_ranks(_clip_over_dp_warns, 4, timeout=180):
        assert out == {("tp x dp", "clip"): 1, ("tp x dp", "max_grad_norm"): 1,
                       ("hsdp", "clip"): 0, ("hsdp", "max_grad_norm"): 0}, out
