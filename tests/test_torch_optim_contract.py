"""ShardedOptimizer against torch's own optimizer tests, at world size 1.

- PyTorch's AdamW configurations (``optim_inputs_func`` of torch's ``optim_db``: default, lr,
  weight decay, maximize, amsgrad) at stages 1 and 2 against ``torch.optim.AdamW`` within 1e-6.
- The generic torch.optim contract: state_dict round trips (also into and out of torch's own
  AdamW), step pre/post hooks, state-dict hooks, closures, LR schedulers, param-group edits
  mid-run, add_param_group, zero_grad(set_to_none=False).
"""
import contextlib
import copy

import pytest
import torch
from torch.optim.lr_scheduler import LinearLR

from _models import PlainNet, TinyNet, batch, flags, loss_fn, rel
from fused_zero import ShardedOptimizer

TOL = 1e-6


def _torch_adamw_inputs():
    pytest.importorskip("expecttest")  # torch.testing._internal needs it
    from torch.testing._internal.common_optimizers import optim_db

    info = next(o for o in optim_db if o.optim_cls is torch.optim.AdamW)
    return info.optim_inputs_func(device="cpu")


def _loss(model, t):
    x, y = batch(t, 0)
    return loss_fn(model(x, **flags(t, 0)), y)


def _train(model, opt, steps, start=0):
    for t in range(start, start + steps):
        opt.zero_grad()
        _loss(model, t).backward()
        opt.step()


def _max_err(a, b):
    return max(rel(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("stage", [1, 2])
def test_torch_adamw_configurations(stage):
    inputs = _torch_adamw_inputs()
    assert {i.desc for i in inputs} >= {"default", "maximize", "amsgrad"}
    for inp in inputs:
        model, ref = TinyNet(), TinyNet()
        opt = ShardedOptimizer(model.parameters(), stage=stage, bucket_numel=1000, **inp.kwargs)
        ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **inp.kwargs)
        _train(model, opt, 5)
        _train(ref, ref_opt, 5)
        assert _max_err(model, ref) < TOL, inp.desc


@pytest.mark.parametrize("stage", [1, 2])
def test_state_dict_round_trip_and_into_torch(stage):
    model, ref = TinyNet(), TinyNet()
    opt = ShardedOptimizer(model.parameters(), stage=stage, amsgrad=True, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, amsgrad=True, weight_decay=0.1)
    _train(model, opt, 3)
    _train(ref, ref_opt, 3)
    sd = opt.state_dict()
    # ours -> a fresh torch AdamW and torch's -> a fresh ShardedOptimizer: both continue like the reference
    twin, twin_torch = copy.deepcopy(ref), copy.deepcopy(ref)
    twin_opt = ShardedOptimizer(twin.parameters(), stage=stage, amsgrad=True)
    twin_opt.load_state_dict(ref_opt.state_dict())
    torch_opt = torch.optim.AdamW(twin_torch.parameters(), foreach=False, amsgrad=True)
    torch_opt.load_state_dict(sd)
    for m, o in ((model, opt), (ref, ref_opt), (twin, twin_opt), (twin_torch, torch_opt)):
        _train(m, o, 3, start=3)
    assert _max_err(model, ref) < TOL
    assert _max_err(twin, ref) < TOL
    assert _max_err(twin_torch, ref) < TOL


def test_step_and_state_dict_hooks():
    model = PlainNet()
    opt = ShardedOptimizer(model.parameters())
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    opt.register_state_dict_pre_hook(lambda o: calls.append("sd_pre"))
    opt.register_state_dict_post_hook(lambda o, sd: sd.update(extra=1) or sd)
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load_pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    _train(model, opt, 1)
    sd = opt.state_dict()
    assert sd["extra"] == 1
    opt.load_state_dict({k: v for k, v in sd.items() if k != "extra"})
    assert calls == ["pre", "post", "sd_pre", "load_pre", "load_post"]


def test_closure_scheduler_and_group_edits_match_torch():
    model, ref = TinyNet(), TinyNet()
    opt = ShardedOptimizer(model.parameters(), stage=2, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, lr=1e-2)
    scheds = [LinearLR(o, start_factor=0.5, total_iters=4) for o in (opt, ref_opt)]
    for t in range(6):
        for m, o, s in ((model, opt, scheds[0]), (ref, ref_opt, scheds[1])):
            def closure(m=m, o=o):
                o.zero_grad()
                loss = _loss(m, t)
                loss.backward()
                return loss
            loss = o.step(closure)
            assert loss is not None
            s.step()
            if t == 2:  # edits mid-run, as users and frameworks make them
                o.param_groups[0]["weight_decay"] = 0.2
                o.param_groups[0]["betas"] = (0.8, 0.99)
    assert _max_err(model, ref) < TOL


def test_add_param_group_and_zero_grad_to_zero_match_torch():
    model, ref = TinyNet(), TinyNet()
    ps, rs = list(model.parameters()), list(ref.parameters())
    opt = ShardedOptimizer(ps[:6], stage=2, lr=1e-2)
    ref_opt = torch.optim.AdamW(rs[:6], foreach=False, lr=1e-2)
    _train(model, opt, 2)
    _train(ref, ref_opt, 2)
    opt.add_param_group({"params": ps[6:], "lr": 3e-3})
    ref_opt.add_param_group({"params": rs[6:], "lr": 3e-3})
    for t in range(2, 5):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=False)
            _loss(m, t).backward()
            o.step()
    assert _max_err(model, ref) < TOL


def _continue_equal(model, opt, ref, ref_opt, steps, stage):
    """``steps`` more steps of both from step 2 on: equal to torch within TOL (stage 3: read inside
    full_parameters())."""
    _train(model, opt, steps, start=2)
    _train(ref, ref_opt, steps, start=2)
    with opt.full_parameters() if stage == 3 else contextlib.nullcontext():
        assert _max_err(model, ref) < TOL


@pytest.mark.parametrize("stage", [1, 3])
def test_state_under_keys_that_are_no_parameter_round_trips_as_torch(stage):
    """torch.optim keeps state entries whose key is not a parameter (a counter a hook keeps, an index that matches
    no parameter) through state_dict() and load_state_dict(), as they are; torch's own state-dict hook tests
    rely on it."""
    model, ref = PlainNet(), PlainNet()
    opt = ShardedOptimizer(model, stage=stage) if stage == 3 else ShardedOptimizer(model.parameters(), stage=stage)
    ref_opt = torch.optim.AdamW(ref.parameters())
    for o in (opt, ref_opt):
        o.register_state_dict_pre_hook(lambda o: o.state.__setitem__("hook_calls", o.state.get("hook_calls", 0) + 1))
    _train(model, opt, 2)
    _train(ref, ref_opt, 2)
    opt.state["epoch"], ref_opt.state["epoch"] = 7, 7
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sd["state"]["epoch"] == ref_sd["state"]["epoch"] == 7
    assert sd["state"]["hook_calls"] == ref_sd["state"]["hook_calls"] == 1
    assert sorted(map(str, sd["state"])) == sorted(map(str, ref_sd["state"]))
    # a loaded dict replaces them: its own are taken as they are, the optimizer's others go (as torch)
    opt.state["stale"] = ref_opt.state["stale"] = True
    for o, d in ((opt, ref_sd), (ref_opt, ref_sd)):
        o.load_state_dict({**d, "state": {**d["state"], "epoch": 9, 99: {"note": "no parameter 99"}}})
    for o in (opt, ref_opt):
        assert o.state["epoch"] == 9 and o.state[99] == {"note": "no parameter 99"} and "stale" not in o.state
    _continue_equal(model, opt, ref, ref_opt, 2, stage)


def test_param_groups_in_state_dict_as_torch_orders_them_and_loaded_names_replace():
    model, ref = PlainNet(), PlainNet()
    named = list(model.named_parameters())

    def groups(named):
        return [{"weight_decay": 0.0, "name": "first", "params": named[:1]}, {"params": named[1:]}]
    opt = ShardedOptimizer(groups(named))
    ref_opt = torch.optim.AdamW(groups(list(ref.named_parameters())))
    _train(model, opt, 1)
    _train(ref, ref_opt, 1)
    ours, theirs = opt.state_dict()["param_groups"], ref_opt.state_dict()["param_groups"]
    assert [list(g) for g in ours] == [list(g) for g in theirs]
    assert ours == theirs
    renamed = ref_opt.state_dict()
    for g in renamed["param_groups"]:
        g["param_names"] = ["renamed." + n for n in g["param_names"]]
    opt.load_state_dict(renamed)
    ref_opt.load_state_dict(renamed)
    assert [g["param_names"] for g in opt.param_groups] == [g["param_names"] for g in ref_opt.param_groups]
    assert opt.param_groups[0]["param_names"][0].startswith("renamed.")


@pytest.mark.parametrize("flag", ["capturable", "differentiable"])
def test_flags_refused_at_build_are_refused_when_set_in_a_group_later(flag):
    model = PlainNet()
    opt = ShardedOptimizer(model.parameters())
    _train(model, opt, 1)
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0][flag] = True
    with pytest.raises(ValueError, match=f"{flag}=True is not supported"):
        _train(model, opt, 1, start=1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # refused before any change


def test_tensors_without_requires_grad_given_a_grad_by_hand_are_refused_saying_so():
    """torch's own tests step plain tensors (requires_grad=False) holding a hand-made .grad; here a tensor that
    requires no gradient when the optimizer is built is frozen, so that is refused, and the message says what
    happened (they hold a .grad), not that they require one."""
    ps = [torch.randn(4, 3), torch.randn(5)]
    opt = ShardedOptimizer(ps)
    for p in ps:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=r"parameters param_groups\[0\]\['params'\]\[0\] of shape \(4, 3\); "
                                           r"param_groups\[0\]\['params'\]\[1\] of shape \(5,\) were frozen .* now "
                                           r"hold a \.grad.* no state, gradient buffer or reduction for them"):
        opt.step()


@pytest.mark.parametrize("stage", [1, 3])
def test_loading_a_torch_adam_state_dict_keeps_adamw_as_torch_adamw_does(stage):
    """torch.optim.AdamW stays AdamW whatever it loads (its __setstate__ forces decoupled_weight_decay=True); an
    Adam group (built with decoupled_weight_decay=False) takes the saved value, as torch.optim.Adam does."""
    src = PlainNet()
    adam = torch.optim.Adam(src.parameters(), weight_decay=0.1)
    _train(src, adam, 2)
    sd = adam.state_dict()
    assert sd["param_groups"][0]["decoupled_weight_decay"] is False
    model, ref = copy.deepcopy(src), copy.deepcopy(src)
    opt = ShardedOptimizer(model, stage=stage, weight_decay=0.1) if stage == 3 else \
        ShardedOptimizer(model.parameters(), stage=stage, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), weight_decay=0.1)
    opt.load_state_dict(sd)
    ref_opt.load_state_dict(sd)
    assert opt.param_groups[0]["decoupled_weight_decay"] is ref_opt.param_groups[0]["decoupled_weight_decay"] is True
    _continue_equal(model, opt, ref, ref_opt, 3, stage)
    # an Adam group takes what it loads: an AdamW state dict turns it into AdamW, as torch.optim.Adam
    adam_group = ShardedOptimizer([{"params": list(PlainNet().parameters()), "decoupled_weight_decay": False}])
    torch_adam = torch.optim.Adam(PlainNet().parameters())
    for o in (adam_group, torch_adam):
        o.load_state_dict(ref_opt.state_dict())
    assert adam_group.param_groups[0]["decoupled_weight_decay"] is torch_adam.param_groups[0][
        "decoupled_weight_decay"] is True


def test_moments_without_a_step_are_refused_at_load():
    """torch fails at the next step (KeyError: 'step'); a silent load would run the moments from step 1."""
    src = PlainNet()
    ref = torch.optim.AdamW(src.parameters())
    _train(src, ref, 1)
    sd = ref.state_dict()
    opt = ShardedOptimizer(PlainNet().parameters())
    i = min(sd["state"])
    del sd["state"][i]["step"]
    with pytest.raises(ValueError, match=rf"state {i} .* holds \['exp_avg', 'exp_avg_sq'\] but no 'step'"):
        opt.load_state_dict(sd)


# --- details torch's own optimizer tests check (test_state_dict_deterministic, test_can_load_older_state_dict,
# test_errors), found by porting them -----------------------------------------------------------------------


def _twins(stage, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    opt = ShardedOptimizer(model if stage == 3 else model.parameters(), stage=stage, **kw)
    return model, opt, ref, torch.optim.AdamW(ref.parameters(), **kw)


def _steps(model, opt, steps, start):
    for t in range(start, start + steps):
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def _params(model, opt, stage):
    with opt.full_parameters() if stage == 3 else contextlib.nullcontext():
        return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_dict_numbers_a_repeated_parameter_by_its_first_place(stage):
    """torch's test_state_dict_deterministic ends by extending param_groups with themselves: a parameter listed
    twice keeps its first number (before: its last, and the first group's parameters had no state)."""
    model, opt, ref, ref_opt = _twins(stage)
    _steps(model, opt, 1, 0)
    _steps(ref, ref_opt, 1, 0)
    for o in (opt, ref_opt):
        o.param_groups.extend(o.param_groups)
    mine, theirs = opt.state_dict(), ref_opt.state_dict()
    assert [g["params"] for g in mine["param_groups"]] == [g["params"] for g in theirs["param_groups"]] \
        == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert sorted(mine["state"]) == sorted(theirs["state"]) == [0, 1, 2, 3]
    for i, s in theirs["state"].items():
        assert all(torch.equal(mine["state"][i][k], v) for k, v in s.items()), i


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("flag, kw", [("maximize", dict(maximize=True, weight_decay=0.1)),
                                      ("amsgrad", dict(amsgrad=True))])
def test_loading_a_state_dict_without_a_flag_takes_torchs_default(stage, flag, kw):
    """torch's test_can_load_older_state_dict: a saved group that lacks maximize (amsgrad, foreach, fused,
    differentiable) loads as torch's default for it (Adam.__setstate__), not the optimizer's value."""
    model, opt, ref, ref_opt = _twins(stage, **kw)
    for m, o in ((model, opt), (ref, ref_opt)):
        _steps(m, o, 3, 0)
        sd = copy.deepcopy(o.state_dict())
        for g in sd["param_groups"]:
            for key in (flag, "foreach", "fused", "differentiable"):
                g.pop(key, None)
        o.load_state_dict(sd)
        assert o.param_groups[0][flag] is False and o.param_groups[0]["foreach"] is None
        _steps(m, o, 3, 3)
    # (torch's loaded group lost fused=True: its for-loop update may differ from the fused kernel's by an ulp, as on
    # an AMD EPYC)
    for a, b in zip(_params(model, opt, stage), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("kw, words", [
    (dict(lr=torch.tensor(0.001), foreach=True), "lr as a Tensor is not supported for capturable=False and foreach"),
    (dict(betas=(torch.tensor(0.9), torch.tensor(0.99)), foreach=True), r"betas\[0\] as a Tensor is not supported"),
])
def test_tensor_hyperparameters_with_foreach_refused_as_torch(kw, words):
    """torch's test_errors (AdamW's CPU error inputs): the same ValueError and words."""
    for cls in (torch.optim.AdamW, ShardedOptimizer):
        with pytest.raises(ValueError, match=words):
            cls([torch.nn.Parameter(torch.randn(2))], **kw)
    ShardedOptimizer([torch.nn.Parameter(torch.randn(2))], **{**kw, "foreach": False})  # served without foreach


def test_fused_with_differentiable_refused_in_torchs_words():
    with pytest.raises(RuntimeError, match="`fused` does not support `differentiable`"):
        ShardedOptimizer([torch.nn.Parameter(torch.randn(2))], fused=True, differentiable=True)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_is_in_param_groups_order_as_torchs(stage):
    """``optimizer.state`` iterates in param_groups order, as torch's first step creates it (the shards create
    states in backward's order): ``list(opt.state.values())[0]`` is the first parameter's, also after a load."""
    model, opt, ref, ref_opt = _twins(stage)
    _steps(model, opt, 1, 0)
    _steps(ref, ref_opt, 1, 0)
    params = list(model.parameters())
    assert list(opt.state) == params
    assert [id(ref_opt.state[q]) for q in ref.parameters()] == [id(v) for v in ref_opt.state.values()]
    sd = opt.state_dict()
    sd["state"] = dict(reversed(list(sd["state"].items())))
    opt.load_state_dict(sd)
    assert list(opt.state) == params


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("default", [torch.float64, torch.bfloat16])
def test_a_default_dtype_leaves_the_fp32_state_alone(stage, default):
    """torch.set_default_dtype(...) before the build: the step counts were made in it (bf16 counts stopped at 256,
    a silently wrong bias correction from step 257 on) and state_dict()'s gather buffers too (it raised)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    ref = copy.deepcopy(model)
    x = torch.randn(4, 6)
    before = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        opt = ShardedOptimizer(model if stage == 3 else model.parameters(), stage=stage, lr=1e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
        for m, o in ((model, opt), (ref, ref_opt)):
            for _ in range(258):
                o.zero_grad()
                m(x).square().mean().backward()
                o.step()
        sd = opt.state_dict()
    finally:
        torch.set_default_dtype(before)
    assert float(sd["state"][0]["step"]) == 258 and sd["state"][0]["exp_avg"].dtype == torch.float32
    with opt.full_parameters():
        assert _max_err(model, ref) < TOL


def test_inference_mode_around_the_build_and_the_step_is_torchs_no_op():
    """Built, stepped and evaluated under torch.inference_mode() as torch's AdamW may be: the first step made its
    step counts there (inference tensors: it raised), a build made its flat buffers there (backward then raised)."""
    model, ref = TinyNet(), TinyNet()
    with torch.inference_mode():
        opt = ShardedOptimizer(model.parameters(), stage=2, bucket_numel=1000)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False)
    for t in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            _loss(m, t).backward()
            with torch.inference_mode():
                o.step()
    assert _max_err(model, ref) < TOL


def _warmup_class(base):
    class Warmup(base):  # a per-step counter driving the lr, as warm-up subclasses do
        def step(self, closure=None):
            self.calls = getattr(self, "calls", 0) + 1
            for g in self.param_groups:
                g["lr"] = 1e-2 * min(1.0, self.calls / 10)
            return super().step(closure)
    return Warmup


def _warmup_run(model, opt, how):
    hooks = []
    opt.register_step_pre_hook(lambda o, a, k: hooks.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: hooks.append("post"))

    def train_step(t):
        opt.zero_grad()
        _loss(model, t).backward()
        if how == "inference_mode":
            with torch.inference_mode():
                opt.step()
        else:
            opt.step()

    run = torch.compile(train_step, backend="aot_eager") if how == "compiled" else train_step
    for t in range(4):
        run(t)
    return opt.calls, hooks


@pytest.mark.parametrize("stage,how", [(1, "inference_mode"), (2, "inference_mode"), (3, "inference_mode"),
                                       (2, "compiled"), (3, "compiled")])  # (stage 1's hooks are stage 2's EagerRelay)
def test_a_step_override_and_the_step_hooks_run_once_per_step(stage, how):
    """step() under torch.inference_mode() or inside a compiled training step: a subclass's step() override and the
    step hooks run once per step. Before, step() re-entered the hooked, overridden step(): each ran twice, and a
    warm-up override took double steps (torch's own AdamW runs the hooks twice here: its subclass's and its own
    step() are both hooked once an AdamW was made)."""
    torch._dynamo.reset()
    model, ref = TinyNet(), TinyNet()
    opt = _warmup_class(ShardedOptimizer)(model if stage == 3 else model.parameters(), stage=stage,
                                          bucket_numel=1000)
    ref_opt = _warmup_class(torch.optim.AdamW)(ref.parameters(), foreach=False)
    ShardedOptimizer(TinyNet().parameters())  # ShardedOptimizer.step itself hooked too (torch then runs them twice)
    assert _warmup_run(ref, ref_opt, how)[0] == 4
    assert _warmup_run(model, opt, how) == (4, ["pre", "post"] * 4)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 4e-3
    with opt.full_parameters():
        assert _max_err(model, ref) < TOL


def test_a_bf16_default_dtype_keeps_checkpoint_steps_and_moments(tmp_path):
    from fused_zero import checkpoint
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    fresh = copy.deepcopy(model)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        opt = ShardedOptimizer(model.parameters(), stage=2, lr=1e-3)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 6, dtype=torch.float32)).square().mean().backward()
            opt.step()
        for p in opt.state:
            opt.state[p]["step"].fill_(300.0)  # a count bf16 cannot hold (its neighbours: 298, 300, 302)
        opt.state[next(model.parameters())]["step"].fill_(301.0)
        checkpoint.save(str(tmp_path / "ck"), model, opt)
        loaded = ShardedOptimizer(fresh.parameters(), stage=2, lr=1e-3)
        checkpoint.load(str(tmp_path / "ck"), fresh, loaded)
        got, want = loaded.state_dict(), opt.state_dict()
    finally:
        torch.set_default_dtype(before)
    assert [float(s["step"]) for s in got["state"].values()] == [301.0, 300.0, 300.0, 300.0]
    for k, s in want["state"].items():
        for kind in ("exp_avg", "exp_avg_sq"):
            assert got["state"][k][kind].dtype == torch.float32 and torch.equal(got["state"][k][kind], s[kind])


def _stale_graph_second_backward(opt_d, d_net, g_net):
    """A GAN's mistake: the discriminator steps between two backwards through one retained graph."""
    out = d_net(g_net(torch.randn(5, 4, generator=torch.Generator().manual_seed(0))))
    out.square().mean().backward(retain_graph=True)
    opt_d.step()
    out.mean().backward()


@pytest.mark.parametrize("kind", ["torch", "stage1", "stage2", "stage3", "stage1_behind", "stage3_per_module"])
def test_a_backward_through_a_graph_saved_before_the_step_raises_as_torchs(kind):
    """The update writes the flat buffers the parameters view, unseen by autograd: a graph saved before the step
    and run backward after it silently mixed old activations with the new weights (torch raises)."""
    torch.manual_seed(0)
    g_net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    d_net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    if kind == "torch":
        opt_d = torch.optim.AdamW(d_net.parameters())  # (its fused update does not mark the parameters written)
    else:
        stage = int(kind[5])
        opt_d = ShardedOptimizer(d_net if stage == 3 else d_net.parameters(), stage=stage,
                                 **({"update_behind": True, "module": d_net} if "behind" in kind else {}),
                                 **({"min_unit_numel": 0} if "per_module" in kind else {}))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _stale_graph_second_backward(opt_d, d_net, g_net)
    # the next steps are as ever: fresh graphs, no refusal of the optimizer's own writes as user code's
    for _ in range(2):
        opt_d.zero_grad()
        d_net(torch.randn(3, 4)).mean().backward()
        opt_d.step()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_parameter_without_a_gradient_is_not_marked_written(stage):
    """Only what the step updates is marked written, as torch's update skips a parameter without a .grad: a graph
    through an unused layer stays usable across the step."""
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4), "idle": torch.nn.Linear(4, 4)})
    opt = ShardedOptimizer(model if stage == 3 else model.parameters(), stage=stage, min_unit_numel=0)
    opt.zero_grad()
    model["used"](torch.randn(2, 4)).sum().backward()
    idle, used = model["idle"].weight._version, model["used"].weight._version
    opt.step()
    assert model["idle"].weight._version == idle
    assert model["used"].weight._version > used


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_aliases_taken_before_the_build_keep_the_initial_values(stage):
    """torch's in-place update keeps every alias of a parameter current; building moves each parameter into the
    optimizer's flat buffer, so an alias taken before keeps the initial values (README's habits table), and one
    taken after the build follows the training (stage 3: inside full_parameters()). zero_grad(set_to_none=False)
    leaves stages 2-3's .grad None, where torch leaves zeros."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    before = model[0].weight.detach()
    initial = before.clone()
    opt = ShardedOptimizer(model, lr=1e-2, stage=stage)
    after = None if stage == 3 else model[0].weight.detach()
    for _ in range(2):
        opt.zero_grad(set_to_none=False)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    assert torch.equal(before, initial)
    with opt.full_parameters() if stage == 3 else contextlib.nullcontext():
        now = model[0].weight.detach().clone()
    assert not torch.equal(now, initial)
    if after is not None:
        assert torch.equal(after, now)
    opt.zero_grad(set_to_none=False)
    assert (model[0].weight.grad is None) == (stage != 1)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_state_dict_saved_between_loading_and_the_next_step_holds_the_loaded_masters(stage):
    """opt.load_state_dict(osd), then model.load_state_dict(msd), then opt.state_dict() before any step (a script
    that converts or re-saves a checkpoint): the bf16 parameters' fp32 masters are the saved ones (they were the
    masters of the weights from before the load: resuming from the re-saved dict went off the uninterrupted run)."""
    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).bfloat16()
        return model, ShardedOptimizer(model.parameters(), lr=1e-2, stage=stage, bucket_numel=64)

    def train(model, opt, steps):
        for t in steps:
            opt.zero_grad()
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(t)).bfloat16()
            model(x).float().square().mean().backward()
            opt.step()

    model, opt = build(0)
    train(model, opt, range(3))
    msd, osd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    train(model, opt, range(3, 5))
    model2, opt2 = build(9)
    opt2.load_state_dict(copy.deepcopy(osd))
    model2.load_state_dict(msd)
    resaved = copy.deepcopy(opt2.state_dict())
    for i, s in osd["state"].items():
        assert torch.equal(resaved["state"][i]["master"], s["master"]), i
    model3, opt3 = build(9)
    model3.load_state_dict(msd)
    opt3.load_state_dict(resaved)
    train(model3, opt3, range(3, 5))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model3.parameters()))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
@pytest.mark.parametrize("found_inf", [0.0, 1.0])
def test_fused_amp_attributes_of_one_element_of_any_shape_as_torchs(stage, shape, found_inf):
    """optimizer.grad_scale / found_inf (torch's fused-optimizer AMP attributes, which a GradScaler sets): one
    element of any shape, as torch's fused AdamW takes them (an older GradScaler's scale had shape (1,); stage 1
    multiplied its kept .grad by it and raised after the update)."""
    def run(make):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = make(model)
        for t in range(2):
            opt.zero_grad()
            (model(torch.randn(5, 4)).square().mean() * 4).backward()
            opt.grad_scale = torch.full(shape, 4.0)
            opt.found_inf = torch.tensor(found_inf if t else 0.0)
            opt.step()
        return model, opt

    ref, ref_opt = run(lambda m: torch.optim.AdamW(m.parameters(), fused=True))
    model, opt = run(lambda m: ShardedOptimizer(m if stage == 3 else m.parameters(), stage=stage))
    with opt.full_parameters() if stage == 3 else contextlib.nullcontext():
        assert _max_err(model, ref) <= TOL
    if stage == 1:  # torch's fused step unscales the kept .grad in place, and leaves them scaled when skipped
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=TOL, atol=0)
    assert [float(opt.state[p]["step"]) for p in model.parameters()] == \
        [float(ref_opt.state[q]["step"]) for q in ref.parameters()]


@pytest.mark.parametrize("stage", [1, 2])
def test_fused_amp_attribute_of_several_elements_is_refused_naming_it(stage):
    model = torch.nn.Linear(4, 3)
    opt = ShardedOptimizer(model.parameters(), stage=stage)
    model(torch.randn(5, 4)).sum().backward()
    opt.grad_scale = torch.ones(2)
    with pytest.raises(TypeError, match=r"optimizer.grad_scale must be a one-element tensor"):
        opt.step()


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("as_float", [False, True])
def test_a_step_count_read_after_load_state_dict_follows_later_steps_as_torchs(stage, as_float):
    """state[p]["step"] read right after load_state_dict is the tensor later steps advance, as torch's load leaves
    its own tensor there and advances it in place (it was the loaded copy, left behind by the first step)."""
    def run(make):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = make(model)

        def train(steps):
            for t in steps:
                opt.zero_grad()
                model(torch.randn(5, 4, generator=torch.Generator().manual_seed(t))).square().mean().backward()
                opt.step()
        train(range(2))
        sd = copy.deepcopy(opt.state_dict())
        if as_float:
            for s in sd["state"].values():
                s["step"] = float(s["step"])
        opt.load_state_dict(sd)
        held = {name: opt.state[p]["step"] for name, p in model.named_parameters()}
        train(range(2, 3))
        return model, {name: (float(t), t is opt.state[p]["step"]) for (name, t), p in
                       zip(held.items(), model.parameters())}

    ref, ref_held = run(lambda m: torch.optim.AdamW(m.parameters()))
    model, held = run(lambda m: ShardedOptimizer(m.parameters(), stage=stage))
    assert held == ref_held == {"weight": (3.0, True), "bias": (3.0, True)}
    assert _max_err(model, ref) <= TOL


@pytest.mark.parametrize("stage", [1, 2])
def test_a_betas_list_is_kept_and_followed_when_edited_in_place_as_torch(stage):
    """torch keeps the betas object a group was given: a list edited in place (betas[0] = 0.5, or through
    param_groups) is what its next step uses. It was replaced by a tuple here: the edit was ignored, and an item
    assignment through param_groups raised TypeError."""
    runs = []
    for make in (lambda g: torch.optim.AdamW(g, lr=1e-2), lambda g: ShardedOptimizer(g, lr=1e-2, stage=stage)):
        torch.manual_seed(0)
        m, betas = torch.nn.Linear(4, 3), [0, 0.999]  # an int too (a config file's beta1 = 0)
        opt = make([{"params": m.parameters(), "betas": betas}])
        assert opt.param_groups[0]["betas"] is betas
        shared = [0.9, 0.999]  # the constructor's default is a tuple of its own, as torch's: not the caller's list
        assert type(make(torch.nn.Linear(2, 2).parameters()).__class__(
            torch.nn.Linear(2, 2).parameters(), betas=shared).param_groups[0]["betas"]) is tuple
        for t in range(4):
            if t == 2:
                betas[0] = 0.9
                opt.param_groups[0]["betas"][1] = 0.99
            m(torch.randn(2, 4, generator=torch.Generator().manual_seed(t))).square().sum().backward()
            opt.step()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in m.parameters()])
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(*runs))
