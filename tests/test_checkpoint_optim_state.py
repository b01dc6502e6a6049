"""ShardedOptimizer.state_dict() / load_state_dict() (fused_zero.checkpoint.optim_state):
torch.optim.AdamW's format and contract, at world sizes 1, 2 and 3 and stages 1, 2 and 3.

Every step trains on one global batch of 12 samples split evenly over the ranks (as in
test_checkpoint), so runs at other world sizes follow the same trajectory up to rounding.
"""
import copy
import io
import os

import pytest
import torch

from _dist import run_ranks
from _models import HYPER, TinyNet, is_initialized, param_groups, rel
from fused_zero import ShardedOptimizer
from fused_zero.checkpoint import optim_state

pytest.importorskip("safetensors", reason="fused_zero.checkpoint imports safetensors: pip install safetensors")
from test_checkpoint import BUCKET, GLOBAL, M, N, TOL, _global, _train  # noqa: E402

assert GLOBAL % 6 == 0  # world sizes 1, 2 and 3 split it evenly
GATHER = 300  # elements per all-gather in these tests: chunks end inside pieces and buckets


def _build(stage, dtype=torch.float32, model_sd=None, lr=None, groups=None):
    """TinyNet (optionally given weights) and its ShardedOptimizer: 3 param groups at stages 1-2,
    the model itself (one group) at stage 3 unless ``groups``."""
    model = TinyNet(dtype=dtype)
    if model_sd is not None:
        model.load_state_dict(model_sd)
    groups = stage != 3 if groups is None else groups
    params = param_groups(model) if groups else model
    opt = ShardedOptimizer(params, **HYPER, stage=stage, bucket_numel=BUCKET, module=model if stage == 3 else None)
    if lr is not None:  # must come back from the state dict
        for g in opt.param_groups:
            g["lr"] = lr
    return model, opt


def _params(model, opt):
    with opt.full_parameters():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _model_sd(model, opt):
    with opt.full_parameters():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _through_bytes(obj):
    """torch.save then torch.load(weights_only=True), as frameworks store the dict."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _equal_state_dicts(a, b):
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(_same(a["state"][i], b["state"][i]) for i in a["state"])


def _round_trip(rank, ws, stage, dtype=torch.float32):
    """Train N, state_dict (through bytes), load into a fresh model + optimizer, train M on both."""
    model, opt = _build(stage, dtype)
    _train(model, opt, None, 0, N, ws, rank, dtype)
    sd = _through_bytes(opt.state_dict())
    model_sd = _model_sd(model, opt)
    fresh, fopt = _build(stage, dtype, model_sd, lr=0.5)
    before = _params(fresh, fopt)
    fopt.load_state_dict(sd)
    out = {"unchanged": _same(before, _params(fresh, fopt)),
           "lr_back": [g["lr"] for g in fopt.param_groups] == [g["lr"] for g in opt.param_groups],
           "same_state_dict": _equal_state_dicts(sd, fopt.state_dict()), "sd": sd,
           "losses": _train(model, opt, None, N, M, ws, rank, dtype),
           "fresh_losses": _train(fresh, fopt, None, N, M, ws, rank, dtype)}
    out["params_equal"] = _same(_params(model, opt), _params(fresh, fopt))
    return out


def _check_round_trip(res):
    assert res["unchanged"], "load_state_dict changed the parameters"
    assert res["lr_back"] and res["same_state_dict"]
    assert res["losses"] == res["fresh_losses"]
    assert res["params_equal"]


def _bad_dicts(sd):
    """(name, state dict, what the error says) for dicts that do not fit a 3-group TinyNet optimizer."""
    fewer = {"state": sd["state"], "param_groups": sd["param_groups"][:2]}
    short = copy.deepcopy(sd)
    short["param_groups"][0]["params"] = short["param_groups"][0]["params"][:-1]
    shaped = copy.deepcopy(sd)
    i = shaped["param_groups"][0]["params"][0]
    shaped["state"][i]["exp_avg"] = shaped["state"][i]["exp_avg"][:1]
    no_lr = copy.deepcopy(sd)
    del no_lr["param_groups"][1]["lr"]
    step = copy.deepcopy(sd)
    step["state"][i]["step"] = "four"
    return [("groups", fewer, "loaded state dict has a different number of parameter groups"),
            ("size", short, "loaded state dict contains a parameter group that doesn't match the size of "
                            "optimizer's group"),
            ("shape", shaped, f"state {i} exp_avg [1"),
            ("hyper", no_lr, "lacks the hyperparameters ['lr']"),
            ("step", step, "a step count must be a number"),
            ("old", {"state": {}, "param_groups": [], "fused_zero": {}}, "per-rank shard format"),
            ("amsgrad", {**sd, "param_groups": [{**g, "amsgrad": True} for g in sd["param_groups"]]}, "amsgrad=True")]


def _mismatch_case(opt, model, bad):
    """Load ``bad``; (exception type, message, optimizer state and parameters untouched)."""
    before, shards = _params(model, opt), opt.state_dict()
    try:
        opt.load_state_dict(bad)
        got = (None, "")
    except Exception as e:  # noqa: BLE001
        got = (type(e).__name__, str(e))
    return (*got, _same(before, _params(model, opt)) and _equal_state_dicts(shards, opt.state_dict()))


# -- the multi-rank runs ------------------------------------------------------------------------

def _rank(rank, ws, root):
    optim_state.GATHER_NUMEL = GATHER
    out = {f"stage{stage}": _round_trip(rank, ws, stage) for stage in (1, 2, 3)}
    out["bf16"] = _round_trip(rank, ws, 2, torch.bfloat16)
    for stage in (1, 2, 3):
        out[f"stage{stage}"].pop("sd")
    out["bf16"].pop("sd")
    # the reference for other world sizes: stage 2, N steps, saved from rank 0 only
    model, opt = _build(2)
    _train(model, opt, None, 0, N, ws, rank)
    sd = opt.state_dict()
    out["identical"] = sd
    if rank == 0:
        torch.save({"optim": sd, "model": _model_sd(model, opt)}, os.path.join(root, f"ws{ws}.pt"))
    out["cont"] = _train(model, opt, None, N, M, ws, rank)
    out["params"] = _params(model, opt)
    # a mismatched dict raises on every rank, and a dict that only rank 1 gets wrong too
    cases = _bad_dicts(sd)
    out["bad"] = {name: _mismatch_case(opt, model, bad) for name, bad, _ in cases}
    out["bad_on_rank1"] = _mismatch_case(opt, model, cases[0][1] if rank == 1 else sd)
    return out


def _load_rank(rank, ws, root, stage):
    saved = torch.load(os.path.join(root, "ws2.pt"), weights_only=True)
    model, opt = _build(stage, model_sd=saved["model"], groups=True)
    before = _params(model, opt)
    opt.load_state_dict(saved["optim"])
    return {"unchanged": _same(before, _params(model, opt)), "losses": _train(model, opt, None, N, M, ws, rank),
            "params": _params(model, opt)}


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not is_initialized()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("optim_state"))


@pytest.fixture(scope="module")
def runs(root):
    return {ws: run_ranks(_rank, ws, root, timeout=240) for ws in (2, 3)}


@pytest.mark.parametrize("case", ["stage1", "stage2", "stage3", "bf16"])
@pytest.mark.parametrize("ws", [2, 3])
def test_round_trip_continues_bitwise(runs, ws, case):
    for res in runs[ws]:
        _check_round_trip(res[case])


@pytest.mark.parametrize("ws", [2, 3])
def test_state_dict_identical_on_every_rank(runs, ws):
    first = runs[ws][0]["identical"]
    assert all(_equal_state_dicts(first, r["identical"]) for r in runs[ws][1:])


@pytest.mark.parametrize("ws", [2, 3])
def test_mismatched_dict_raises_on_every_rank(runs, ws):
    for name, _, msg in _bad_dicts(runs[ws][0]["identical"]):
        for rank, res in enumerate(runs[ws]):
            kind, text, untouched = res["bad"][name]
            assert kind in ("ValueError", "TypeError") and msg in text, (name, rank, kind, text)
            assert untouched, (name, rank)
    for rank, res in enumerate(runs[ws]):  # only rank 1's dict is bad: every rank raises
        kind, text, untouched = res["bad_on_rank1"]
        assert kind == "ValueError" and "different number of parameter groups" in text, (rank, kind, text)
        assert ("rank 1 failed" in text) == (rank != 1) and untouched


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_saved_at_2_loads_at_1(runs, root, stage):
    res = _load_rank(0, 1, root, stage)
    want = _global(runs[2], "cont")
    assert res["unchanged"]
    assert max(abs(a - b) / b for a, b in zip(res["losses"], want)) < TOL, (res["losses"], want)
    assert max(rel(p, runs[2][0]["params"][n]) for n, p in res["params"].items()) < TOL


@pytest.mark.parametrize("stage", [2, 3])
def test_saved_at_2_loads_at_3(runs, root, stage):
    results = run_ranks(_load_rank, 3, root, stage, timeout=120)
    got, want = _global(results, "losses"), _global(runs[2], "cont")
    assert all(r["unchanged"] for r in results)
    assert max(abs(a - b) / b for a, b in zip(got, want)) < TOL, (got, want)
    assert max(rel(p, runs[2][0]["params"][n]) for n, p in results[0]["params"].items()) < TOL


# -- world size 1 -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_round_trip_world_size_1(stage, dtype, monkeypatch):
    monkeypatch.setattr(optim_state, "GATHER_NUMEL", GATHER)
    res = _round_trip(0, 1, stage, dtype)
    _check_round_trip(res)
    masters = [s for s in res["sd"]["state"].values() if "master" in s]
    assert len(masters) == (len(res["sd"]["state"]) if dtype == torch.bfloat16 else 0)
    assert all(s["master"].dtype == torch.float32 for s in masters)


def _torch_run(stage):
    """torch.optim.AdamW after N steps, with the param groups _build(stage) gives the optimizer."""
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters() if stage == 3 else param_groups(model), **HYPER, foreach=False)
    _train(model, opt, None, 0, N, 1, 0)
    return model, opt


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_torch_adamw_state_loads(stage):
    tmodel, topt = _torch_run(stage)
    tsd = _through_bytes(topt.state_dict())
    model, opt = _build(stage, model_sd=tmodel.state_dict(), lr=0.5)
    before = _params(model, opt)
    opt.load_state_dict(tsd)
    assert _same(before, _params(model, opt))
    sd = opt.state_dict()
    assert sd["state"].keys() == tsd["state"].keys()
    for i, s in tsd["state"].items():
        assert _same(sd["state"][i], s), i
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in tsd["param_groups"]]
    want = _train(tmodel, topt, None, N, M, 1, 0)
    got = _train(model, opt, None, N, M, 1, 0)
    assert max(abs(a - b) / b for a, b in zip(got, want)) < TOL, (got, want)


def test_a_state_that_does_not_fit_names_the_parameter_at_stage_3():
    """Before: 'parameter of shape (0,)', the released placeholder's shape."""
    tmodel, topt = _torch_run(3)
    tsd = _through_bytes(topt.state_dict())
    first = next(iter(tsd["state"]))
    tsd["state"][first]["exp_avg"] = torch.zeros(3)
    model, opt = _build(3, model_sd=tmodel.state_dict())
    name = next(n for n, p in model.named_parameters() if p.requires_grad)
    with pytest.raises(ValueError, match=rf"state {first} exp_avg \[3\] \(parameter '{name}', shape \["):
        opt.load_state_dict(tsd)


@pytest.mark.parametrize("edit,words", [("no exp_avg", "without its other moment"), ("negative step", "has step -3.0")])
def test_a_malformed_state_is_refused_at_load(edit, words):
    """Before: taken silently (torch fails at its next step: KeyError, or a bias correction of a negative step)."""
    tmodel, topt = _torch_run(1)
    tsd = _through_bytes(topt.state_dict())
    first = next(iter(tsd["state"]))
    if edit == "no exp_avg":
        del tsd["state"][first]["exp_avg"]
    else:
        tsd["state"][first]["step"] = torch.tensor(-3.0)
    model, opt = _build(1, model_sd=tmodel.state_dict())
    with pytest.raises(ValueError, match=words):
        opt.load_state_dict(tsd)


def test_state_dict_loads_into_torch_adamw():
    model, opt = _build(2)
    _train(model, opt, None, 0, N, 1, 0)
    sd = _through_bytes(opt.state_dict())
    ref = TinyNet()
    ref.load_state_dict(model.state_dict())
    topt = torch.optim.AdamW(param_groups(ref), **HYPER, foreach=False)
    blank = topt.state_dict()
    assert {k for g in sd["param_groups"] for k in g} == {k for g in blank["param_groups"] for k in g}
    topt.load_state_dict(sd)
    tsd = topt.state_dict()
    assert tsd["state"].keys() == sd["state"].keys()
    for i, s in sd["state"].items():
        assert _same(tsd["state"][i], s), i
    want = _train(model, opt, None, N, M, 1, 0)
    got = _train(ref, topt, None, N, M, 1, 0)
    assert max(abs(a - b) / b for a, b in zip(got, want)) < TOL, (got, want)


def test_bf16_masters_other_than_the_parameters_are_not_used():
    """A saved master is used only where it rounds to the parameter; elsewhere the parameter wins."""
    model, opt = _build(2, torch.bfloat16)
    _train(model, opt, None, 0, N, 1, 0, torch.bfloat16)
    sd = opt.state_dict()
    fresh, fopt = _build(2, torch.bfloat16)  # the initial weights, not the trained ones
    before = _params(fresh, fopt)
    fopt.load_state_dict(sd)
    assert _same(before, _params(fresh, fopt))
    got = fopt.state_dict()["state"]
    params = [p for g in fopt.param_groups for p in g["params"]]
    differ = 0
    for i, s in sd["state"].items():
        p = params[i].detach()
        want = torch.where(s["master"].bfloat16() == p, s["master"], p.float())
        assert torch.equal(got[i]["master"], want), i
        differ += int((s["master"].bfloat16() != p).sum())
    assert differ > 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_masters_wait_for_the_weights_loaded_after_them(stage):
    """opt.load_state_dict(sd) before model.load_state_dict(msd): the saved masters the untrained weights do not
    round to are kept aside and taken in when the weights arrive, so the resumed run is the uninterrupted one
    bit for bit in either order (torch AdamW, without masters, has no order to care about)."""
    model, opt = _build(stage, torch.bfloat16)
    _train(model, opt, None, 0, N, 1, 0, torch.bfloat16)
    sd = _through_bytes(opt.state_dict())
    with opt.full_parameters() if stage == 3 else torch.no_grad():
        msd = copy.deepcopy(model.state_dict())
    want = _train(model, opt, None, N, M, 1, 0, torch.bfloat16)
    for order in ("model first", "optimizer first"):
        fresh, fopt = _build(stage, torch.bfloat16)
        if order == "model first":
            fresh.load_state_dict(msd)
            fopt.load_state_dict(sd)
        else:
            fopt.load_state_dict(sd)
            fresh.load_state_dict(msd)
        got = _train(fresh, fopt, None, N, M, 1, 0, torch.bfloat16)
        assert got == want, (order, got, want)
        with opt.full_parameters() if stage == 3 else torch.no_grad(), \
                fopt.full_parameters() if stage == 3 else torch.no_grad():
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters())), order


def _dcp_resume(rank, world_size, directory):
    """The FSDP user's resume through torch.distributed.checkpoint: get_model_state_dict/get_optimizer_state_dict,
    dcp.save; a fresh model and optimizer (whose state torch's helper creates by a zero-gradient step at lr 0),
    dcp.load, set_state_dict; then a step, against the run that went on (stages 2 and 3)."""
    import contextlib

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_state_dict
    out = {}
    for stage in (2, 3):
        def build():
            model = TinyNet()
            return model, ShardedOptimizer(model if stage == 3 else model.parameters(), **HYPER, stage=stage,
                                           bucket_numel=BUCKET)

        def full(opt, writeback=False):
            return opt.full_parameters(writeback) if stage == 3 else contextlib.nullcontext()

        torch.manual_seed(0)
        model, opt = build()
        _train(model, opt, None, 0, 2, world_size, rank)
        with full(opt):
            msd = {k: v.clone() for k, v in get_model_state_dict(model).items()}
        path = os.path.join(directory, f"stage{stage}")
        dcp.save({"model": msd, "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
        torch.manual_seed(1)
        new, new_opt = build()
        with full(new_opt, writeback=True):  # the load goes into the model's own state dict
            sd = {"model": get_model_state_dict(new), "optim": get_optimizer_state_dict(new, new_opt)}
            dcp.load(sd, checkpoint_id=path)
            set_state_dict(new, new_opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        out[stage] = [new_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]]
        _train(model, opt, None, 2, 1, world_size, rank)
        _train(new, new_opt, None, 2, 1, world_size, rank)
        with full(opt), full(new_opt):
            out[stage].append(max(rel(p, q) for p, q in zip(new.parameters(), model.parameters())))
    return out


def test_torch_distributed_checkpoint_resumes_a_fresh_optimizer(tmp_path):
    """Before: torch's get_optimizer_state_dict on a fresh optimizer (its zero-gradient step at lr 0) was
    refused at stages 2-3 as '.grad assigned by hand', leaving lr at 0."""
    for out in run_ranks(_dcp_resume, 2, str(tmp_path), timeout=180):
        for stage, (lr_kept, diff) in out.items():
            assert lr_kept and diff == 0.0, (stage, diff)


def _dcp_flat_resume(rank, world_size, directory):
    """torchtitan's resume: get_state_dict / set_state_dict with flatten_optimizer_state_dict=True, through dcp.save and
    dcp.load, bf16 parameters at stages 1-3; then two steps, against the run that went on. DCP rebuilds each
    parameter's state from the keys of ``optimizer.state[p]``, so the fp32 master must be one of them."""
    import contextlib

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    out = {}
    for stage in (1, 2, 3):
        def full(opt, writeback=False):
            return opt.full_parameters(writeback) if stage == 3 else contextlib.nullcontext()

        model, opt = _build(stage, torch.bfloat16)
        _train(model, opt, None, 0, N, world_size, rank, torch.bfloat16)
        with full(opt):
            msd, osd = get_state_dict(model, opt, options=flat)
            path = os.path.join(directory, f"stage{stage}")
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        new, new_opt = _build(stage, torch.bfloat16)
        with full(new_opt, writeback=True):
            msd, osd = get_state_dict(new, new_opt, options=flat)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=path)
            set_state_dict(new, new_opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=flat)
        first = next(p for g in opt.param_groups for p in g["params"])
        out[stage] = {"keys": sorted(opt.state[first]),
                      "same": _train(model, opt, None, N, 2, world_size, rank, torch.bfloat16)
                      == _train(new, new_opt, None, N, 2, world_size, rank, torch.bfloat16)}
        with full(opt), full(new_opt):
            out[stage]["params"] = all(torch.equal(p, q) for p, q in zip(new.parameters(), model.parameters()))
    return out


def test_dcp_with_flattened_optimizer_state_resumes_bf16_bitwise(tmp_path):
    """Before: optimizer.state[p] showed no "master", so set_state_dict with flatten_optimizer_state_dict=True
    dropped the saved fp32 masters, the load rebuilt them from the bf16 weights, and the resumed run drifted
    (6e-3 relative after three steps) without a word."""
    for out in run_ranks(_dcp_flat_resume, 2, str(tmp_path), timeout=240):
        for stage, got in out.items():
            assert got["keys"] == ["exp_avg", "exp_avg_sq", "master", "step"], (stage, got)
            assert got["same"] and got["params"], (stage, got)


def test_a_state_with_a_step_and_no_moments_is_refused_naming_dcp_flattening(tmp_path):
    """offload_optimizer="nvme" keeps the moments in files, so optimizer.state[p] holds "step" only and DCP's
    flatten_optimizer_state_dict=True loads states of a step alone (torch's AdamW would fail at its next step with a
    KeyError). Before: the load started the moments from zeros, keeping the step count, silently."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model = TinyNet()
    opt = ShardedOptimizer(model.parameters(), **HYPER, stage=1, offload_optimizer="nvme", nvme_path=str(tmp_path))
    _train(model, opt, None, 0, N, 1, 0)
    msd, osd = get_state_dict(model, opt, options=flat)
    assert any(k.endswith(".exp_avg") for k in osd)  # saved: the moments are in the flat dict
    new = TinyNet()
    new_opt = ShardedOptimizer(new.parameters(), **HYPER, stage=1, offload_optimizer="nvme", nvme_path=str(tmp_path))
    with pytest.raises(ValueError, match="flatten_optimizer_state_dict=False"):
        set_state_dict(new, new_opt, model_state_dict=msd, optim_state_dict=osd, options=flat)
    sd = opt.state_dict()
    sd["state"][0] = {"step": sd["state"][0]["step"]}  # by hand: the same
    with pytest.raises(ValueError, match="holds 'step' but no moments"):
        new_opt.load_state_dict(sd)
    opt.close(), new_opt.close()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_consolidate_keeps_what_state_dict_keeps_beyond_the_moments(stage, tmp_path):
    """``opt.state["epoch"] = 7`` and a key of the user's own in a parameter's state: ``state_dict()`` keeps them
    as torch's does, ``checkpoint.load`` restores them, and the consolidated torch.optim.AdamW state dict keeps them
    too, in the same places (before: consolidate dropped them without a word)."""
    from fused_zero import checkpoint as ckpt
    model, opt = _build(stage)
    _train(model, opt, None, 0, 2, 1, 0)
    first = next(p for g in opt.param_groups for p in g["params"])
    opt.state["epoch"] = 7
    opt.state[first]["mine"] = {"seen": 3}
    ckpt.save(str(tmp_path), model, opt)
    _, consolidated = ckpt.consolidate(str(tmp_path))
    sd = opt.state_dict()
    assert list(consolidated["state"]) == list(sd["state"]) and consolidated["state"]["epoch"] == 7
    assert consolidated["state"][0]["mine"] == sd["state"][0]["mine"] == {"seen": 3}
    assert all(torch.equal(consolidated["state"][0][k], sd["state"][0][k]) for k in ("step", "exp_avg"))
    ref = torch.optim.AdamW(TinyNet().parameters() if stage == 3 else param_groups(TinyNet()), **HYPER)
    ref.load_state_dict(consolidated)  # torch takes it as it is
    assert ref.state["epoch"] == 7
