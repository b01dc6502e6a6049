"""Collective calls made on some ranks only (comm/rendezvous.py), on 2-3 gloo processes.

DDP users save with ``if rank == 0: torch.save(opt.state_dict(), path)``. Here ``state_dict()``
is collective, so the other ranks serve it from their next step's wait: the lone call returns
what the collective call returns, and training goes on bit for bit as without it. The other
collective calls (load_state_dict, the checkpoint calls, stage 3's full_parameters, close, and a
stage-3 forward without gradients: DDP's ``if rank == 0: evaluate(model)``) raise at once on the rank that made them alone, naming the call and what to write instead;
nothing is disturbed, so training goes on and the call works once every rank makes it. A
caller whose error ends its process takes the others down with its reason
(tests/_exit_launcher.py, cases ``lone``).
"""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from _dist import run_ranks
from _models import TinyNet, batch, flags, loss_fn, param_groups

import fused_zero
from fused_zero import checkpoint

TIMEOUT = 180
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_exit_launcher.py")


def _build(stage):
    torch.manual_seed(0)
    model = TinyNet()
    return model, fused_zero.ShardedOptimizer(param_groups(model), module=model, stage=stage, lr=1e-2,
                                              bucket_numel=300)


def _train(model, opt, rank, steps):
    for step in steps:
        x, y = batch(step, rank)
        loss_fn(model(x, **flags(step, rank)), y).backward()
        opt.step()
        opt.zero_grad()


def _flat(sd):
    return {(i, k): v.clone() for i, s in sd["state"].items() for k, v in s.items()}


def _state_dict_alone(rank, world_size, stage, alone):
    model, opt = _build(stage)
    _train(model, opt, rank, range(3))
    took = None
    if alone and rank == 0:
        start = time.monotonic()
        lone = _flat(opt.state_dict())
        took = time.monotonic() - start
    elif not alone:
        lone = _flat(opt.state_dict())
    _train(model, opt, rank, range(3, 6))
    return (lone if rank == 0 else None), _flat(opt.state_dict()), took


@pytest.mark.parametrize("stage,world_size", [(1, 2), (2, 2), (3, 2), (2, 3)])
def test_state_dict_on_one_rank_works(stage, world_size):
    lone = run_ranks(_state_dict_alone, world_size, stage, True, timeout=TIMEOUT)
    together = run_ranks(_state_dict_alone, world_size, stage, False, timeout=TIMEOUT)
    mid, end, took = lone[0]
    ref_mid, ref_end, _ = together[0]
    assert took < 30
    assert mid.keys() == ref_mid.keys() and len(mid) > 0
    for k in ref_mid:
        assert torch.equal(mid[k], ref_mid[k]), k
    for r in range(world_size):  # and training went on exactly as without the lone call
        assert lone[r][1].keys() == together[r][1].keys()
        for k in together[r][1]:
            assert torch.equal(lone[r][1][k], together[r][1][k]), (r, k)


def _lone(opt, model, call, folder):
    if call == "load_state_dict":
        return lambda: opt.load_state_dict(opt._last_sd)
    if call == "checkpoint.save":
        return lambda: checkpoint.save(folder, model, opt, tag="lone")
    if call == "checkpoint.load":
        return lambda: checkpoint.load(folder, model, opt, tag="first")
    if call == "full_parameters":
        def enter():
            with opt.full_parameters():
                pass
        return enter
    if call == "evaluate":  # DDP's `if rank == 0: evaluate(model)` at stage 3
        def evaluate():
            with torch.no_grad():
                model(batch(9, 0)[0])
        return evaluate
    if call == "evaluate_with_grad":  # the same in eval mode, torch.no_grad() forgotten (a validation loss)
        def evaluate_with_grad():
            model.eval()
            try:
                model(batch(9, 0)[0]).float().square().mean().item()
            finally:
                model.train()
        return evaluate_with_grad
    raise AssertionError(call)


#: how each call names itself in the error
_EVAL = "a stage-3 evaluation forward (without gradients, or in eval mode)"
_NAMES = {"evaluate": _EVAL, "evaluate_with_grad": _EVAL}


def _lone_call_raises(rank, world_size, stage, call, folder, alone):
    model, opt = _build(stage)
    _train(model, opt, rank, range(2))
    opt._last_sd = opt.state_dict()
    checkpoint.save(folder, model, opt, tag="first")
    error, took = None, None
    if alone and rank == 0:
        start = time.monotonic()
        try:
            _lone(opt, model, call, folder)()
        except RuntimeError as e:
            error = str(e)
        took = time.monotonic() - start
    _train(model, opt, rank, range(2, 4))  # nothing was disturbed
    _lone(opt, model, call, folder)()  # and every rank making the call works
    _train(model, opt, rank, range(4, 5))
    return error, took, _flat(opt.state_dict())


@pytest.mark.parametrize("call,stage", [("load_state_dict", 2), ("checkpoint.save", 1), ("checkpoint.load", 2),
                                        ("full_parameters", 3), ("load_state_dict", 3), ("evaluate", 3),
                                        ("evaluate_with_grad", 3)])
def test_lone_call_raises_on_its_rank_and_training_goes_on(call, stage, tmp_path):
    got = run_ranks(_lone_call_raises, 2, stage, call, str(tmp_path / "a"), True, timeout=TIMEOUT)
    ref = run_ranks(_lone_call_raises, 2, stage, call, str(tmp_path / "b"), False, timeout=TIMEOUT)
    error, took, _ = got[0]
    name = _NAMES.get(call, f"{call}()")
    assert error is not None and f"{name} is collective" in error and "every rank" in error, error
    assert "rank(s) [1]" in error and "next collective" in error
    assert took < 60
    assert got[1][0] is None
    for r in range(2):
        for k in ref[r][2]:
            assert torch.equal(got[r][2][k], ref[r][2][k]), (r, k)



def _trained_in_mode(rank, world_size, eval_mode):
    model, opt = _build(3)
    model.train(not eval_mode)  # training in eval mode (dropout off): each step's first forward meets the others
    _train(model, opt, rank, range(4))
    return _flat(opt.state_dict())


def test_stage3_training_in_eval_mode_on_every_rank_trains_as_in_train_mode():
    got = run_ranks(_trained_in_mode, 2, True, timeout=TIMEOUT)
    ref = run_ranks(_trained_in_mode, 2, False, timeout=TIMEOUT)
    for r in range(2):
        assert got[r].keys() == ref[r].keys()
        assert all(torch.equal(got[r][k], ref[r][k]) for k in ref[r])

def _mismatch(rank, world_size):
    model, opt = _build(2)
    _train(model, opt, rank, range(2))
    sd = opt.state_dict()
    error = None
    try:
        opt.state_dict() if rank == 0 else opt.load_state_dict(sd)
    except RuntimeError as e:
        error = str(e)
    _train(model, opt, rank, range(2, 4))
    return error, _flat(opt.state_dict())


def test_different_calls_on_different_ranks():
    """rank 1's load_state_dict() meets rank 0's state_dict(): rank 1 raises, naming rank 0's call (or, when
    rank 0 withdrew first, saying it went on to its next collective); rank 0 raises naming rank 1's call,
    or (when rank 1 withdrew first) has its call served by rank 1's next wait. Either way training goes on."""
    got = run_ranks(_mismatch, 2, timeout=TIMEOUT)
    assert "load_state_dict() is collective" in got[1][0], got[1][0]
    assert "rank 0 called state_dict()" in got[1][0] or "rank(s) [0] did not call it" in got[1][0], got[1][0]
    assert got[0][0] is None or "rank 1 called load_state_dict()" in got[0][0], got[0][0]
    assert got[0][1].keys() == got[1][1].keys()
    for k in got[0][1]:
        assert torch.equal(got[0][1][k], got[1][1][k])


def _peer_closed(rank, world_size):
    model, opt = _build(2)
    _train(model, opt, rank, range(1))
    if rank == 1:
        opt.close()
        return None
    try:
        opt.state_dict()
    except RuntimeError as e:
        return str(e)


def test_state_dict_after_a_peer_closed_raises():
    error = run_ranks(_peer_closed, 2, timeout=TIMEOUT)[0]
    assert error is not None and "rank(s) [1] closed this optimizer or exited" in error


def test_lone_calls_end_every_rank():
    """Real processes: the save habit works; a lone call's error ends every rank, with its reason."""
    cases = [dict(stage=2, destroy=False, lone="state_dict"), dict(stage=3, destroy=True, lone="state_dict"),
             dict(stage=2, destroy=False, lone="checkpoint.save"), dict(stage=3, destroy=False, lone="checkpoint.save"),
             dict(stage=1, destroy=False, lone="state_dict_at_end")]
    run = subprocess.run([sys.executable, LAUNCHER, json.dumps(cases)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    saved, ended, exited = json.loads(run.stdout)[:2], json.loads(run.stdout)[2:4], json.loads(run.stdout)[4]
    for r in saved:
        assert r["codes"] == [0, 0], r["output"]
    for r in ended:
        assert r["codes"] == [3, 3], r["output"]
        assert max(r["seconds"]) < 60
        rank0, rank1 = r["output"].split("--- rank 1 ---")
        assert "checkpoint.save() is collective" in rank0 and "rank(s) [1] did not call it" in rank0
        assert "rank 0 stopped in checkpoint.save(): checkpoint.save() is collective" in rank1
    assert exited["codes"] == [3, 0], exited["output"]
    assert "rank(s) [1] closed this optimizer or exited without calling it" in exited["output"]


def test_a_rank_raising_out_of_a_step_ends_every_rank_with_its_reason():
    """Real processes: rank 1 alone raises out of step() (or add_param_group()) and its error ends it. A closure that raised before its
    backward raises at once (no collective of the step: before, the step went on into its all-reduce against the
    peer's reduce-scatter and gloo aborted the process, SIGABRT, losing the error); a learning rate refused after
    the step's collectives. Rank 0's next collective then fails with rank 1's reason (before: gloo's "Connection
    closed by peer" alone)."""
    cases = [dict(stage=2, destroy=False, raises="closure"), dict(stage=3, destroy=False, raises="closure"),
             dict(stage=2, destroy=False, raises="bad lr"), dict(stage=3, destroy=False, raises="add_param_group")]
    run = subprocess.run([sys.executable, LAUNCHER, json.dumps(cases)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    for r, why in zip(json.loads(run.stdout), ["KeyError out of step(): 'the data loader failed on rank 1'"] * 2 +
                      ["ValueError out of step(): param group 0: Invalid learning rate: -0.5",
                       "RuntimeError out of add_param_group(): stage 3 lays out every parameter"]):
        assert r["codes"] == [3, 3], r["output"]
        rank0, rank1 = r["output"].split("--- rank 1 ---")
        assert f"rank 1 raised {why}" in rank0, rank0
        assert why.split("(): ")[1] in rank1


def test_a_withdrawn_call_leaves_its_name_for_a_peer_that_saw_it():
    """A rank that withdraws a call keeps its name key (marked withdrawn, never deleted): a peer that counted it
    a moment before and reads the names now gets them at once. (Deleted, the peer's store get waited for the
    key until the store's timeout: a hang of test_different_calls_on_different_ranks under load.)"""
    import datetime

    from fused_zero.comm.rendezvous import Rendezvous

    store = torch.distributed.HashStore()
    store.set_timeout(datetime.timedelta(seconds=2))
    r0, r1 = (Rendezvous(store, r, 2, 5.0, "withdrawn") for r in range(2))
    r0._count = 1
    store.set(r0._key("name/1/0"), "state_dict()")
    with pytest.raises(RuntimeError):
        r0._fail("state_dict()", "rank 1 called something else")
    assert r1._other_names(1, "load_state_dict()") == "rank 0 called state_dict() at the same point"
    assert r1._named(1, 0).startswith("withdrawn:") and r1._named(1, 1) == ""


def test_a_peer_that_gave_up_on_another_call_and_left_is_named_with_the_first_cause():
    """3 ranks: rank 0 calls state_dict() while ranks 1-2 call load_state_dict(). The first to see the mismatch gives
    up and its process ends; the others then find it gone. They said "closed this optimizer or exited without
    calling it" (of a rank that was in the same call); they now give the first cause, not a peer's echo of it."""
    from fused_zero.comm.rendezvous import Rendezvous

    store = torch.distributed.HashStore()
    r0, r1, r2 = (Rendezvous(store, r, 3, 5.0, "gave-up") for r in range(3))
    for r in (r0, r1, r2):
        r._count = 1
    first = "rank 0 called state_dict() at the same point"
    with pytest.raises(RuntimeError, match=re.escape(first)):
        r2._fail("load_state_dict()", first)
    echo = r0._left_reason([2])
    assert echo == f"rank 2 gave up on its load_state_dict() and left: {first}"
    with pytest.raises(RuntimeError):
        r0._fail("state_dict()", echo)
    assert r1._left_reason([0, 2]) == echo  # (rank 0's reason repeats rank 2's)
    assert r1._left_reason([1]) is None


def test_a_peer_blocked_inside_the_step_the_caller_finished_is_waited_for():
    """A rank blocked in a wait counts as past the call (DDP's lone-call habit) only when it finished as many
    steps as the caller: on a loaded machine a rank can block in the last collective of the step the caller
    finished (waiting for a slow third rank), and then arrives at the call. It was refused at once ('did not
    call it and are waiting in their next collective'), breaking a correct program."""
    import threading

    from fused_zero.comm.rendezvous import Rendezvous

    store = torch.distributed.HashStore()
    r0, r1 = (Rendezvous(store, r, 2, 30.0, "progress") for r in range(2))
    steps = {0: 3, 1: 2}
    r0.progress, r1.progress = (lambda: steps[0]), (lambda: steps[1])
    r1.while_blocked()  # rank 1 is still inside its third step's collective
    outcome = []

    def call():
        try:
            with r0.collective("full_parameters()"):
                outcome.append("met")
        except RuntimeError as e:
            outcome.append(str(e))
    caller = threading.Thread(target=call)
    caller.start()
    caller.join(0.6)  # rank 0 looks at rank 1 after 0.2 s of waiting
    assert outcome == [] and caller.is_alive()
    r1.unblocked()
    steps[1] = 3  # it finished the step, and makes the call
    with r1.collective("full_parameters()"):
        pass
    caller.join(5)
    assert outcome == ["met"]
    # blocked after finishing as many steps as the caller: past the call, refused at once (as before)
    steps[1] = 3
    r1.while_blocked()
    with pytest.raises(RuntimeError, match="waiting in their next collective"):
        with r0.collective("full_parameters()"):
            pass
