"""Stages 1-2 with offloaded optimizer states, built with the model and ``update_behind=True``: the host update
runs behind step(), bucket by bucket, and overlaps the next forward (with the parameters on a GPU; here on CPU through
``UpdateBehind.on_cpu``).

- ordering (world size 1, each tier, stages 1-2): with each bucket's update slowed down, the next forward's
  first module runs before the last bucket's update ended, and no module runs before the buckets of its own
  parameters were updated (and gathered); the parameters stay bitwise those of the run without offload;
- reads between steps (optimizer.state, state_dict(), read_shard, full_parameters(), model.state_dict(),
  model.load_state_dict, the next step) see the whole update, however slow; a parameter read directly is an
  empty placeholder until then, and one changed in place meanwhile raises, naming it;
- 2 gloo ranks: rank 0 alone saving model.state_dict() between steps needs nothing from rank 1 (the gathers
  run on the workers) and sees the updated parameters; comm_bytes() counts the gathers behind step() in their step;
- torch.compile: exact, and after the first compiled forward that meets a pending update the update stays
  inside step() and the graphs stop growing;
- a failed update (a full disk on one of 2 gloo ranks) raises on every rank at the next forward, leaves every
  rank's states, step counts and parameters as before the step, and training then goes on exactly as if that
  step had not been taken.
(Bitwise equality over 10 mixed steps at 2 ranks, every tier: tests/test_offload.py's "behind" cases.)
"""
import os
import time

import pytest
import torch
from torch import nn

from _behind import behind_on_cpu, slow_updates  # noqa: F401 (fixtures)
from _behind import batch as _batch, full as _full, model as _model, train_step as _train_step
from _behind import check_failed, fail_an_update, same_state, second_moments, step_beside
from _dist import run_ranks
from fused_zero import ShardedOptimizer
import fused_zero.behind as behind_module
from fused_zero.behind import UpdateBehind

TIERS = [dict(offload_optimizer="cpu"), dict(offload_optimizer="nvme")]


def _opt(model, folder, stage, **kw):
    """Built with the model (stages 1-2 then run the offloaded update behind step()); buckets split parameters."""
    if kw.get("offload_optimizer") == "nvme":
        kw["nvme_path"] = str(folder)
    return ShardedOptimizer(model, lr=1e-2, stage=stage, bucket_numel=500, offload_chunk_numel=192,
                            update_behind=True, **kw)


def _ref(model, stage):
    return ShardedOptimizer(model.parameters(), lr=1e-2, stage=stage, bucket_numel=500)


def test_the_update_runs_behind_step_only_when_asked_with_the_model(tmp_path):
    model = _model()
    assert ShardedOptimizer(model, lr=1e-2, stage=2, offload_optimizer="cpu")._stage.behind is None  # the default
    assert ShardedOptimizer(model, lr=1e-2, stage=1, offload_optimizer="cpu", update_behind=True)._stage.behind
    with pytest.raises(ValueError, match="update_behind=True needs the model"):
        ShardedOptimizer(model.parameters(), lr=1e-2, stage=2, offload_optimizer="cpu", update_behind=True)
    # without offload on one rank there is nothing to run behind step() (tests/test_gathers_behind.py: 2 ranks)
    assert ShardedOptimizer(model, lr=1e-2, stage=2, update_behind=True)._stage.behind is None
    with pytest.raises(ValueError, match="stage 3 already gathers each unit"):
        ShardedOptimizer(model, lr=1e-2, stage=3, offload_optimizer="cpu", update_behind=True)
    with pytest.raises(TypeError, match="update_behind must be True or False"):
        ShardedOptimizer(model, lr=1e-2, stage=2, offload_optimizer="cpu", update_behind=1)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("tier", TIERS, ids=["cpu", "nvme"])
def test_next_forward_runs_each_module_once_its_buckets_are_updated(stage, tier, tmp_path, slow_updates):
    model, ref = _model(), _model()
    opt, ref_opt = _opt(model, tmp_path, stage, **tier), _ref(ref, stage)
    buckets = opt._stage.buckets_behind
    assert buckets is not None and ref_opt._stage.behind is None
    log = opt._stage.behind.log = []
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for i, m in enumerate(linears):  # after the optimizer's own pre-hook (it is prepended)
        m.register_forward_pre_hook(lambda module, args, i=i: log.append(("ran", i)))
    keys_of = {i: {key for p in m.parameters() for key in buckets._keys_of[p]} for i, m in enumerate(linears)}
    for t in range(3):
        step_beside(model, opt, ref, ref_opt, t, log)
        assert all(p.numel() == 0 for p in model.parameters())  # placeholders until their buckets are in
        with torch.no_grad():  # the next forward (an evaluation one: it waits for every module's buckets too)
            out = model(_batch(99))
        updated = [k for e, k in log if e == "updated"]
        assert len(updated) == len(set(updated)) == len(buckets._members)
        assert updated == sorted(updated, key=buckets._rank.get)  # in the order the forward uses them
        assert log.index(("ran", 0)) < log.index(("updated", updated[-1]))  # the forward overlapped the update
        for i, keys in keys_of.items():  # and no module ran before its own buckets were updated
            assert all(log.index(("updated", k)) < log.index(("ran", i)) for k in keys)
        with torch.no_grad():
            assert torch.equal(out, ref(_batch(99)))
        assert all(torch.equal(a, b) for a, b in zip(_full(ref, ref_opt), _full(model, opt)))
    opt.close()


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("tier", TIERS, ids=["cpu", "nvme"])
def test_reads_between_steps_see_the_whole_update(stage, tier, tmp_path, slow_updates):
    ref = _model()
    ref_opt = _ref(ref, stage)
    for t in range(2):
        _train_step(ref, ref_opt, t)
    expect_sd = ref_opt.state_dict()
    expect = [p.detach().clone() for p in ref.parameters()]
    reads = {
        "state_dict": lambda m, o: o.state_dict()["state"],
        "read_shard": lambda m, o: second_moments(o),
        "full_parameters": lambda m, o: _full(m, o),
        "state": lambda m, o: [float(s["step"]) for s in o.state.values()],
        "model.state_dict": lambda m, o: list(m.state_dict().values()),
        "model.load_state_dict": lambda m, o: m.load_state_dict({k: v.clone() for k, v in ref.state_dict().items()}),
    }
    for name, read in reads.items():
        model = _model()
        opt = _opt(model, tmp_path, stage, **tier)
        for t in range(2):
            _train_step(model, opt, t)
        assert opt._stage.behind.pending, name
        got = read(model, opt)
        if name == "state_dict":
            assert same_state(got, expect_sd["state"]), name
        elif name == "read_shard":
            assert all(torch.equal(a, b) for a, b in zip(got, second_moments(ref_opt))), name
        elif name in ("full_parameters", "model.state_dict"):
            assert all(torch.equal(a, b) for a, b in zip(got, expect)), name
        elif name == "state":
            assert got == [2.0] * len(got), name
        assert not opt._stage.behind.pending, name
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), expect)), name  # whole again
        _train_step(model, opt, 2)  # and training goes on as the reference does
        opt.close()
    _train_step(ref, ref_opt, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_a_change_to_a_placeholder_raises_naming_the_parameter(tmp_path, slow_updates):
    model = _model()
    opt = _opt(model, tmp_path, 2, **TIERS[0])
    _train_step(model, opt, 0)
    with torch.no_grad():
        model[3][0].weight.mul_(0.5)  # in place, while its bucket's update still runs: it went nowhere
    with pytest.raises(RuntimeError, match=r"3\.0\.weight.*changed in place between step\(\)"):
        model(_batch(1))
    opt.close()


def _one_rank_reads(rank, world_size, folder, stage):
    UpdateBehind.on_cpu = True
    model, ref = _model(), _model()
    opt, ref_opt = _opt(model, folder, stage, offload_optimizer="cpu"), _ref(ref, stage)
    real = behind_module.run_job

    def slow(job):
        time.sleep(0.02 if rank == 1 else 0.0)  # rank 1's worker lags: rank 0's read must not need it
        real(job)
    behind_module.run_job = slow
    saved = []
    for t in range(3):
        _train_step(model, opt, t, rank)
        _train_step(ref, ref_opt, t, rank)
        if rank == 0:  # rank 0 alone saves the model between steps (a collective here would hang)
            saved.append([v.clone() for v in model.state_dict().values()])
    behind_module.run_job = real
    traffic = opt.comm_bytes() == ref_opt.comm_bytes()  # the gathers behind step() counted in their step
    out = {"traffic": traffic, "equal": all(torch.equal(a, b) for a, b in zip(_full(model, opt), ref.parameters())),
           "saved": rank == 1 or all(torch.equal(a, b) for a, b in zip(saved[-1], ref.state_dict().values()))}
    opt.close()
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_one_rank_reading_between_steps_needs_no_other_rank(stage, tmp_path):
    for r in run_ranks(_one_rank_reads, 2, str(tmp_path), stage, timeout=180):
        assert r["equal"] and r["saved"] and r["traffic"], r


def _failed_update(rank, world_size, folder, stage):
    UpdateBehind.on_cpu = True
    folder = os.path.join(folder, f"rank{rank}")
    os.makedirs(folder, exist_ok=True)
    model, ref = _model(), _model()
    opt, ref_opt = _opt(model, folder, stage, offload_optimizer="nvme"), _ref(ref, stage)
    # three writes per block (one per state kind): some buckets are updated and gathered before the failure
    return fail_an_update(model, opt, ref, ref_opt, rank, writes=20)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_failed_update_raises_on_every_rank_and_is_undone(stage, tmp_path):
    """The failure comes after some buckets were updated and gathered on every rank: undone, they are gathered
    again with the values before the step."""
    r0, r1 = run_ranks(_failed_update, 2, str(tmp_path), stage, timeout=180)
    check_failed(r0, r1)
    assert r0["updated"] >= 2 and r1["updated"] >= 2, (r0, r1)


def test_a_compiled_model_trains_exactly_and_stops_recompiling(tmp_path):
    """torch.compile: the first forward with an update pending runs its hooks from compiled code, which marks the
    model compiled; from then on the update stays inside step() (placeholders and hooks would make every compiled
    forward recompile), and the graphs stop growing."""
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    model, ref = _model(), _model()
    opt, ref_opt = _opt(model, tmp_path, 2, **TIERS[0]), _ref(ref, 2)
    compiled = torch.compile(model, backend="aot_eager")
    graphs = []
    for t in range(5):
        _train_step(compiled, opt, t)
        _train_step(ref, ref_opt, t)
        graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
    assert opt._stage.buckets_behind.compiled and not opt._stage.behind.pending
    assert graphs[2:] == [graphs[1]] * 3, graphs
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    opt.close()
