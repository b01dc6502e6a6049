"""optimizer.clip_grad_norm_ in the orders torch allows, against torch's clip over hand-averaged gradients.

torch's ``clip_grad_norm_`` scales ``.grad`` in place at once. ShardedOptimizer applies the factor in the update
(no pass over the gradients), so whatever can observe the difference applies it first: a backward after the clip
(it adds unclipped gradients to clipped ones), a second clip (it measures what the first left), the config's
``max_grad_norm`` (it clips what the user's clip left), and a clip with nothing reduced since ``zero_grad()``
(the norm of no gradient is 0, not the last step's).
"""
from __future__ import annotations

import copy

import pytest
import torch

from _dist import run_ranks
from _models import ClipNet


_Net = ClipNet


def _scenario(rank, world_size, stage, case, bucket_numel):
    import torch.distributed as dist

    from fused_zero import ShardedOptimizer
    ref = _Net()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    kw = dict(bucket_numel=bucket_numel, max_grad_norm=0.05 if case == "config_and_clip" else None)
    opt = ShardedOptimizer(model, stage=3, lr=1e-2, min_unit_numel=0, **kw) if stage == 3 else \
        ShardedOptimizer(model.parameters(), stage=stage, lr=1e-2, **kw)

    def averaged():
        for p in ref.parameters():
            if p.grad is not None and world_size > 1:
                dist.all_reduce(p.grad)
                p.grad /= world_size

    def ref_clip(m):
        return torch.nn.utils.clip_grad_norm_(ref.parameters(), m).item()

    norms = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x1, x2 = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
        ref_opt.zero_grad()
        opt.zero_grad()
        if case == "clip_then_backward":  # torch: clip(avg g1) + avg g2
            ref(x1).backward()
            averaged()
            r1 = ref_clip(0.05)
            saved = [p.grad.clone() for p in ref.parameters()]
            ref_opt.zero_grad()
            ref(x2).backward()
            averaged()
            for p, s in zip(ref.parameters(), saved):
                p.grad += s
            model(x1).backward()
            got = opt.clip_grad_norm_(0.05).item()
            model(x2).backward()
            norms.append((got, r1))
        elif case in ("clip_twice", "clip_twice_reversed"):
            first, second = (0.05, 1.0) if case == "clip_twice" else (1.0, 0.05)
            ref(x1).backward()
            averaged()
            r = (ref_clip(first), ref_clip(second))
            model(x1).backward()
            got = (opt.clip_grad_norm_(first).item(), opt.clip_grad_norm_(second).item())
            norms.append((got, r))
        elif case == "config_and_clip":  # max_grad_norm=0.05 in the config, and the user clips at 1.0
            ref(x1).backward()
            averaged()
            r = ref_clip(1.0)
            ref_clip(0.05)
            model(x1).backward()
            norms.append((opt.clip_grad_norm_(1.0).item(), r))
        ref_opt.step()
        opt.step()
    opt.zero_grad()
    empty = opt.clip_grad_norm_(1.0).item()  # nothing reduced since zero_grad(): torch's is 0.0
    full = opt.full_parameters() if stage == 3 else torch.no_grad()
    with full:
        diffs = [((p - q).abs().max() / q.abs().max()).item() for p, q in zip(model.parameters(), ref.parameters())]
    return norms, diffs, empty


@pytest.mark.parametrize("case", ["clip_then_backward", "clip_twice", "clip_twice_reversed", "config_and_clip"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clip_grad_norm_in_torch_orders(stage, case):
    """Before: a backward after the clip was clipped too, a second clip measured the unclipped gradients and
    replaced the first, the config's max_grad_norm was skipped in a step the user clipped (4e-2 to 6e-2
    relative off after three steps), and a clip after zero_grad() returned the last step's norm (stages 2-3)."""
    for norms, diffs, empty in run_ranks(_scenario, 2, stage, case, 64, timeout=120):
        for got, want in norms:
            assert got == pytest.approx(want, rel=1e-5), norms
        assert max(diffs) < 1e-5, diffs
        assert empty == 0.0


def test_clip_takes_torchs_keywords():
    """error_if_nonfinite=True raises torch's error on a non-finite norm (one host read, on every rank);
    foreach is accepted; another norm_type is refused naming the 2-norm."""
    from fused_zero import ShardedOptimizer
    model = _Net()
    opt = ShardedOptimizer(model.parameters(), stage=2, lr=1e-2)
    model(torch.randn(4, 8)).backward()
    total = opt.clip_grad_norm_(1.0, foreach=True, error_if_nonfinite=True)
    assert torch.isfinite(total)
    opt.step()
    opt.zero_grad()
    (model(torch.randn(4, 8)) * float("inf")).backward()
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        opt.clip_grad_norm_(1.0, error_if_nonfinite=True)
    with pytest.raises(ValueError, match="norm_type=2.0, the default"):
        opt.clip_grad_norm_(1.0, norm_type=float("inf"))


def _scaler_and_kept_grads(rank, world_size):
    """Each stage under a GradScaler clipping twice a step from the first step on (the scaler is known only from
    its first scaler.step), after scaler.unscale_ and before it, and stage 1 stepping without zero_grad() between
    clipped steps."""
    import torch.distributed as dist

    from fused_zero import ShardedOptimizer

    def averaged(ref):
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size

    out = {}
    for stage, case in ((1, "scaler"), (2, "scaler"), (3, "scaler"), (1, "kept"),
                        (1, "clip_first"), (2, "clip_first"), (3, "clip_first")):
        ref = _Net()
        model = copy.deepcopy(ref)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        opt = ShardedOptimizer(model, stage=3, lr=1e-2, min_unit_numel=0) if stage == 3 else \
            ShardedOptimizer(model.parameters(), stage=stage, lr=1e-2, bucket_numel=64)
        scalers = [torch.amp.GradScaler("cpu", init_scale=256.0) for _ in range(2)]
        norms = []
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
            if case in ("scaler", "clip_first"):  # clip_first: the clips measure the scaled gradients, as torch's
                first = case == "clip_first"
                bounds = (0.3 * 256, 0.1 * 256) if first else (0.3, 0.1)
                scalers[0].scale(ref(x)).backward()
                averaged(ref)
                if not first:
                    scalers[0].unscale_(ref_opt)
                want = [torch.nn.utils.clip_grad_norm_(ref.parameters(), m).item() for m in bounds]
                if first:
                    scalers[0].unscale_(ref_opt)
                scalers[0].step(ref_opt)
                scalers[0].update()
                ref_opt.zero_grad()
                scalers[1].scale(model(x)).backward()
                if not first:
                    scalers[1].unscale_(opt)
                got = [opt.clip_grad_norm_(m) for m in bounds]
                if first:
                    scalers[1].unscale_(opt)
                scalers[1].step(opt)
                scalers[1].update()
                opt.zero_grad()
            else:  # no zero_grad(): the next backward adds to the clipped .grad (torch's clip scaled it)
                if step:
                    saved = [p.grad.clone() for p in ref.parameters()]
                    ref_opt.zero_grad()
                ref(x).backward()
                averaged(ref)
                if step:
                    for p, s in zip(ref.parameters(), saved):
                        p.grad += s
                want = [torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3).item()]
                ref_opt.step()
                model(x).backward()
                got = [opt.clip_grad_norm_(0.3)]
                opt.step()
            norms.append(([g.item() for g in got], want))  # (read after the step: the first step's is final then)
        full = opt.full_parameters() if stage == 3 else torch.no_grad()
        with full:
            diff = max(((p - q).abs().max() / q.abs().max()).item() for p, q in zip(model.parameters(),
                                                                                    ref.parameters()))
        out[(stage, case)] = norms, diff
    return out


def test_clips_under_a_grad_scaler_from_the_first_step_and_stage_1_kept_grads():
    """Before: under a GradScaler, a second clip on the first step applied the first with the scaled norm (cut
    the gradients about 256x, 1e-1 relative off; stages 2-3); and stage 1 stepping without zero_grad() added the
    next gradients to unclipped ones (torch's clip had scaled .grad; 1e-1 relative off). Clips before
    scaler.unscale_ measured the unscaled gradients at stages 2-3, and stage 1's step left the shards its clip had
    reduced scaled (norms 256x off, parameters 5e-4)."""
    for out in run_ranks(_scaler_and_kept_grads, 2, timeout=180):
        for key, (norms, diff) in out.items():
            for got, want in norms:
                assert got == pytest.approx(want, rel=1e-5), (key, norms)
            assert diff < 1e-5, (key, diff)
