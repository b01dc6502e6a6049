"""Stage 3 with offloaded optimizer states: the host update runs behind step() and overlaps the next forward
(with the parameters on a GPU; here on CPU through ``UpdateBehind.on_cpu``).

- ordering (world size 1, each tier, with and without offload_params): with each unit's update slowed
  down, the next forward gathers the root before the last unit's update ended, and no unit is gathered
  before its own update ended on this rank; the parameters stay bitwise those of the run without offload;
- reads between steps (optimizer.state, state_dict(), read_shard, full_parameters(), model.load_state_dict,
  the next step) see the whole update, however slow;
- a failed update (a full disk on one of 2 gloo ranks) raises on every rank at the next forward, leaves
  every rank's states, step counts and parameters as before the step, and training then goes on
  exactly as if that step had not been taken.
(Bitwise equality over 10 mixed steps at 2 ranks, every tier: tests/test_offload.py.)
"""
import os

import pytest
import torch

from _behind import behind_on_cpu, slow_updates  # noqa: F401 (fixtures)
from _behind import batch as _batch, full as _full, model as _model, train_step as _train_step
from _behind import check_failed, fail_an_update, same_state, second_moments, step_beside
from _dist import run_ranks
from fused_zero import ShardedOptimizer
from fused_zero.behind import UpdateBehind

TIERS = [dict(offload_optimizer="cpu"), dict(offload_optimizer="nvme"),
         dict(offload_optimizer="cpu", offload_params="cpu"), dict(offload_optimizer="nvme", offload_params="nvme")]


def _opt(model, folder, **kw):
    if "nvme" in (kw.get("offload_optimizer"), kw.get("offload_params")):
        kw["nvme_path"] = str(folder)
    return ShardedOptimizer(model, lr=1e-2, stage=3, min_unit_numel=0, bucket_numel=200,
                            offload_chunk_numel=128, **kw)


@pytest.mark.parametrize("tier", TIERS, ids=lambda kw: "+".join(f"{k}={v}" for k, v in kw.items()))
def test_next_forward_gathers_each_unit_once_its_update_ended(tier, tmp_path, slow_updates):
    model, ref = _model(), _model()
    opt, ref_opt = _opt(model, tmp_path, **tier), ShardedOptimizer(ref, lr=1e-2, stage=3, min_unit_numel=0,
                                                                   bucket_numel=200)
    behind = opt._stage.behind
    assert behind is not None and ref_opt._stage.behind is None
    log = behind.log = []
    gatherer = opt._stage.gatherer
    real_issue = gatherer._issue

    def issue(u):
        if u.state.name == "RELEASED":
            real_issue(u)
            log.append(("gathered", u.index))
        else:
            real_issue(u)
    gatherer._issue = issue
    trained = [u.index for u in gatherer.units if u.trainable]
    for t in range(4):
        step_beside(model, opt, ref, ref_opt, t, log)
        with torch.no_grad():  # the next forward (an evaluation one: it gathers every unit too)
            model(_batch(99))
        updated = [k for e, k in log if e == "updated"]
        gathered = [k for e, k in log if e == "gathered"]
        assert sorted(updated) == trained and sorted(gathered) == list(range(len(gatherer.units)))
        # the forward ran while the update still did: the first unit updated was gathered (and ran) before
        # the last unit's update ended
        assert updated == [i for i in gathered if i in trained]  # updated in the order the forward gathers
        assert log.index(("gathered", updated[0])) < log.index(("updated", updated[-1]))
        for k in updated:  # and no unit was gathered before its own update ended
            assert log.index(("updated", k)) < log.index(("gathered", k))
        assert all(torch.equal(a, b) for a, b in zip(_full(ref, ref_opt), _full(model, opt)))
    opt.close()


@pytest.mark.parametrize("tier", TIERS[:2], ids=["cpu", "nvme"])
def test_reads_between_steps_see_the_whole_update(tier, tmp_path, slow_updates):
    model, ref = _model(), _model()
    opt, ref_opt = _opt(model, tmp_path, **tier), _opt(ref, tmp_path)
    for t in range(2):
        _train_step(ref, ref_opt, t)
    expect_sd = ref_opt.state_dict()
    expect = _full(ref, ref_opt)
    reads = {
        "state_dict": lambda: opt.state_dict()["state"],
        "read_shard": lambda: second_moments(opt),
        "full_parameters": lambda: _full(model, opt),
        "state": lambda: [float(s["step"]) for s in opt.state.values()],
    }
    for name, read in reads.items():
        model.load_state_dict(_model().state_dict())  # back to the start (waits for the update in flight)
        opt2 = _opt(model, tmp_path, **tier)  # a new optimizer over the same model takes it over
        for t in range(2):
            _train_step(model, opt2, t)
        opt = opt2
        assert opt._stage.behind.pending, name
        got = read()
        if name == "state_dict":
            assert same_state(got, expect_sd["state"]), name
        elif name == "read_shard":
            assert all(torch.equal(a, b) for a, b in zip(got, second_moments(ref_opt))), name
        elif name == "full_parameters":
            assert all(torch.equal(a, b) for a, b in zip(got, expect)), name
        else:
            assert got == [2.0] * len(got), name
    opt.close()


def _failed_update(rank, world_size, folder):
    UpdateBehind.on_cpu = True
    folder = os.path.join(folder, f"rank{rank}")
    os.makedirs(folder, exist_ok=True)
    model, ref = _model(), _model()
    opt = _opt(model, folder, offload_optimizer="nvme")
    ref_opt = ShardedOptimizer(ref, lr=1e-2, stage=3, min_unit_numel=0, bucket_numel=200)
    return fail_an_update(model, opt, ref, ref_opt, rank, writes=3)


def test_a_failed_update_raises_on_every_rank_and_is_undone(tmp_path):
    check_failed(*run_ranks(_failed_update, 2, str(tmp_path), timeout=180))
