"""optimizer.clip_grad_value_ against torch.nn.utils.clip_grad_value_ over hand-averaged gradients (DDP's).

Each rank clamps its own shard of the averaged gradient in step(), after the step's overflow check: stages 1-3 on
2 gloo ranks with buckets that split parameters, called twice in a step, under a GradScaler with an overflow on
one rank (the step is skipped, as torch's unscale_ found the inf before the clamp), stage 1's kept .grad; and the
orders that are refused on every rank with the fix named.
"""
from __future__ import annotations

import copy

import pytest
import torch

from _dist import run_ranks
from _models import ClipNet
from fused_zero import ShardedOptimizer


def _Net():
    return ClipNet(outputs=5, gain=4.0)


def _build(model, stage, **kw):
    if stage == 3:
        return ShardedOptimizer(model, stage=3, lr=1e-2, min_unit_numel=0, bucket_numel=50, **kw)
    return ShardedOptimizer(model.parameters(), stage=stage, lr=1e-2, bucket_numel=50, **kw)


def _averaged(ref, world_size):
    import torch.distributed as dist

    for p in ref.parameters():
        if p.grad is not None and world_size > 1:
            dist.all_reduce(p.grad)
            p.grad /= world_size


def _params(model, opt, stage):
    with opt.full_parameters() if stage == 3 else torch.no_grad():
        return [p.detach().clone() for p in model.parameters()]


def _against_torch(rank, world_size, stage, case):
    ref = _Net()
    model = copy.deepcopy(ref)
    # fused: its step leaves a scaled .grad scaled, as this optimizer's (both read the scale on the device)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = _build(model, stage)
    # "scaled": no scaler.unscale_() before the clip, which then clamps the scaled gradients (as torch's)
    # "clip_first": the clip clamps the scaled gradients, then scaler.unscale_() (torch's clamp(g, v) / scale)
    scalers = [torch.amp.GradScaler("cpu", init_scale=256.0) for _ in range(2)] \
        if case in ("scaler", "scaled", "clip_first") else None
    values = (0.02, 0.005) if case == "twice" else (0.01,)
    clamped, kept = 0, 0.0
    for step in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        overflow = case == "scaler" and step == 2 and rank == 1  # an inf on one rank: the step skipped on both
        ref_opt.zero_grad()
        loss = ref(x) * (float("inf") if overflow else 1.0)
        (scalers[0].scale(loss) if scalers else loss).backward()
        _averaged(ref, world_size)
        if case == "scaler":
            scalers[0].unscale_(ref_opt)
        clamped += sum(int((p.grad.abs() > values[-1]).sum()) for p in ref.parameters() if p.grad is not None)
        for v in values:
            torch.nn.utils.clip_grad_value_(ref.parameters(), v)
        if case == "clip_first":
            scalers[0].unscale_(ref_opt)
        if scalers:
            scalers[0].step(ref_opt)
            scalers[0].update()
        else:
            ref_opt.step()
        opt.zero_grad()
        loss = model(x) * (float("inf") if overflow else 1.0)
        (scalers[1].scale(loss) if scalers else loss).backward()
        if case == "scaler":
            scalers[1].unscale_(opt)
        for v in values:
            opt.clip_grad_value_(v)
        if case == "clip_first":
            scalers[1].unscale_(opt)
        if scalers:
            scalers[1].step(opt)
            scalers[1].update()
        else:
            opt.step()
        if stage == 1:  # the kept .grad is each rank's local one, clamped as torch's clip left it
            kept = max([kept] + [float(p.grad.abs().max()) for p in model.parameters()])
            if world_size == 1:  # alone, it is torch's .grad to the bit
                kept_diff = max(float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(),
                                                                                     ref.parameters()))
                assert kept_diff == 0, (step, kept_diff)
    diff = max(float((a - b).abs().max()) for a, b in zip(_params(model, opt, stage), ref.parameters()))
    return diff, clamped, kept, [s.get_scale() for s in scalers] if scalers else None


_CASES = ["once", "twice", "scaler", "scaled", "clip_first"]


@pytest.mark.parametrize("case", _CASES)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clip_grad_value_equals_torchs_over_averaged_gradients(stage, case):
    for diff, clamped, kept, scales in run_ranks(_against_torch, 2, stage, case, timeout=180):
        assert clamped > 100  # the clip changes most gradients: a missed clamp is 1e-2 off
        assert diff < 1e-6, diff
        # (the local .grad as the clip left it: unscaled after it by 1/256)
        assert kept <= (0.005 if case == "twice" else 0.01 / 256 if case == "clip_first" else 0.01)
        if case == "scaler":  # the overflow halved both scalers' scale once
            assert scales[0] == scales[1] == 128.0


@pytest.mark.parametrize("case", _CASES)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clip_grad_value_alone_equals_torchs_with_its_kept_grads(stage, case):
    """World size 1, no process group: the parameters as torch's, and stage 1's kept .grad bitwise torch's."""
    diff, clamped, _, _ = _against_torch(0, 1, stage, case)
    assert clamped > 100
    assert diff < 1e-6, diff


def test_clip_grad_value_refusals():
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(4, 8)
    opt = _build(model, 2)
    before = _params(model, opt, 2)
    opt.zero_grad()
    model(x).backward()
    with pytest.raises(TypeError, match=r"clip_value must be a real number, got str 'a'.*clip_grad_value_\(1\.0\)"):
        opt.clip_grad_value_("a")
    with pytest.raises(TypeError, match="clip_value must be a real number"):
        opt.clip_grad_value_(True)
    opt.clip_grad_value_(0.1)
    with pytest.raises(ValueError, match=r"clip_grad_value_\(\) and a norm clip .* in one step are not served"):
        opt.clip_grad_norm_(1.0)
    opt.zero_grad()
    model(x).backward()
    opt.clip_grad_norm_(1.0)
    with pytest.raises(ValueError, match="in one step are not served"):
        opt.clip_grad_value_(0.1)
    opt.zero_grad()
    with opt.no_sync():
        model(x).backward()
        with pytest.raises(RuntimeError, match=r"inside optimizer.no_sync\(\)"):
            opt.clip_grad_value_(0.1)
    model(x).backward()
    opt.clip_grad_value_(0.1)
    model(x).backward()  # torch would add unclamped gradients to clamped ones
    with pytest.raises(RuntimeError, match=r"a backward ran after clip_grad_value_\(\) and before step\(\).*changed "
                                           "nothing"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model, opt, 2)))
    opt.zero_grad()
    model(x).backward()
    opt.clip_grad_value_(0.1)
    opt.step()  # and trains on
    assert not all(torch.equal(a, b) for a, b in zip(before, _params(model, opt, 2)))
    configured = _build(_Net(), 1, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="in one step are not served"):
        configured.clip_grad_value_(0.1)


def _bad_value_on_one_rank(rank, world_size):
    model = _Net()
    opt = _build(model, 2)
    out = []
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step + rank))).backward()
        opt.clip_grad_value_("a" if (rank == 1 and step == 0) else 0.1)
        try:
            opt.step()
            out.append(None)
        except (TypeError, RuntimeError) as error:
            out.append(type(error).__name__)
    return out


def test_a_bad_clip_value_on_one_rank_raises_on_every_rank_without_hanging():
    first, second = run_ranks(_bad_value_on_one_rank, 2, timeout=120)
    assert second[0] == "TypeError" and first[0] is None  # rank 1 at its step, after the collectives
    assert first[1] == second[1] == "RuntimeError"  # "ranks disagree": the step before was skipped on every rank
    assert first[2] is None and second[2] is None


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_clip_whose_gradients_were_zeroed_is_forgotten(stage):
    """clip_grad_value_, then model.zero_grad() (the clamped gradients gone), then a backward and step(): torch
    steps with the new, unclamped gradients; so does this (stage 1 refused it as a backward after the clip)."""
    ref = _Net()
    model = copy.deepcopy(ref)
    # fused: its step leaves a scaled .grad scaled, as this optimizer's (both read the scale on the device)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = _build(model, stage) if stage == 3 else ShardedOptimizer(model, stage=stage, lr=1e-2, bucket_numel=50)
    x0, x1 = torch.randn(4, 8), torch.randn(4, 8)
    for m, o in ((ref, ref_opt), (model, opt)):
        m(x0).backward()
        if o is opt:
            o.clip_grad_value_(1e-3)
        else:
            torch.nn.utils.clip_grad_value_(m.parameters(), 1e-3)
        m.zero_grad()
        m(x1).backward()
        o.step()
    diff = max(float((a - b.detach()).abs().max()) for a, b in zip(_params(model, opt, stage), ref.parameters()))
    assert diff < 1e-6, diff
