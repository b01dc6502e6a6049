"""fp32 parameters at stages 1-2: the master is the parameters' own slices (tiers.store.ParamsAsMaster).

No separate fp32 copy: the update writes the parameters in place, the all-gather's input is this rank's
slice of its own output, reads and writes of the "master" (checkpoints, a reload after user code changed
the weights) go to the parameters, and update chunks stop at bucket edges. Training stays bitwise that of
torch's AdamW (world size 1) and DDP + AdamW (2 ranks) where user code also edits the weights between steps.
"""
import pytest
import torch

from _dist import run_ranks
from _models import HYPER, PlainNet, ddp_reference, micro_steps, param_error, param_groups, rank_slice
from fused_zero import ShardedOptimizer
from fused_zero.tiers.store import ParamsAsMaster

BUCKET = 1000  # splits PlainNet's larger weights across buckets


def _flat_own(part):
    return rank_slice(part, part.flat, part.rank)


def _layout_checks(opt) -> None:
    for part in opt.partitions:
        store = part.store
        assert isinstance(store, ParamsAsMaster) and part.pshard is None and "master" not in store.tensors
        n = part.layout.shard_numel
        assert torch.equal(store.read("master", 0, n), _flat_own(part))
        for b in part.layout.buckets:  # the gather is in place: its input is its own output's slice
            src, out = part.gather_source(b), part.bucket(part.flat, b)[part.own(b)]
            assert src.data_ptr() == out.data_ptr() and src.numel() == out.numel()
        edges = store.edges()
        assert edges == [b.shard_offset for b in part.layout.buckets[1:]]
        for a, z in part.update_ranges([(0, n)]):  # the update's chunks never cross a bucket edge
            assert not any(a < e < z for e in edges), (a, z, edges)
        if edges:  # a write across an edge reaches the parameters on both sides, a read gives it back
            e = edges[0]
            lo, hi = max(0, e - 5), min(n, e + 7)
            old = store.read("master", lo, hi)
            store.write("master", lo, old + 1)
            assert torch.equal(_flat_own(part)[lo:hi], old + 1)
            assert torch.equal(store.read("master", lo, hi), old + 1)
            store.write("master", lo, old)
            assert torch.equal(_flat_own(part), store.read("master", 0, n))
    assert opt.memory_bytes()["master"] == 0


def _edit(model, t: int) -> None:
    """What user code does between steps: an in-place write, and a load_state_dict."""
    with torch.no_grad():
        if t == 2:
            for p in model.parameters():
                p.mul_(0.5)
        if t == 4:
            model.load_state_dict({k: v * 1.25 for k, v in model.state_dict().items()})


@pytest.mark.parametrize("stage", [1, 2])
def test_one_rank_is_torch_adamw_bitwise(stage):
    model, ref = PlainNet(), PlainNet()
    opt = ShardedOptimizer(param_groups(model), **HYPER, stage=stage, bucket_numel=BUCKET)
    ref_opt = torch.optim.AdamW(param_groups(ref), **HYPER, fused=True)
    _layout_checks(opt)
    for t in range(6):
        _edit(model, t)
        _edit(ref, t)
        micro_steps(model, opt, t, 0)
        micro_steps(ref, ref_opt, t, 0)
        opt.step()
        ref_opt.step()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), (t, n)
    _layout_checks(opt)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()  # the saved moments are torch's
    assert sd["state"].keys() == ref_sd["state"].keys()
    for i, s in ref_sd["state"].items():
        assert torch.equal(sd["state"][i]["exp_avg_sq"], s["exp_avg_sq"]), i
    opt.close()


def _ranks(rank, world_size, stage):
    torch.manual_seed(0)
    model = PlainNet()
    ddp, ref_opt = ddp_reference(model)
    opt = ShardedOptimizer(param_groups(model), **HYPER, stage=stage, bucket_numel=BUCKET)
    _layout_checks(opt)
    errors = []
    for t in range(6):
        _edit(model, t)
        _edit(ddp.module, t)
        micro_steps(model, opt, t, rank, k=2, sync_ctx=opt.no_sync)
        micro_steps(ddp, ref_opt, t, rank, k=2, sync_ctx=ddp.no_sync)
        if t == 3:
            opt.clip_grad_norm_(0.1)
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.1)
        opt.step()
        ref_opt.step()
        errors.append(param_error(model, ddp.module))
    _layout_checks(opt)
    opt.close()
    return errors


@pytest.mark.parametrize("stage", [1, 2])
def test_two_ranks_match_ddp(stage):
    for errors in run_ranks(_ranks, 2, stage, timeout=180):
        assert max(errors) < 1e-6, errors
