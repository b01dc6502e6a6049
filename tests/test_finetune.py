"""Fine-tuning (issue 24): frozen parameters cost their (sharded) weights only, at every stage.

LoraNet (tests/_models.py) is the issue's model: 133,640 elements, 2,056 trainable. Checked:
memory_bytes() holds master + moments + gradient shard for the trainable elements only (16 bytes
each plus padding) and, at stage 3, the frozen weights at 1/N of their bytes; no optimizer state
and no state_dict() entry for a frozen parameter; per-step losses and trained weights against
DDP + torch AdamW on 2 gloo ranks at stages 1-3 with accumulation and an active clip; a parameter
unfrozen between steps refused at the next step on every rank, then taken in by the rebuild the
message names (state_dict() -> new optimizer -> load_state_dict()), equal to torch AdamW given the
same change; a stage-3 checkpoint holds the frozen weights and loads into a run where more is
trainable. (Planned against measured: tests/test_plan_measured.py's "lora" model.)
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_ranks
from _models import HYPER, LoraNet, lora_batch
from fused_zero import ShardedOptimizer, checkpoint

TRAINABLE, FROZEN = 2056, 131_584
CLIP = 0.05  # well below the gradient norm of every step: the clip is active


def _build(model, stage, **kw):
    return ShardedOptimizer(model if stage == 3 else model.parameters(), stage=stage, **HYPER, **kw)


def _step(model, opt, step, rank, k=2, sync=None, clip=None):
    """``k`` accumulated micro-batches (all but the last under ``sync()``), an optional clip, a step."""
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for m in range(k):
        ctx = sync() if sync is not None and m < k - 1 else torch.enable_grad()
        with ctx:
            loss = model(*lora_batch(step, rank, m))[1] / k
            loss.backward()
        total += float(loss.detach())
    if clip is not None:
        clip(CLIP)
    opt.step()
    return total


def _trained(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_frozen_parameters_cost_only_their_weights(stage):
    model = LoraNet()
    opt = _build(model, stage)
    for step in range(2):
        opt.zero_grad()
        model(*lora_batch(step, 0))[1].backward()
        if step == 1:
            mem = opt.memory_bytes()
        opt.step()
    padded = TRAINABLE + 3 * 64  # each of the 3 trainable parameters padded to 64 elements at most
    grad_buffer = mem["grads"] - (4 * TRAINABLE if stage == 1 else 0)  # stage 1 keeps torch's own .grad
    states = mem["master"] + mem["exp_avg"] + mem["exp_avg_sq"] + grad_buffer
    assert states <= 16 * padded
    # the figures README's fine-tuning section cites: fp32 parameters are their own master at stages 1-2
    assert states == {1: 25_344, 2: 25_344, 3: 33_792}[stage]
    assert 4 * FROZEN <= mem["params"] <= 4 * (FROZEN + padded)  # the frozen weights, whole at world size 1
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert all(p not in opt.state for p in frozen)
    sd = opt.state_dict()  # as torch.optim.AdamW's: no state for a parameter that never got a gradient
    ref = torch.optim.AdamW(LoraNet().parameters(), **HYPER)
    assert len(sd["state"]) == 3 and sorted(sd["param_groups"][0]["params"]) == list(range(5))
    assert set(sd["state"]) == {2, 3, 4} and len(ref.param_groups[0]["params"]) == 5


def _against_ddp(rank, ws):
    """Per-step losses and trained weights against DDP + torch AdamW, stages 1-3; the refusal and rebuild."""
    out = {}
    for stage in (1, 2, 3):
        model, ref = LoraNet(), LoraNet()
        ddp = DDP(ref)
        ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **HYPER, foreach=False)
        opt = _build(model, stage)
        ours, theirs = [], []
        for step in range(3):
            ours.append(_step(model, opt, step, rank, sync=opt.no_sync, clip=opt.clip_grad_norm_))
            theirs.append(_step(ddp, ref_opt, step, rank, sync=ddp.no_sync,
                                clip=lambda c: torch.nn.utils.clip_grad_norm_(ref.parameters(), c)))
        mem = opt.memory_bytes()
        with opt.full_parameters():
            got, want = _trained(model), _trained(ref)
        # unfreeze the base layer between steps: refused at the next step on every rank, naming it
        model.block["base"].requires_grad_(True)
        ref.block["base"].requires_grad_(True)
        try:
            _step(model, opt, 3, rank)
            refused = None
        except RuntimeError as e:
            refused = str(e)
        # the rebuild the message names; torch AdamW takes in the unfrozen parameter with fresh state
        sd = opt.state_dict()
        opt = _build(model, stage)
        opt.load_state_dict(sd)
        ref_opt.add_param_group({"params": [ref.block["base"].weight], **HYPER})
        ddp = DDP(ref)
        for step in range(3, 5):
            model.zero_grad(), ref.zero_grad()
            ours.append(_step(model, opt, step, rank, k=1))
            theirs.append(_step(ddp, ref_opt, step, rank, k=1))
        with opt.full_parameters():
            after = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[stage] = dict(ours=ours, theirs=theirs, got=got, want=want, refused=refused, mem=mem,
                          after=after, ref_after=dict(ref.named_parameters()))
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_against_ddp, 2, timeout=240)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lora_equals_ddp_adamw_with_accumulation_and_clip(two_ranks, stage):
    for res in two_ranks:
        r = res[stage]
        assert max(abs(a - b) for a, b in zip(r["ours"][:3], r["theirs"][:3])) < 1e-5, (r["ours"], r["theirs"])
        for n in r["want"]:
            torch.testing.assert_close(r["got"][n], r["want"][n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage3_frozen_shards_and_memory_on_two_ranks(two_ranks, stage):
    for res in two_ranks:
        mem = res[stage]["mem"]
        states = mem["master"] + mem["exp_avg"] + mem["exp_avg_sq"]
        assert states <= 12 * (-(-TRAINABLE // 128) * 64 + 128)  # half of the padded trainable elements
        if stage == 3:  # the frozen weights: this rank's half (plus padding), the trainable ones' master holds theirs
            assert 4 * FROZEN // 2 <= mem["params"] <= 4 * FROZEN // 2 + 4 * 2 * 128
        else:
            assert mem["params"] >= 4 * FROZEN


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unfreezing_is_refused_then_rebuilt_as_torch(two_ranks, stage):
    for res in two_ranks:
        r = res[stage]
        named = "block.base.weight" if stage == 3 else "of shape (28, 128)"  # stages 1-2 got no module= to name it
        assert r["refused"] is not None and named in r["refused"], r["refused"]
        assert "opt.load_state_dict(sd)" in r["refused"]
        assert max(abs(a - b) for a, b in zip(r["ours"][3:], r["theirs"][3:])) < 1e-5, (r["ours"], r["theirs"])
        for n, v in r["ref_after"].items():
            torch.testing.assert_close(r["after"][n], v.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_with_frozen_base_loads_where_more_is_trainable(tmp_path, stage):
    model = LoraNet()
    opt = _build(model, stage)
    for step in range(2):
        _step(model, opt, step, 0, k=1)
    checkpoint.save(tmp_path, model, opt)
    with opt.full_parameters():
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    trained = sorted(k for k, v in opt.state_dict()["state"].items())
    # a fresh run where the base layer trains too: the frozen weights come back, its state starts empty
    fresh = LoraNet(seed=1)
    fresh.block["base"].requires_grad_(True)
    opt2 = _build(fresh, stage)
    checkpoint.load(tmp_path, fresh, opt2)
    with opt2.full_parameters():
        for n, p in fresh.named_parameters():
            assert torch.equal(p, saved[n]), n
    assert sorted(opt2.state_dict()["state"]) == trained  # the base layer has no state yet
    _step(fresh, opt2, 2, 0, k=1)
    assert sorted(opt2.state_dict()["state"]) == sorted(trained + [1])
    assert float(opt2.state[fresh.block["base"].weight]["step"]) == 1  # its state started at its first step


def _build_groups(model, stage, groups):
    """``groups`` "trainable": only the trainable parameters (peft's and HF Trainer's habit; stage 3 takes the model
    by ``module=``), "model": every parameter (``ShardedOptimizer(model)`` at stage 3)."""
    if groups == "model":
        return _build(model, stage)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return ShardedOptimizer(trainable, stage=stage, **HYPER, **({"module": model} if stage == 3 else {}))


@pytest.mark.parametrize("saved,loaded,thaw", [((1, "trainable"), (1, "trainable"), True),
                                               ((3, "trainable"), (3, "model"), True),
                                               ((3, "model"), (1, "trainable"), False),
                                               ((1, "trainable"), (3, "model"), False)],
                         ids=["s1_thawed", "s3_thawed", "s3_model_to_s1_trainable", "s1_trainable_to_s3_model"])
def test_a_checkpoint_of_a_frozen_base_loads_whatever_groups_held_the_frozen_weights(tmp_path, saved, loaded, thaw):
    """A parameter saved without state (frozen) was refused as "in another param group" when the optimizer saved
    left it out of its groups (trainable-only, peft's habit) and the loading one holds it (stage 3's
    ShardedOptimizer(model), or the base thawed), or the reverse (DeepSpeed port). It carries nothing of its group:
    it loads into any; thawed, its state starts at its first step."""
    model = LoraNet()
    opt = _build_groups(model, *saved)
    for step in range(2):
        _step(model, opt, step, 0, k=1)
    checkpoint.save(tmp_path, model, opt)
    with opt.full_parameters():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters() if p.requires_grad}
    assert moments and all(m.abs().sum() > 0 for m in moments.values())
    fresh = LoraNet(seed=1)
    if thaw:
        fresh.block["base"].requires_grad_(True)
    opt2 = _build_groups(fresh, *loaded)
    checkpoint.load(tmp_path, fresh, opt2)
    with opt2.full_parameters():
        for n, p in fresh.named_parameters():
            assert torch.equal(p, weights[n]), n
    named = {p: n for n, p in fresh.named_parameters()}
    for p, st in opt2.state.items():
        if named[p] in moments:
            assert torch.equal(st["exp_avg"], moments[named[p]]), named[p]
    _step(fresh, opt2, 2, 0, k=1)
    if thaw:
        assert float(opt2.state[fresh.block["base"].weight]["step"]) == 1  # its state started at its first step


def _writeback(rank, ws, stage, units):
    """Inside full_parameters(writeback=True): an in-place write to a frozen weight (peft's merge adds B @ A to
    the base weight), and full tensors assigned with p.data = t (peft's safe merge) to a frozen and a trainable
    parameter; then a step. Against torch AdamW on the same edits (every rank makes them)."""
    model, ref = LoraNet(), LoraNet()
    opt = _build(model, stage, **({"min_unit_numel": 0} if units == "per module" and stage == 3 else {}))
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **HYPER, foreach=False)
    _step(model, opt, 0, 0, k=1)
    _step(ref, ref_opt, 0, 0, k=1)
    t_emb = torch.full((1000, 128), 0.25)
    t_a = torch.full((8, 128), -0.125)
    with opt.full_parameters():  # what the edits must leave, from the model's own weights (torch's AdamW may
        expected = [p.detach().clone() for p in model.parameters()]  # differ from the update by an ulp)
    edited = copy.deepcopy(model).requires_grad_(False)
    for p, v in zip(edited.parameters(), expected):
        p.data = v
    for m, ctx in ((model, opt.full_parameters(writeback=True)), (ref, torch.no_grad()), (edited, torch.no_grad())):
        with ctx, torch.no_grad():
            m.block["base"].weight.add_(m.block["lora_b"].weight[:28] @ m.block["lora_a"].weight)
            m.emb.weight.data = t_emb.clone()
            m.block["lora_a"].weight.data = t_a.clone()
    with opt.full_parameters():
        held = max((p - q).abs().max().item() for p, q in zip(model.parameters(), edited.parameters()))
    _step(model, opt, 1, 0, k=1)
    _step(ref, ref_opt, 1, 0, k=1)
    with opt.full_parameters():
        after = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return held, after


@pytest.mark.parametrize("stage,units,ws", [(1, "default", 1), (3, "default", 1), (3, "per module", 1),
                                            (3, "per module", 2)])
def test_writeback_keeps_in_place_writes_to_frozen_weights_and_assigned_tensors(stage, units, ws):
    """Both were dropped at stage 3 when the block ended (a peft merge_and_unload() inside it undone unseen)."""
    for held, after in run_ranks(_writeback, ws, stage, units, timeout=120):
        assert held == 0.0, held
        assert after < 1e-6, after


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_writeback_keeps_the_fp32_masters_of_what_it_did_not_change(stage):
    """A writeback reloaded every master from the bf16 parameters: half a bf16 step lost on every parameter
    at each full_parameters(writeback=True), edited or not (a no-op block each step kept 43% of the movement)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).bfloat16()
    opt = ShardedOptimizer(model if stage == 3 else model.parameters(), stage=stage, lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 8).bfloat16()).float().square().mean().backward()
        opt.step()

    def masters():
        return {i: s["master"].clone() for i, s in opt.state_dict()["state"].items()}
    before = masters()
    with opt.full_parameters(writeback=True):
        pass
    assert all(torch.equal(before[i], m) for i, m in masters().items())
    with opt.full_parameters(writeback=True), torch.no_grad():
        model[1].weight[0].add_(0.25)  # one row of one parameter
        edited = model[1].weight.detach().float().clone()
    after = masters()
    assert all(torch.equal(before[i], after[i]) for i in (0, 1, 3))
    assert torch.equal(after[2][1:], before[2][1:])  # the rows left alone keep their fp32 master
    assert torch.equal(after[2][0], edited[0])  # the edited row is what the block wrote


class _QuantBlock(torch.nn.Module):
    """A frozen base weight stored as uint8 (a quantized model's, as bitsandbytes keeps them) or float64, and a
    trainable adapter beside it."""

    def __init__(self, dtype):
        super().__init__()
        self.q = torch.nn.Parameter(torch.randint(0, 255, (16, 16)).to(dtype), requires_grad=False)
        self.adapter = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(x @ (self.q.float() / 255) + self.adapter(x))


class _QuantNet(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.blocks = torch.nn.ModuleList(_QuantBlock(dtype) for _ in range(3))
            self.head = torch.nn.Linear(16, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


def _frozen_kinds(rank, world_size, stage, dtype, ckdir):
    import contextlib
    model, ref = _QuantNet(dtype), _QuantNet(dtype)
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, fused=True)

    def build(m):  # stage 3 takes the model; stages 1-2 the trainable parameters (the frozen base as well: refused
        # before, whatever its dtype, though torch's AdamW takes it and skips it)
        return ShardedOptimizer(m, lr=1e-2, stage=3, min_unit_numel=0) if stage == 3 else \
            ShardedOptimizer(m.parameters(), lr=1e-2, stage=stage)
    opt = build(model)
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        for m, o in ((model, opt), (ddp, ref_opt)):
            o.zero_grad()
            m(x).backward()
            o.step()
    checkpoint.save(ckdir, model, opt)
    again = _QuantNet(dtype)
    with torch.no_grad():
        for p in again.parameters():
            p.zero_()
    again_opt = build(again)
    checkpoint.load(ckdir, again, again_opt)
    full = (lambda o: o.full_parameters()) if stage == 3 else (lambda o: contextlib.nullcontext())
    with full(opt):
        diffs = [(a.double() - b.double()).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())]
        want = {k: v.clone() for k, v in model.state_dict().items()}
    with full(again_opt):
        got = again.state_dict()
        same = all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in want.items())
    return diffs, same


@pytest.mark.parametrize("stage", [2, 3])  # (stage 1 keeps frozen tensors as stage 2 does: the user's)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float64])
def test_a_frozen_integer_or_float64_base_trains_as_ddp_and_checkpoints(tmp_path, stage, dtype):
    for diffs, same in run_ranks(_frozen_kinds, 2, stage, dtype, str(tmp_path), timeout=120):
        assert max(diffs) == 0.0 and same, diffs


def _adapters_switched(rank, world_size):
    """peft's adapter switching with add_param_group (every rank the same data: the reference is one torch AdamW).
    Group 0 trains, is frozen while add_param_group adds group 1, then trains again alone (no parameter the
    rebuild hooked gets a gradient), then both train."""
    out = {}
    for stage, scaled in ((None, False), (1, False), (2, False), (None, True), (1, True), (2, True)):
        torch.manual_seed(0)
        a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        opt = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1) if stage is None else \
            ShardedOptimizer(a.parameters(), stage=stage, lr=1e-2, weight_decay=0.1, bucket_numel=40)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaled else None
        losses = []

        def step(s):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(s))
            opt.zero_grad()
            loss = b(a(x)).pow(2).mean()
            if scaler is None:
                loss.backward()
                opt.step()
            else:  # the AMP recipe with a clip: unscale_ divides whatever .grad it finds in place
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                if stage is None:
                    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 10.0)
                else:
                    opt.clip_grad_norm_(10.0)
                scaler.step(opt)
                scaler.update()
            losses.append(loss.item())

        step(0)
        step(1)
        a.requires_grad_(False)
        opt.add_param_group({"params": list(b.parameters())})
        step(2)
        sd = copy.deepcopy(opt.state_dict())  # (torch's holds its live tensors)
        a.requires_grad_(True)
        b.requires_grad_(False)
        step(3)
        b.requires_grad_(True)
        step(4)
        out[stage, scaled] = losses, sd, [p.detach().clone() for p in (*a.parameters(), *b.parameters())]
    return out


def test_parameters_frozen_while_add_param_group_rebuilds_keep_their_state_and_train_again():
    """Before: state_dict() raised KeyError after the rebuild (the frozen parameters left the layout but kept their
    state), and unfreezing them was refused as 'frozen when ShardedOptimizer was built'. With a GradScaler and a
    clip, as without (scaler.unscale_ divided the .grad no hook took in place: stage 2 unscaled it twice)."""
    for out in run_ranks(_adapters_switched, 2, timeout=180):
        for stage, scaled in ((1, False), (2, False), (1, True), (2, True)):
            losses, sd, params = out[None, scaled]
            got_losses, got_sd, got = out[stage, scaled]
            assert got_losses == pytest.approx(losses, rel=1e-6), (stage, scaled)
            assert max((p - q).abs().max().item() for p, q in zip(got, params)) < 1e-6, (stage, scaled)
            assert sorted(got_sd["state"]) == sorted(sd["state"]) == [0, 1, 2, 3]
            for i, s in sd["state"].items():
                assert float(got_sd["state"][i]["step"]) == float(s["step"])
                assert torch.allclose(got_sd["state"][i]["exp_avg"], s["exp_avg"], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_frozen_parameters_loaded_state_is_kept_and_serves_after_unfreezing(stage):
    """A torch state dict holding the state of a parameter this optimizer keeps frozen: kept whole, returned by
    state_dict(), and loaded by the rebuild after unfreezing, as torch's AdamW keeps it (before: dropped)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def train(m, o, t):
        o.zero_grad()
        m(torch.randn(4, 8, generator=torch.Generator().manual_seed(t))).square().mean().backward()
        o.step()

    train(ref, ref_opt, 0)
    model.load_state_dict(ref.state_dict())
    for m in (model, ref):
        m[0].requires_grad_(False)
    build = lambda: ShardedOptimizer(model if stage == 3 else model.parameters(), stage=stage, lr=1e-2)  # noqa: E731
    opt = build()
    opt.load_state_dict(ref_opt.state_dict())
    train(model, opt, 1)
    train(ref, ref_opt, 1)
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2, 3] and float(sd["state"][0]["step"]) == 1.0
    for m in (model, ref):
        m[0].requires_grad_(True)
    if stage == 3:
        opt.close()
    opt = build()
    opt.load_state_dict(sd)
    for t in (2, 3):
        train(model, opt, t)
        train(ref, ref_opt, t)
    with opt.full_parameters():
        assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())) < 1e-6


def _adalora_model():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    config = peft.AdaLoraConfig(target_modules=["0", "2"], init_r=4, target_r=2, total_step=20, tinit=2, tfinal=2)
    return peft.get_peft_model(base, config)


def _adalora_build(rank, world_size, stage, given_model=True):
    model = _adalora_model()
    params = model if stage == 3 else [p for p in model.parameters() if p.requires_grad]
    try:
        ShardedOptimizer(params, lr=1e-3, stage=stage, **({"module": model} if stage < 3 and given_model else {}))
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("world_size,stage,given_model", [(1, 2, True), (1, 2, False), (1, 3, True), (2, 1, True),
                                                          (2, 1, False), (2, 2, True)])
def test_adalora_rank_allocation_is_refused_where_grad_is_not_the_averaged_gradient(world_size, stage, given_model):
    """AdaLoRA's update_and_allocate() reads p.grad after step(): at stage 1 on 2 ranks each rank's local gradient
    (the ranks masked different entries and drifted apart silently), at stages 2-3 None (peft's bare TypeError).
    Found given the model, or its parameters only (the one-line swap)."""
    for said in run_ranks(_adalora_build, world_size, stage, given_model, timeout=120) if world_size > 1 \
            else [_adalora_build(0, 1, stage, given_model)]:
        assert said is not None and "AdaLoRA" in said and "update_and_allocate" in said
        assert ("local gradient" if stage == 1 else ".grad is None") in said


def test_adalora_at_stage1_on_one_process_allocates_as_torch():
    """Where .grad is the gradient (stage 1, one process), the allocator's masks and the training equal torch's."""
    runs = []
    for make in (lambda ps, m: torch.optim.AdamW(ps, lr=1e-2), lambda ps, m: ShardedOptimizer(ps, lr=1e-2, stage=1, module=m)):
        model = _adalora_model()
        opt = make([p for p in model.parameters() if p.requires_grad], model)
        for t in range(8):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(t))
            model(x).square().mean().backward()
            opt.step()
            model.base_model.update_and_allocate(t)
            opt.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(*runs))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deleting_an_adapter_frozen_at_build_trains_on_as_torch_at_stages_1_2(stage, tmp_path):
    """peft's delete_adapter of an adapter that was frozen when the optimizer was built (never trained, no state
    here): torch's AdamW carries on, and so do stages 1-2; stage 3, which shards it, names the rebuild."""
    peft = pytest.importorskip("peft")

    def build():
        torch.manual_seed(0)
        base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0", "2"]))
        model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["0", "2"]))
        model.set_adapter("default")  # "other" frozen
        return model

    def train(model, opt):
        for t in range(4):
            if t == 2:
                model.delete_adapter("other")
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(t))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    ref = build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want = train(ref, ref_opt)
    model = build()
    opt = ShardedOptimizer(model if stage == 3 else model.parameters(), lr=1e-2, stage=stage,
                           **({} if stage == 3 else {"module": model}))
    if stage == 3:
        with pytest.raises(RuntimeError, match=r"no longer holds its parameter .*lora_\w\.other"):
            train(model, opt)
        return
    got = train(model, opt)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    # a checkpoint after it (the deleted adapter, in a param group still, holds nothing to save) resumes as torch
    checkpoint.save(tmp_path, model, opt)
    resumed = ShardedOptimizer(model.parameters(), lr=1e-2, stage=stage, module=model)
    checkpoint.load(tmp_path, model, resumed)
    for m, o in ((ref, ref_opt), (model, resumed)):
        m(torch.randn(4, 8, generator=torch.Generator().manual_seed(9))).square().mean().backward()
        o.step()
        o.zero_grad()
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(model.parameters(), ref.parameters()))


def test_adalora_lookup_survives_dead_weak_proxies_on_the_heap():
    """The lookup for a live AdaLoRA layer (parameters given, peft's AdaLoRA imported) walks the collector's
    objects: isinstance() on a weak proxy whose object died raises ReferenceError, which ended every build."""
    import weakref
    pytest.importorskip("peft")
    import peft.tuners.adalora  # noqa: F401

    class Dies:
        pass

    obj = Dies()
    held = [weakref.proxy(obj)]
    del obj
    p = torch.nn.Parameter(torch.zeros(3, 1))  # shaped as AdaLoRA's singular values: the lookup runs
    ShardedOptimizer([p], stage=2, lr=1e-3)
    assert len(held) == 1
