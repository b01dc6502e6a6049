"""What the tests of the update behind step() share (tests/test_offload_behind.py: stage 3;
tests/test_offload_behind_buckets.py: stages 1-2): the model, its batches and steps, and the fixtures that run
the overlap on CPU and slow the worker down."""
import time

import pytest
import torch
from torch import nn

import fused_zero.behind as behind_module
from fused_zero.behind import UpdateBehind

WIDTH, LAYERS = 24, 6


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)])


def batch(t, rank=0):
    g = torch.Generator().manual_seed(1000 * rank + t)
    return torch.randn(5, WIDTH, generator=g)


def train_step(model, opt, t, rank=0):
    opt.zero_grad()
    model(batch(t, rank)).square().mean().backward()
    opt.step()


def step_beside(model, opt, ref, ref_opt, t, log):
    """Step ``t`` of the reference, then of ``model`` with ``log`` cleared just before its ``step()``: the update
    runs behind it (the ordering tests read ``log`` through the next forward)."""
    train_step(ref, ref_opt, t)
    opt.zero_grad()
    model(batch(t)).square().mean().backward()
    log.clear()
    opt.step()
    assert opt._stage.behind.pending


def second_moments(opt):
    """Every partition's exp_avg_sq shard (``read_shard``: one of the reads that wait for the update)."""
    return [opt.read_shard(k, "exp_avg_sq", 0, part.layout.shard_numel) for k, part in enumerate(opt.partitions)]


def same_state(got: dict, want: dict) -> bool:
    """``state_dict()["state"]`` read while an update ran equals the reference's, bitwise."""
    return all(torch.equal(got[i][k], want[i][k]) for i in got for k in got[i])


def full(model, opt):
    with opt.full_parameters():
        return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(autouse=True)
def behind_on_cpu(monkeypatch):
    """A CPU-only run updates inside step() by default (behind.UpdateBehind.on_cpu): run the overlap here."""
    monkeypatch.setattr(UpdateBehind, "on_cpu", True)


@pytest.fixture
def slow_updates(monkeypatch):
    """Each job's update (a stage-3 partition, a stage 1-2 bucket) takes 40 ms longer, on the worker thread: the
    ordering tests then have time between the first update and the last for the forward to run, loaded or not."""
    real = behind_module.run_job

    def slow(job):
        time.sleep(0.04)
        real(job)
    monkeypatch.setattr(behind_module, "run_job", slow)


def fail_an_update(model, opt, ref, ref_opt, rank, writes):
    """Two steps, then a step whose update behind it fails on rank 1 (a full disk after ``writes`` writes of
    its NVMe store), then three more with room again: what each rank saw (``error`` at the next forward, the
    parameters and step counts ``undone``, training ``resumed`` as ``ref``'s, ``updated`` keys before the
    failure)."""
    from _faults import full_disk_after
    import os

    for t in range(2):
        train_step(model, opt, t, rank)
        train_step(ref, ref_opt, t, rank)
    before = full(model, opt)
    steps = sorted(float(s["step"]) for s in opt.state.values())
    real = os.pwritev
    if rank == 1:
        os.pwritev = full_disk_after(real, writes)
    log = opt._stage.behind.log = []
    opt.zero_grad()
    model(batch(2, rank)).square().mean().backward()
    opt.step()  # returns: the update runs behind it
    error = None
    try:
        model(batch(3, rank))  # the next forward waits, unit by unit or module by module
    except (OSError, RuntimeError) as e:
        error = f"{type(e).__name__}: {e}"
    os.pwritev = real
    out = {"error": error, "undone": all(torch.equal(a, b) for a, b in zip(before, full(model, opt))),
           "updated": len(log), "steps": sorted(float(s["step"]) for s in opt.state.values()) == steps}
    for t in range(2, 5):  # the disk has room again: training goes on as if the step was never taken
        train_step(model, opt, t, rank)
        train_step(ref, ref_opt, t, rank)
    out["resumed"] = all(torch.equal(a, b) for a, b in zip(full(ref, ref_opt), full(model, opt)))
    opt.close()
    ref_opt.close()
    return out


def check_failed(r0, r1) -> None:
    """Rank 1 raised its OSError, rank 0 that another rank failed; both undone and resumed."""
    assert r1["error"] is not None and "No space left" in r1["error"] and r1["error"].startswith("OSError")
    assert r0["error"] is not None and "failed on another rank" in r0["error"]
    for r in (r0, r1):
        assert r["undone"] and r["steps"] and r["resumed"], r
