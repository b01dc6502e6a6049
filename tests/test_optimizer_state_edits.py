"""What user code does to ``optimizer.state`` and ``param_groups`` between steps, against torch.optim.AdamW
(``fused=True``, the CPU update fused_zero runs: bitwise equal).

- Taking a parameter's state away (``state.clear()``, ``del state[p]``, ``state.pop(p)``, ``state = defaultdict(dict)``,
  ``state[p] = {}``) restarts it from zero moments and step 0, as torch does; a moment replaced by a
  tensor (``state[p]["exp_avg"] = t``) is taken in; one removed is refused.
- Tensor betas are kept as tensors and followed when filled in place; a group's ``params`` list edited
  after building is refused (``add_param_group`` is the way); a load pre-hook edits a copy of the dict.
- Mixed ``decoupled_weight_decay`` groups load their own state_dict.
- Among 2 ranks: tensor hyperparameters are compared by value (a 13% lr difference that ``repr`` hides
  is refused), and group keys holding objects with address reprs are accepted.
"""
import collections
import functools

import numpy

import pytest
import torch
from torch import nn

from _dist import run_ranks
from _models import PlainNet, batch, loss_fn
from fused_zero import ShardedOptimizer

STAGES = [1, 2, 3]


def _build(model, stage, **kw):
    return ShardedOptimizer(model if stage == 3 else model.parameters(), stage=stage, **kw)


def _step(model, opt, t):
    x, y = batch(t, 0)
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()


def _equal(model, opt, ref, stage):
    ctx = opt.full_parameters() if stage == 3 else torch.no_grad()
    with ctx:
        return all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def _trained_beside_torch(stage, steps):
    """(model, opt, ref, ref_opt): a ShardedOptimizer and torch's fused AdamW trained ``steps`` steps alike."""
    model, ref = PlainNet(), PlainNet()
    opt = _build(model, stage, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for t in range(steps):
        for m, o in ((model, opt), (ref, ref_opt)):
            _step(m, o, t)
    return model, opt, ref, ref_opt


def _reset(how, opt, p):
    if how == "clear":
        opt.state.clear()
    elif how == "del":
        del opt.state[p]
    elif how == "pop":
        opt.state.pop(p)
    elif how == "defaultdict":
        opt.state = collections.defaultdict(dict)
    elif how == "empty dict":
        opt.state[p] = {}


@pytest.mark.parametrize("how", ["clear", "del", "pop", "defaultdict", "empty dict"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_state_taken_away_restarts_from_zero_moments_as_torch(stage, how):
    model, ref = PlainNet(), PlainNet()
    opt = _build(model, stage, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for t in range(5):
        if t == 3:
            _reset(how, opt, next(model.parameters()))
            _reset(how, ref_opt, next(ref.parameters()))
        for m, o in ((model, opt), (ref, ref_opt)):
            _step(m, o, t)
    assert _equal(model, opt, ref, stage)
    p, r = next(model.parameters()), next(ref.parameters())
    assert float(opt.state[p]["step"]) == float(ref_opt.state[r]["step"])


@pytest.mark.parametrize("how", ["clear", "del", "empty dict"])
@pytest.mark.parametrize("stage,offload", [(1, None), (2, None), (3, None), (2, "cpu"), (3, "nvme")])
def test_a_state_taken_away_after_a_load_restarts_from_zero_moments_as_torch(stage, offload, how, tmp_path):
    """A state dict loaded into a new optimizer, then a state taken away before its first step: that parameter starts
    from zero moments and step 0, as torch's (before: the count restarted, the loaded moments stayed)."""
    model, ref, src = PlainNet(), PlainNet(), PlainNet()
    src_opt = torch.optim.AdamW(src.parameters(), lr=1e-2, fused=True)
    for t in range(3):
        _step(src, src_opt, t)
    sd = src_opt.state_dict()
    tier = {} if offload is None else {"offload_optimizer": offload,
                                       **({"nvme_path": str(tmp_path)} if offload == "nvme" else {})}
    opt = _build(model, stage, lr=1e-2, **tier)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for o in (opt, ref_opt):
        o.load_state_dict(sd)
    _reset(how, opt, next(model.parameters()))
    _reset(how, ref_opt, next(ref.parameters()))
    for t in range(3, 5):
        for m, o in ((model, opt), (ref, ref_opt)):
            _step(m, o, t)
    assert _equal(model, opt, ref, stage)
    p, r = next(model.parameters()), next(ref.parameters())
    assert float(opt.state[p]["step"]) == float(ref_opt.state[r]["step"]) == 2.0
    opt.close()


@pytest.mark.parametrize("container", [False, True])
@pytest.mark.parametrize("first", [0, 2])
@pytest.mark.parametrize("stage", STAGES)
def test_a_whole_state_put_in_is_used_as_torch(stage, first, container):
    """``state[p] = {"step": ..., "exp_avg": ..., "exp_avg_sq": ...}`` (a state copied in from elsewhere), on a new
    optimizer or after steps, or a whole new ``optimizer.state`` holding it: the next step starts from it, as torch's
    (before: the count was taken, the moments silently left out)."""
    model, opt, ref, ref_opt = _trained_beside_torch(stage, first)
    for o, m in ((opt, model), (ref_opt, ref)):
        w = m.layers[0].weight
        shape = ref.layers[0].weight.shape  # (stage 3 between steps: w is an empty placeholder)
        given = {"step": torch.tensor(7.0), "exp_avg": torch.full(shape, 1e-3), "exp_avg_sq": torch.full(shape, 1e-4)}
        if container:  # the others keep theirs
            new = collections.defaultdict(dict, {q: dict(s) for q, s in o.state.items()})
            new[w] = given
            o.state = new
        else:
            o.state[w] = given
    for t in range(first, first + 2):
        for m, o in ((model, opt), (ref, ref_opt)):
            _step(m, o, t)
    assert _equal(model, opt, ref, stage)
    w = model.layers[0].weight
    assert float(opt.state[w]["step"]) == 9.0
    assert type(opt.state).__name__ == "OptimizerState" and isinstance(opt.state, collections.defaultdict)


@pytest.mark.parametrize("stage", STAGES)
def test_a_replaced_moment_is_taken_in_and_a_removed_one_refused(stage):
    model, ref = PlainNet(), PlainNet()
    opt = _build(model, stage, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for t in range(4):
        if t == 2:  # a shape-of-the-parameter tensor (world size 1: this rank holds all of it)
            for o, m in ((opt, model), (ref_opt, ref)):
                w = m.layers[0].weight
                o.state[w]["exp_avg"] = torch.full(tuple(o.state[w]["exp_avg"].shape), 1e-3)
                o.state[w]["exp_avg_sq"] = torch.zeros_like(o.state[w]["exp_avg_sq"])
        for m, o in ((model, opt), (ref, ref_opt)):
            _step(m, o, t)
    assert _equal(model, opt, ref, stage)
    w = model.layers[0].weight
    kept = opt.state[w]["exp_avg"]  # the view is back in place: it follows the next steps
    _step(model, opt, 4)
    _step(ref, ref_opt, 4)
    assert torch.equal(kept, ref_opt.state[ref.layers[0].weight]["exp_avg"])
    del opt.state[w]["exp_avg"]
    with pytest.raises(RuntimeError, match="exp_avg"):
        _step(model, opt, 5)


@pytest.mark.parametrize("how", ["zero every tensor", "torch's keys put in"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_bf16_parameters_state_lists_its_master_and_resets_as_torch(stage, how):
    """bf16 parameters: ``state[p]`` lists "master" (an empty tensor: the key that DCP's flatten_optimizer_state_dict
    needs to load the master state_dict() saves), and code that resets a state the torch way leaves the weights
    alone: zeroing every tensor of it but the step (with a view of the master there, that rewrote the weights), or
    putting in a state of torch's AdamW keys (that was refused as a master removed). Against the same run whose
    moments were zeroed through their views (what torch's reset does)."""
    def run(reset):
        model = PlainNet().bfloat16()
        opt = _build(model, stage, lr=1e-2)
        for t in range(4):
            if t == 2:
                for p, st in list(opt.state.items()):
                    assert sorted(st) == ["exp_avg", "exp_avg_sq", "master", "step"] and st["master"].numel() == 0
                    reset(opt, p, st)
            x, y = batch(t, 0)
            opt.zero_grad()
            loss_fn(model(x.bfloat16()).float(), y).backward()
            opt.step()
        with opt.full_parameters() if stage == 3 else torch.no_grad():
            return [p.detach().clone() for p in model.parameters()]

    def by_views(opt, p, st):
        st["exp_avg"].zero_()
        st["exp_avg_sq"].zero_()

    def every_tensor(opt, p, st):
        for k, v in st.items():
            if torch.is_tensor(v) and k != "step":
                v.zero_()

    def torch_keys(opt, p, st):
        opt.state[p] = {"step": st["step"].clone(), "exp_avg": torch.zeros_like(st["exp_avg"]),
                        "exp_avg_sq": torch.zeros_like(st["exp_avg_sq"])}
    got = run(every_tensor if how == "zero every tensor" else torch_keys)
    assert all(torch.equal(a, b) for a, b in zip(got, run(by_views)))


@pytest.mark.parametrize("stage", STAGES)
def test_a_step_count_removed_with_the_moments_kept_is_refused_as_torch(stage):
    """``del state[p]["step"]`` leaving the moments: torch's step fails (KeyError 'step'); here a ValueError naming
    both fixes, before anything changes (before: the parameter restarted from zero moments, silently)."""
    model = PlainNet()
    opt = _build(model, stage, lr=1e-2)
    _step(model, opt, 0)
    w = model.layers[0].weight
    del opt.state[w]["step"]
    with pytest.raises(ValueError, match="holds moments but no 'step'"):
        _step(model, opt, 1)
    del opt.state[w]  # the fix: restarts it, as torch's
    _step(model, opt, 2)
    assert float(opt.state[w]["step"]) == 1.0


@pytest.mark.parametrize("given,error", [("transposed", ValueError), ("flat", ValueError), ("int64", TypeError)])
@pytest.mark.parametrize("stage", [1, 2])
def test_a_moment_of_another_shape_or_an_integer_dtype_is_refused(stage, given, error):
    """A moment put in with as many elements but another shape (a transposed copy, a flat one) would be read in the
    wrong order (torch's update refuses it in its shape checks): refused naming both shapes, before anything
    changes; an integer tensor too. Before: taken in flat, silently reordered."""
    model = PlainNet()
    opt = _build(model, stage, lr=1e-2)
    for t in range(2):
        _step(model, opt, t)
    w = model.layers[0].weight
    shape = tuple(w.shape)
    opt.state[w]["exp_avg"] = {"transposed": torch.ones(shape[::-1]), "flat": torch.ones(w.numel()),
                               "int64": torch.ones(shape, dtype=torch.int64)}[given]
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error, match=r"optimizer.state\[p\]\['exp_avg'\]"):
        _step(model, opt, 2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("value", [None, 5, [1.0]])
@pytest.mark.parametrize("stage", STAGES)
def test_a_state_that_is_no_dict_is_refused_before_anything_changes(stage, value):
    """``optimizer.state[p] = None`` (or a number): refused with a TypeError naming the fix, before the step's
    collectives (among ranks the step is skipped on every rank); ``del optimizer.state[p]`` mends it, restarting
    that parameter as torch's would. Before: an AttributeError inside the update, after the ranks agreed to step."""
    model, opt, ref, ref_opt = _trained_beside_torch(stage, 2)
    w = model.layers[0].weight
    opt.state[w] = value
    with pytest.raises(TypeError, match=r"optimizer.state\[p\] of a parameter of shape .* is a .*, not a dict"):
        _step(model, opt, 2)
    assert _equal(model, opt, ref, stage)  # nothing changed
    del opt.state[w]
    del ref_opt.state[ref.layers[0].weight]
    for t in range(2, 4):
        for m, o in ((model, opt), (ref, ref_opt)):
            _step(m, o, t)
    assert _equal(model, opt, ref, stage)


@pytest.mark.parametrize("save", ["state_dict", "checkpoint"])
@pytest.mark.parametrize("edit", ["moment", "whole state"])
@pytest.mark.parametrize("stage", STAGES)
def test_moments_put_in_are_saved_before_the_next_step_and_resume_as_torch(stage, edit, save, tmp_path):
    """A moment replaced (``state[p]["exp_avg"] = t``, DeepSpeed's safe_set_full_optimizer_state) or a whole state
    put in, then ``state_dict()`` or ``checkpoint.save`` before the next step: the save holds the new moments, and a
    run resumed from it trains as torch's (before: the old moments were saved beside the new step count)."""
    from fused_zero import checkpoint

    model, opt, ref, ref_opt = _trained_beside_torch(stage, 2)
    shape = ref.layers[0].weight.shape  # (stage 3 between steps: the parameter is an empty placeholder)
    for o, m in ((opt, model), (ref_opt, ref)):
        w = m.layers[0].weight
        if edit == "moment":
            o.state[w]["exp_avg"] = torch.full(shape, 0.5)
        else:
            o.state[w] = {"step": torch.tensor(7.0), "exp_avg": torch.full(shape, 1e-3),
                          "exp_avg_sq": torch.full(shape, 1e-4)}
    expected = ref_opt.state_dict()
    if save == "state_dict":
        saved = opt.state_dict()
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(saved["state"][0][k], expected["state"][0][k]), k
    else:
        checkpoint.save(tmp_path, model, opt, tag="edited")
    resumed = PlainNet()
    with opt.full_parameters() if stage == 3 else torch.no_grad():
        resumed.load_state_dict(model.state_dict())
    resumed_opt = _build(resumed, stage, lr=1e-2)
    if save == "state_dict":
        resumed_opt.load_state_dict(saved)
    else:
        checkpoint.load(tmp_path / "edited", resumed, resumed_opt)
    for t in range(2, 4):
        for m, o in ((resumed, resumed_opt), (ref, ref_opt)):
            _step(m, o, t)
    assert _equal(resumed, resumed_opt, ref, stage)


@pytest.mark.parametrize("edit", ["fill_", "+=", "assign"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_step_count_written_in_place_or_replaced_is_followed(stage, edit):
    """``state[p]["step"].fill_(50)`` or ``+= 10`` changes that parameter's bias correction, as torch's (before:
    the in-place write was reported back and saved, but the update kept the count it shared with others)."""
    model, ref = PlainNet(), PlainNet()
    opt = _build(model, stage, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for t in range(5):
        if t == 2:
            for o, m in ((opt, model), (ref_opt, ref)):
                for p, value in ((m.layers[0].weight, 50.0), (m.layers[1].bias, 7.0)):
                    if edit == "fill_":
                        o.state[p]["step"].fill_(value)
                    elif edit == "+=":
                        o.state[p]["step"] += value
                    else:
                        o.state[p]["step"] = torch.tensor(value)
        for m, o in ((model, opt), (ref, ref_opt)):
            _step(m, o, t)
    assert _equal(model, opt, ref, stage)
    assert [float(opt.state[p]["step"]) for p in model.parameters()] == \
        [float(ref_opt.state[p]["step"]) for p in ref.parameters()]


@pytest.mark.parametrize("stage", STAGES)
def test_tensor_betas_are_kept_and_followed_when_filled(stage):
    model, ref = PlainNet(), PlainNet()
    betas, ref_betas = (torch.tensor(0.9), torch.tensor(0.999)), (torch.tensor(0.9), torch.tensor(0.999))
    opt = _build(model, stage, lr=1e-2, betas=betas)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=ref_betas, fused=True)
    assert opt.param_groups[0]["betas"][0] is betas[0]
    for t in range(4):
        if t == 2:
            betas[0].fill_(0.5)
            ref_betas[0].fill_(0.5)
        for m, o in ((model, opt), (ref, ref_opt)):
            _step(m, o, t)
    assert _equal(model, opt, ref, stage)


@pytest.mark.parametrize("edit", ["append", "remove", "new group"])
@pytest.mark.parametrize("stage", STAGES)
def test_params_edited_after_building_are_refused_before_anything_changes(stage, edit):
    model = PlainNet()
    params = list(model.parameters())
    opt = _build(model, stage, lr=1e-2)
    _step(model, opt, 0)
    extra = nn.Parameter(torch.zeros(3))
    if edit == "append":
        opt.param_groups[0]["params"].append(extra)
    elif edit == "remove":
        opt.param_groups[0]["params"].pop()
    else:
        opt.param_groups.append({**opt.param_groups[0], "params": [extra]})
    x, y = batch(1, 0)
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    with pytest.raises(RuntimeError, match="add_param_group"):
        opt.step()
    with pytest.raises(RuntimeError, match="add_param_group"):
        opt.clip_grad_norm_(1.0)
    assert float(opt.state[params[0]]["step"]) == 1.0


def test_a_load_pre_hook_edits_a_copy_of_the_dict():
    model = PlainNet()
    opt = ShardedOptimizer(model.parameters(), stage=2)
    _step(model, opt, 0)
    sd = opt.state_dict()
    sd["mine"] = 1
    opt.register_load_state_dict_pre_hook(lambda o, d: d.pop("mine") and None)
    opt.load_state_dict(sd)
    assert sd["mine"] == 1


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_mixed_decoupled_weight_decay_loads_its_own_state_dict(adam_w_mode):
    model, ref = PlainNet(), PlainNet()

    def groups(m):
        ps = list(m.parameters())
        return [{"params": ps[:3], "decoupled_weight_decay": False, "weight_decay": 0.1},
                {"params": ps[3:], "decoupled_weight_decay": True, "weight_decay": 0.1}]
    opt = ShardedOptimizer(groups(model), lr=1e-2, stage=2, adam_w_mode=adam_w_mode)
    ref_opt = torch.optim.Adam(groups(ref), lr=1e-2, fused=True)
    for t in range(2):
        for m, o in ((model, opt), (ref, ref_opt)):
            _step(m, o, t)
    opt.load_state_dict(opt.state_dict())
    assert [g["decoupled_weight_decay"] for g in opt.param_groups] == [False, True]
    for t in range(2, 4):
        for m, o in ((model, opt), (ref, ref_opt)):
            _step(m, o, t)
    assert _equal(model, opt, ref, 2)


# -- among ranks -------------------------------------------------------------------------------------

def _scale(x, k):
    return x * k


def _agreement_rank(rank, world_size, case):
    model = PlainNet()
    if case == "tensor lr":  # repr(tensor(3.4e-4)) == repr(tensor(3.0e-4)) == 'tensor(0.0003)'
        kw = dict(lr=torch.tensor(3e-4 if rank == 0 else 3.4e-4))
        groups = model.parameters()
    elif case == "numpy lr":  # not a float subclass: compared by value all the same
        kw = dict(lr=numpy.float32(1e-3 if rank == 0 else 2e-3))
        groups = model.parameters()
    else:  # a group key whose repr holds an address (a partial of a function), the same on every rank
        ps = list(model.parameters())
        groups = [{"params": ps[:2], "lr_fn": functools.partial(_scale, k=0.5)}, {"params": ps[2:]}]
        kw = {}
    try:
        opt = ShardedOptimizer(groups, stage=2, **kw)
    except ValueError as error:
        return f"refused: {error}"
    _step(model, opt, 0)
    return "built"


def test_tensor_lr_is_compared_by_value_and_object_keys_are_accepted():
    for case in ("tensor lr", "numpy lr"):
        refused = run_ranks(_agreement_rank, 2, case)
        assert all(r.startswith("refused") and "differ across ranks" in r for r in refused), (case, refused)
    assert run_ranks(_agreement_rank, 2, "object key") == ["built", "built"]
