"""ZeroAccelerator: Accelerate's own loop, unchanged, against Accelerate's DDP + torch.optim.AdamW.

2 gloo ranks, a tiny GPT-2, 20 optimizer steps of 2 accumulated micro-batches with an active
clip and a warm-up schedule (prepared by Accelerate, split_batches so a step sees the same
global batch at any world size): every micro-batch's loss (mean over ranks) within 1e-5
relative of the reference at stages 1, 2 and 3. ``save_state`` at step 10 resumed by
``load_state`` in a new process at world size 1 continues within 1e-5 of the uninterrupted run.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from _dist import run_ranks  # noqa: E402
from _frameworks import TokenDataset, accelerator, launcher_env, rel_close, tiny_gpt2  # noqa: E402

STEPS, ACCUM, BATCH, SAVE_AT = 20, 2, 4, 10
LR, CLIP = 3e-3, 0.5
TOL = 1e-5


def _run(rank, world_size, stage, folder=None, save_at=None, resume=False, steps=STEPS):
    acc = accelerator(rank, world_size, stage, ACCUM)
    model = tiny_gpt2()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=BATCH, shuffle=False)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    if resume:
        acc.load_state(folder)
        loader = acc.skip_first_batches(loader, SAVE_AT * ACCUM)
    losses, norms, done = [], [], SAVE_AT if resume else 0
    for batch in loader:
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(acc.gather(loss.detach().reshape(1)).mean().item())
        if acc.sync_gradients:
            done += 1
            if done == save_at:
                acc.save_state(folder)
            if done == steps:
                break
    if stage == 3 and not resume:  # the full weights, gathered on every rank (save_model uses the same)
        full = acc.get_state_dict(model)
        probe = tiny_gpt2(seed=5)
        probe.load_state_dict(full)
        x = next(iter(torch.utils.data.DataLoader(TokenDataset(), batch_size=2)))
        with torch.no_grad():
            assert torch.equal(probe(**x).logits, model(**x).logits)
    return losses, norms, sched.get_last_lr()


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_run, 2, None, timeout=300)[0]


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    """ZeroAccelerator at 2 ranks per stage, with save_state at step 10 (its folder, its results)."""
    runs = {}

    def run(stage):
        if stage not in runs:
            folder = str(tmp_path_factory.mktemp(f"stage{stage}") / "state")
            runs[stage] = folder, run_ranks(_run, 2, stage, folder, SAVE_AT, timeout=300)[0]
        return runs[stage]
    return run


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_accelerator_matches_ddp_adamw(reference, zero_runs, stage):
    losses, norms, lr = zero_runs(stage)[1]
    ref_losses, ref_norms, ref_lr = reference
    assert len(losses) == STEPS * ACCUM
    assert rel_close(losses, ref_losses, TOL) < TOL
    assert rel_close(norms, ref_norms, TOL) < TOL
    assert max(ref_norms) > CLIP  # the clip was active
    assert lr == pytest.approx(ref_lr)


@pytest.mark.parametrize("stage", [2, 3])
def test_save_state_resumes_at_world_size_1(zero_runs, stage):
    folder, (full, _, _) = zero_runs(stage)
    resumed = run_ranks(_run, 1, stage, folder, None, True, timeout=300)[0][0]
    assert len(resumed) == (STEPS - SAVE_AT) * ACCUM
    assert rel_close(resumed, full[SAVE_AT * ACCUM:], TOL) < TOL
    assert os.path.isdir(os.path.join(folder, "fused_zero"))


def _plain_accelerator_with_sharded(rank, world_size, prepare_model, stage):
    launcher_env(rank, world_size)
    from accelerate import Accelerator

    from fused_zero import ShardedOptimizer

    acc = Accelerator(cpu=True)
    model = tiny_gpt2()
    opt = ShardedOptimizer(model, lr=1e-3, stage=stage)
    if prepare_model:
        model, opt = acc.prepare(model, opt)
    else:
        opt = acc.prepare(opt)
    x = torch.randint(0, 96, (2, 16))
    try:
        acc.backward(model(input_ids=x, labels=x).loss)
        opt.step()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("world_size,prepare_model,stage", [(1, False, 2), (2, False, 2), (2, True, 2), (1, False, 3),
                                                            (1, True, 3), (2, True, 3)])
def test_plain_accelerator_with_a_sharded_optimizer_is_refused(world_size, prepare_model, stage):
    """A plain Accelerator clips .grad and wraps the model in DDP: refused, naming the integration (at
    stage 3 a prepared model at its first forward, before backward fails on the released parameters)."""
    results = run_ranks(_plain_accelerator_with_sharded, world_size, prepare_model, stage, timeout=120)
    assert all(r is not None and "ZeroAccelerator" in r for r in results), results


def _accelerator_seeing_one_process(rank, world_size):
    launcher_env(rank, world_size)
    from fused_zero import ZeroConfig
    from fused_zero.integrations.accelerate import ZeroAccelerator

    try:
        ZeroAccelerator(zero=ZeroConfig(stage=2))  # on CPU without cpu=True: Accelerate's DistributedType.NO
    except ValueError as e:
        return str(e)
    return None


def test_an_accelerator_that_sees_one_process_of_several_is_refused():
    """Under a 2-rank launch on CPU, Accelerate without cpu=True sees one process: each rank would read all the data
    and act as the main process while fused_zero averages over 2 (the README's snippet, run on CPU as written).
    Refused on every rank, naming cpu=True."""
    results = run_ranks(_accelerator_seeing_one_process, 2, timeout=120)
    assert all(r is not None and "cpu=True" in r and "one process" in r for r in results), results


def _clip_a_subset(rank, world_size):
    launcher_env(rank, world_size)
    from fused_zero import ZeroConfig
    from fused_zero.integrations.accelerate import ZeroAccelerator

    acc = ZeroAccelerator(cpu=True, zero=ZeroConfig(stage=2))
    model = tiny_gpt2()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    x = torch.randint(0, 96, (2, 16))
    acc.backward(model(input_ids=x, labels=x).loss)
    try:
        acc.clip_grad_norm_(model.transformer.h[0].parameters(), 1.0)
    except ValueError as e:
        return str(e)
    return None


def test_clip_of_part_of_the_parameters_is_refused():
    """torch clips the norm of what it is given; the optimizer can only clip all of its gradients together."""
    results = run_ranks(_clip_a_subset, 2, timeout=120)
    assert all(r is not None and "model.parameters()" in r for r in results), results


def _clip_with_unheld_gradients(rank, world_size):
    launcher_env(rank, world_size)
    from fused_zero import ZeroConfig
    from fused_zero.integrations.accelerate import ZeroAccelerator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model[2].parameters(), lr=1e-2)  # the head only; the body still requires grad
    acc = ZeroAccelerator(cpu=True, zero=ZeroConfig(stage=2))
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.randn(4, 8)).square().mean())
    try:
        acc.clip_grad_norm_(model.parameters(), 0.1)
        error = None
    except ValueError as e:
        error = str(e)
    return error, float(acc.clip_grad_norm_(model[2].parameters(), 0.1))  # the optimizer's own: the usual clip


def test_clip_with_gradients_the_optimizer_does_not_hold_is_refused():
    """torch (and plain Accelerate) counts every given gradient in the norm; the optimizer's norm covers its
    own only, so a body that still requires grad outside the optimizer is refused, not left out."""
    for error, norm in run_ranks(_clip_with_unheld_gradients, 2, timeout=120):
        assert error is not None and "does not hold" in error, error
        assert norm > 0



def _reprepared_after_free_memory(rank, world_size, stage):
    """Clip norms of one step before ``free_memory()`` and, the same prepared model and optimizer prepared again
    (HF Trainer's second train()), of the step after; and the norms torch computes on each step's gradients."""
    acc = accelerator(rank, world_size, stage, 1)
    model = tiny_gpt2()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))  # every rank the same batch
    norms = []
    for again in (False, True):
        if again:
            acc.free_memory()
            model, opt = acc.prepare(model, opt)
        acc.backward(model(input_ids=x, labels=x).loss)
        norms.append(float(acc.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
    return norms, len(acc._sharded())

def _save_model_and_free_memory(rank, world_size, stage, folder):
    """``save_model`` writes what Accelerate's own DDP run writes; after ``free_memory()`` a new model and
    optimizer are prepared, trained a step, saved with ``save_state`` and loaded back by a fresh accelerator."""
    import safetensors.torch

    acc = accelerator(rank, world_size, stage, 1)
    model = tiny_gpt2()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    acc.save_model(model, os.path.join(folder, f"model{stage}"))
    saved = safetensors.torch.load_file(os.path.join(folder, f"model{stage}", "model.safetensors"))
    full = acc.get_state_dict(model)
    exact = all(torch.equal(saved[k], full[k]) for k in saved)
    model, opt = acc.free_memory(model, opt)
    # a new model and optimizer (a sweep): its checkpoint is the only one, and loads into a fresh run
    second = tiny_gpt2(seed=1)
    second, opt = acc.prepare(second, torch.optim.AdamW(second.parameters(), lr=LR))
    x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # the same model re-prepared with a new optimizer takes part in accumulate()
        with acc.accumulate(second):
            acc.backward(second(input_ids=x, labels=x).loss)
            opt.step()
            opt.zero_grad()
    acc.save_state(os.path.join(folder, f"state{stage}"))
    return sorted(saved), exact, sorted(os.listdir(os.path.join(folder, f"state{stage}"))), \
        _resumed_error(acc, second, rank, world_size, stage, os.path.join(folder, f"state{stage}"))


def _resumed_error(acc, model, rank, world_size, stage, state_dir):
    """The largest difference between ``model``'s full weights and those a fresh accelerator's ``load_state`` of
    ``state_dir`` gives a new model (0.0: the checkpoint restored them exactly)."""
    want = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    fresh_acc = accelerator(rank, world_size, stage, 1)
    fresh = tiny_gpt2(seed=2)
    fresh, _ = fresh_acc.prepare(fresh, torch.optim.AdamW(fresh.parameters(), lr=LR))
    fresh_acc.load_state(state_dir)
    got = fresh_acc.get_state_dict(fresh)
    return max((got[k] - want[k]).abs().max().item() for k in want)


def test_save_model_and_a_sweep_after_free_memory_as_accelerate(tmp_path):
    """save_model at stages 1-2 wrote one tensor of 29 (the parameters are views of one flat buffer, which
    Accelerate took for tied weights); after free_memory() save_state numbered the new model's checkpoint after the
    old one's and load_state loaded the old one into it, and a re-prepared model's accumulate() entered the closed
    optimizer."""
    ref, _, _, _ = run_ranks(_save_model_and_free_memory, 1, None, str(tmp_path), timeout=300)[0]
    assert len(ref) == 28  # lm_head.weight is tied to the embedding: Accelerate saves it once
    for stage in (1, 2, 3):
        saved, exact, files, err = run_ranks(_save_model_and_free_memory, 1, stage, str(tmp_path), timeout=300)[0]
        assert saved == ref and exact, (stage, saved)
        assert "fused_zero_1" not in files, files
        assert err == 0.0, (stage, err)



@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_optimizer_prepared_again_after_free_memory_is_still_the_integrations(stage):
    """free_memory() forgot the ShardedOptimizer and preparing the prepared optimizer again did not take it back:
    clip_grad_norm_ fell through to torch's (0 at stages 2-3: nothing clipped; each rank's own at stage 1), and so
    did no_sync and the stage-3 saves. HF Trainer's second train() does exactly this."""
    for norms, held in run_ranks(_reprepared_after_free_memory, 2, stage, timeout=300):
        assert held == 1
        assert norms[0] > 0 and norms[1] > 0 and norms[1] != norms[0], norms


VALUE = 1e-3  # clamps many elements of the averaged gradients every step


def _value_clipped(rank, world_size, stage):
    """A few steps of Accelerate's loop with ``clip_grad_value_`` under ``sync_gradients``: Accelerate's DDP
    (``stage`` None, torch's clamp of the averaged .grad) or ZeroAccelerator (the optimizer's clamp of its
    shards). Returns the losses and, for DDP, how many elements each step clamped."""
    acc = accelerator(rank, world_size, stage, ACCUM)
    model = tiny_gpt2()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    loader = acc.prepare(torch.utils.data.DataLoader(TokenDataset(), batch_size=BATCH, shuffle=False))
    losses, clamped = [], []
    for i, batch in enumerate(loader):
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            if acc.sync_gradients:
                if stage is None:
                    clamped.append(sum(int((p.grad.abs() > VALUE).sum()) for p in model.parameters()))
                acc.clip_grad_value_(model.parameters(), VALUE)
            opt.step()
            opt.zero_grad()
        losses.append(acc.gather(loss.detach().reshape(1)).mean().item())
        if i == 4 * ACCUM - 1:
            break
    return losses, clamped


def test_clip_grad_value_matches_ddp():
    """Accelerate's clip_grad_value_ clamps the averaged gradients through the optimizer (it was refused)."""
    ref = run_ranks(_value_clipped, 2, None, timeout=180)[0]
    assert min(ref[1]) > 1000, ref[1]  # the clip is active every step
    for stage in (2, 3):
        got = run_ranks(_value_clipped, 2, stage, timeout=180)[0]
        assert rel_close(got[0], ref[0], TOL) <= TOL, (stage, got[0], ref[0])


def _scaler_skips(rank, world_size, stage):
    """Accelerate's fp16 loop under the GradScaler it makes on a GPU (none on CPU: given here, alike for every
    side), the first steps overflowing: (step_was_skipped, scale, lr) after each step."""
    launcher_env(rank, world_size)
    from accelerate import Accelerator
    from fused_zero import ZeroConfig
    from fused_zero.integrations.accelerate import ZeroAccelerator
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    acc = Accelerator(cpu=True, mixed_precision="fp16") if stage is None else \
        ZeroAccelerator(cpu=True, mixed_precision="fp16", zero=ZeroConfig(stage=stage))
    acc.scaler, acc.native_amp = torch.amp.GradScaler("cpu", init_scale=2.0 ** 100, backoff_factor=2.0 ** -40), True
    model, opt, sched = acc.prepare(model, opt, sched)
    g = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(5):
        loss = model(torch.randn(4, 8, generator=g)).square().mean() * 1e3
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        out.append((acc.optimizer_step_was_skipped, float(acc.scaler.get_scale()), sched.get_last_lr()[0]))
    return out, [p.detach().clone() for p in acc.unwrap_model(model).parameters()] if stage != 3 else None


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_steps_a_grad_scaler_skips_are_reported_skipped_and_the_schedule_waits_as_ddp(stage):
    """The scaler always calls a ShardedOptimizer's step (its verdict is read on the device, as torch's fused
    AdamW's): Accelerate took every step as taken, so its scheduler (and HF Trainer's) moved on through
    overflows. Some steps overflow, later ones do not: the flags, scales and lrs are DDP + AdamW's."""
    want = run_ranks(_scaler_skips, 2, None, timeout=180)
    got = run_ranks(_scaler_skips, 2, stage, timeout=180)
    flags = [s for s, _, _ in want[0][0]]
    assert any(flags) and not all(flags)  # both kinds of step happen
    for (ours, params), (theirs, ref) in zip(got, want):
        assert [s for s, _, _ in ours] == flags and [sc for _, sc, _ in ours] == [sc for _, sc, _ in theirs]
        assert all(abs(a[2] - b[2]) <= 1e-12 for a, b in zip(ours, theirs))
        if params is not None:
            assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(params, ref))


def _triggered_sync(rank, world_size, stage):
    launcher_env(rank, world_size)
    from accelerate import Accelerator
    from fused_zero import ZeroConfig
    from fused_zero.integrations.accelerate import ZeroAccelerator
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = Accelerator(cpu=True) if stage is None else ZeroAccelerator(cpu=True, zero=ZeroConfig(stage=stage))
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        with acc.no_sync(model):
            acc.backward(model(torch.randn(4, 8, generator=g)).square().mean())
            with acc.trigger_sync_in_backward(model):  # Accelerate's way to make the last backward reduce
                acc.backward(model(torch.randn(4, 8, generator=g)).square().mean())
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in acc.get_state_dict(model).items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_trigger_sync_in_backward_inside_no_sync_reduces_as_ddp(stage):
    """Accelerate's trigger_sync_in_backward passes over a model that is not DDP, so the optimizer's no_sync() stayed
    on: stages 2-3 refused the step (gradients never reduced)."""
    want = run_ranks(_triggered_sync, 2, None, timeout=180)
    for got, ref in zip(run_ranks(_triggered_sync, 2, stage, timeout=180), want):
        assert got.keys() == ref.keys() and all(torch.allclose(got[k], ref[k], rtol=1e-5, atol=1e-7) for k in ref)


def _two_models_clipped(rank, world_size, stage):
    launcher_env(rank, world_size)
    from accelerate import Accelerator
    from fused_zero import ZeroConfig
    from fused_zero.integrations.accelerate import ZeroAccelerator
    torch.manual_seed(0)
    a, b = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh()), torch.nn.Linear(8, 3)
    oa, ob = torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
    acc = Accelerator(cpu=True) if stage is None else ZeroAccelerator(cpu=True, zero=ZeroConfig(stage=stage))
    a, b, oa, ob = acc.prepare(a, b, oa, ob)
    norms = []
    for t in range(4):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * t + rank))
        acc.backward(b(a(x)).square().mean())
        norms.append(float(acc.clip_grad_norm_(list(a.parameters()) + list(b.parameters()), 0.05)))
        oa.step()
        ob.step()
        oa.zero_grad()
        ob.zero_grad()
    return norms, [acc.get_state_dict(m) for m in (a, b)]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_clip_over_two_prepared_models_is_ddps(stage):
    """accelerator.clip_grad_norm_ over the parameters of two models, each with its own optimizer: one norm over
    both, as torch's clip under DDP (it was refused, asking to clip each model on its own: another result)."""
    want = run_ranks(_two_models_clipped, 2, None, timeout=180)
    for (norms, sds), (ref_norms, ref_sds) in zip(run_ranks(_two_models_clipped, 2, stage, timeout=180), want):
        assert all(abs(g - w) <= 1e-6 * w for g, w in zip(norms, ref_norms)), (norms, ref_norms)
        for sd, ref in zip(sds, ref_sds):
            assert all(torch.allclose(sd[k], ref[k], rtol=1e-5, atol=1e-7) for k in ref)


def _optimizer_prepared_first(rank, world_size, stage, folder):
    """``opt = acc.prepare(opt)`` before ``model = acc.prepare(model)``: two steps, ``save_state``, and a fresh
    accelerator's ``load_state`` (prepared in the usual order) restores the weights; the same run under Accelerate's
    DDP for the losses."""
    acc = accelerator(rank, world_size, stage, 1)
    model = tiny_gpt2()
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=LR))
    model = acc.prepare(model)
    x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(2):
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(acc.gather(loss.detach().reshape(1)).mean().item())
    if stage is None:
        return losses, 0.0
    acc.save_state(os.path.join(folder, f"opt_first{stage}"))
    return losses, _resumed_error(acc, model, rank, world_size, stage, os.path.join(folder, f"opt_first{stage}"))


@pytest.mark.parametrize("stage", [1, 2])
def test_an_optimizer_prepared_before_its_model_saves_and_loads_state(tmp_path, stage):
    """Preparing the optimizer in a call before its model's trained as DDP but left it unpaired: save_state refused
    at the first checkpoint, naming a fix the user had followed (Accelerate port). The model's prepare pairs it."""
    ref = run_ranks(_optimizer_prepared_first, 2, None, str(tmp_path), timeout=300)[0][0]
    for losses, err in run_ranks(_optimizer_prepared_first, 2, stage, str(tmp_path), timeout=300):
        assert rel_close(losses, ref, TOL), (losses, ref)
        assert err == 0.0


def _after_end_training(rank, world_size, stage, folder):
    """One step, the full weights, ``end_training()`` (which destroys the process group), then the model's own
    state dict and a forward: what a script saves after it."""
    import torch.distributed as dist

    acc = accelerator(rank, world_size, stage, 1)
    model = tiny_gpt2()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    acc.backward(model(input_ids=x, labels=x).loss)
    opt.step()
    opt.zero_grad()
    want = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    with torch.no_grad():
        logits = model(input_ids=x).logits
    acc.end_training()
    got = acc.unwrap_model(model).state_dict()
    with torch.no_grad():
        after = model(input_ids=x).logits
    exact = sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(folder, f"store{stage}"), rank=rank,
                            world_size=world_size)  # (the harness ends with a barrier)
    return exact, torch.equal(after, logits)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_after_end_training_the_model_holds_its_full_weights_as_under_ddp(tmp_path, stage):
    """Accelerate's end_training() destroys the process group; at stage 3 the model kept its 0-element placeholders
    for good (its state dict refused, get_state_dict failed on the destroyed group), where a DDP model still saves
    (Accelerate port). ZeroAccelerator.end_training closes its optimizers first."""
    for exact, same in run_ranks(_after_end_training, 2, stage, str(tmp_path), timeout=300):
        assert exact and same
