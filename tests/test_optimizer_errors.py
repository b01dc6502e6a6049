"""ShardedOptimizer's misuse errors: a clear exception with a helpful message, never a hang.

Cross-rank checks run on 2 gloo ranks (every rank must raise, then the group must still
work); the rest run in the pytest process without a process group.
"""
import copy
import re

import numpy as np
import pytest
import torch
import torch.nn as nn

from _dist import run_ranks
from _models import TinyNet, is_initialized, param_groups
from fused_zero import ShardedOptimizer

# --- cross-rank consistency ------------------------------------------------------------------


def _mismatch_model(rank, kind):
    if kind == "shape" and rank == 1:
        return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 5))
    if kind == "count" and rank == 1:
        return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(4, 4))
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))


def _mismatch_rank(rank, ws):
    out = {}
    for kind in ("shape", "count"):
        for stage in (1, 2):
            model = _mismatch_model(rank, kind)
            try:
                ShardedOptimizer(model.parameters(), stage=stage, bucket_numel=64)
                out[f"{kind}_stage{stage}"] = None
            except Exception as e:  # noqa: BLE001 - reported to the parent
                out[f"{kind}_stage{stage}"] = (type(e).__name__, str(e))
    # the group still works after the errors: a valid optimizer steps in lockstep
    model = _mismatch_model(0, "none")
    opt = ShardedOptimizer(model.parameters(), stage=2, bucket_numel=64)
    model(torch.ones(2, 8) * (rank + 1)).square().mean().backward()
    opt.step()
    out["healthy"] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.fixture(scope="module")
def mismatch():
    return run_ranks(_mismatch_rank, 2, timeout=90)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("kind", ["shape", "count"])
def test_params_differ_across_ranks(mismatch, kind, stage):
    """Every rank raises ValueError at construction, with a message saying the ranks differ."""
    for rank, res in enumerate(mismatch):
        err = res[f"{kind}_stage{stage}"]
        assert err is not None, f"rank {rank} built an optimizer over {kind}-mismatched parameters"
        name, msg = err
        assert name == "ValueError", (rank, name, msg)
        assert re.search(r"(?i)differ|mismatch", msg) and re.search(r"(?i)rank", msg), msg


def test_group_still_usable_after_mismatch(mismatch):
    a, b = (res["healthy"] for res in mismatch)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# --- single-process errors -------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not is_initialized()


@pytest.mark.parametrize("stage", [1, 2])
def test_sparse_gradient_raises_naming_the_fix(stage):
    emb = nn.Embedding(20, 8, sparse=True)
    head = nn.Linear(8, 2)
    opt = ShardedOptimizer(list(emb.parameters()) + list(head.parameters()), stage=stage)
    with pytest.raises((RuntimeError, ValueError, TypeError), match=r"(?i)sparse") as info:
        head(emb(torch.tensor([[1, 2, 3]]))).sum().backward()
        opt.step()
    assert re.search(r"sparse=False|dense", str(info.value)), str(info.value)


def test_stage1_refused_grad_then_mended_steps_as_torch():
    """A kept .grad the step cannot take is refused before anything changes; mended, the next step() reduces
    it (the refusal is not remembered alone) and equals torch AdamW."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    ref = copy.deepcopy(model)
    opt = ShardedOptimizer(model.parameters(), stage=1, lr=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, fused=True)  # (the CPU update's kernel: bitwise)
    x = torch.randn(4, 6)
    for m in (model, ref):
        m(x).square().sum().backward()
    good = model.weight.grad
    before = [p.detach().clone() for p in model.parameters()]
    for bad in (good.to_sparse(), torch.zeros(good.numel())):
        if bad.is_sparse:
            model.weight.grad = bad
        else:
            model.weight.grad.data = bad
        with pytest.raises(RuntimeError, match="sparse|must match its parameter"):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        model.weight.grad = None
        model.weight.grad = good.clone()
    opt.step()
    ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_complex_parameter_raises_type_error():
    p = nn.Parameter(torch.zeros(4, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"(?i)complex"):
        ShardedOptimizer([p, nn.Parameter(torch.zeros(3))])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_frozen_complex_parameter_is_refused_naming_a_buffer(stage):
    model = nn.Linear(4, 4)
    model.fixed = nn.Parameter(torch.zeros(4, dtype=torch.complex64), requires_grad=False)
    with pytest.raises(TypeError, match=r"complex \(torch.complex64\) and frozen.*register_buffer"):
        ShardedOptimizer(model, stage=stage)


def test_parameter_in_two_groups():
    model = TinyNet()
    groups = param_groups(model)
    groups[2]["params"] = groups[2]["params"] + [groups[0]["params"][0]]
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        ShardedOptimizer(groups)


def test_parameter_in_two_groups_via_add_param_group():
    model = TinyNet()
    groups = param_groups(model)
    opt = ShardedOptimizer(groups[:2])
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        opt.add_param_group({"params": [groups[0]["params"][1]]})


def test_stage3_needs_a_module():
    model = TinyNet()
    with pytest.raises(ValueError, match=r"(?i)module"):
        ShardedOptimizer(model.parameters(), stage=3)
    with pytest.raises(TypeError, match="module= takes the model"):  # (an AttributeError from inside before)
        ShardedOptimizer(model.parameters(), stage=3, module="model")


def test_invalid_stage_raises():
    with pytest.raises(ValueError, match=r"(?i)stage"):
        ShardedOptimizer(TinyNet().parameters(), stage=4)


@pytest.mark.parametrize("kwargs", [
    dict(lr=-1e-3),
    dict(betas=(1.0, 0.999)),
    dict(betas=(0.9, -0.5)),
    dict(eps=-1e-8),
    dict(weight_decay=-0.1),
])
def test_invalid_hyperparameters_use_torch_wording(kwargs):
    """Same exception and message as torch.optim.AdamW (e.g. "Invalid learning rate: -0.001")."""
    with pytest.raises(ValueError) as torch_err:
        torch.optim.AdamW(TinyNet().parameters(), **kwargs)
    assert str(torch_err.value).startswith("Invalid ")
    with pytest.raises(ValueError, match=re.escape(str(torch_err.value))):
        ShardedOptimizer(TinyNet().parameters(), **kwargs)


@pytest.mark.parametrize("key,value,what", [
    ("lr", torch.tensor([1e-3, 1e-3]), "lr"),
    ("eps", torch.tensor([1e-8, 1e-8]), "eps"),
    ("weight_decay", torch.tensor([0.1, 0.2]), "weight_decay"),
    ("weight_decay", torch.tensor([]), "weight_decay"),
    ("betas", (torch.tensor([0.9, 0.8]), torch.tensor(0.999)), r"betas\[0\]"),
    ("betas", (torch.tensor(0.9), torch.tensor([0.99, 0.999])), r"betas\[1\]"),
])
@pytest.mark.parametrize("where", ["defaults", "group", "add_param_group"])
def test_a_multi_element_tensor_hyperparameter_is_refused_naming_it(key, value, what, where):
    """torch's "Tensor lr must be 1-element" for every hyperparameter: a multi-element eps or weight_decay raised
    "Boolean value of Tensor with more than one value is ambiguous" (RuntimeError) before."""
    params = list(TinyNet().parameters())
    match = f"Tensor {what} must be 1-element: give {what} as a number or a one-element tensor"
    with pytest.raises(ValueError, match=match):
        if where == "defaults":
            ShardedOptimizer(params, **{key: value})
        elif where == "group":
            ShardedOptimizer([{"params": params, key: value}])
        else:
            opt = ShardedOptimizer(params[:2])
            opt.add_param_group({"params": params[2:], key: value})


@pytest.mark.parametrize("betas", [0.9, None, {0.5, 0.999}])
def test_betas_not_a_pair_is_a_type_error_as_in_torch(betas):
    """torch.optim.AdamW raises TypeError for betas that are no sequence (a set or dict too: no order; they were taken
    in iteration order); a ValueError before. A sequence of another length stays a ValueError."""
    with pytest.raises(TypeError):
        torch.optim.AdamW(TinyNet().parameters(), betas=betas)
    with pytest.raises(TypeError, match=r"betas must be a pair \(beta1, beta2\), e.g. \(0.9, 0.999\), got"):
        ShardedOptimizer(list(TinyNet().parameters()), betas=betas)
    with pytest.raises(TypeError, match="betas must be a pair"):
        ShardedOptimizer([{"params": list(TinyNet().parameters()), "betas": betas}])
    params = list(TinyNet().parameters())
    opt = ShardedOptimizer(params[:2])
    with pytest.raises(TypeError, match="betas must be a pair"):
        opt.add_param_group({"params": params[2:], "betas": betas})
    with pytest.raises(ValueError, match="betas must be a pair"):
        ShardedOptimizer(list(TinyNet().parameters()), betas=(0.9,))


def test_betas_edited_to_a_non_pair_is_a_type_error_at_step():
    """torch's update raises TypeError ("cannot unpack non-iterable float object"); a ValueError before."""
    model = nn.Linear(4, 2)
    opt = ShardedOptimizer(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.param_groups[0]["betas"] = 0.9
    with pytest.raises(TypeError, match="param group 0's betas must be a pair"):
        opt.step()
    opt.param_groups[0]["betas"] = (0.9,)
    with pytest.raises(ValueError, match="param group 0's betas must be a pair"):
        opt.step()
    opt.param_groups[0]["betas"] = (0.9, 0.999)
    opt.step()


def test_params_on_different_devices():
    cpu = nn.Parameter(torch.zeros(16))
    meta = nn.Parameter(torch.empty(16, device="meta"))
    with pytest.raises((ValueError, RuntimeError, TypeError), match=r"(?i)device"):
        ShardedOptimizer([cpu, meta])


def test_empty_parameter_list_raises_like_torch():
    with pytest.raises(ValueError, match="optimizer got an empty parameter list"):
        ShardedOptimizer([])


@pytest.mark.parametrize("option,value,error", [
    ("adam_w_mode", "False", TypeError),  # a string from a YAML or CLI config: truthy, was taken as True
    ("overlap", "no", TypeError),
    ("reshard_after_forward", 0, TypeError),
    ("stage", True, ValueError),
    ("bucket_numel", True, ValueError),
    ("max_live_units", 2.0, ValueError),
    ("max_grad_norm", "1.0", TypeError),
    ("nvme_path", b"/tmp", TypeError),  # bytes: "Can't mix strings and bytes" from os.path.join before
])
def test_options_of_the_wrong_type_are_refused(option, value, error):
    with pytest.raises(error, match=option):
        ShardedOptimizer(list(TinyNet().parameters()), **{option: value})


@pytest.mark.parametrize("option,accepted", [("offload_optimizer", '"cpu" or "nvme"'),
                                             ("offload_params", '"cpu" or "nvme"'),
                                             ("param_comm", '"int8"'), ("grad_comm", '"int8" or "int4"')])
@pytest.mark.parametrize("value", [np.array(["cpu", "nvme"]), np.array("cpu"), ["cpu"], {"cpu": 1},
                                   torch.tensor([1, 2]), 1], ids=lambda v: type(v).__name__)
def test_a_string_option_of_another_type_is_a_type_error_naming_the_values(option, accepted, value):
    """An array for a string option met numpy's "truth value of an array ... is ambiguous" (ValueError) in the
    ``in`` check before; a 0-d array was kept as the option; a list or a number was a ValueError."""
    with pytest.raises(TypeError, match=f"{option} must be None, {accepted}" if "or" in accepted else
                       f"{option} must be None or {accepted}"):
        ShardedOptimizer(list(TinyNet().parameters()), stage=3, **{option: value})


def test_a_reduce_dtype_array_is_a_type_error():
    with pytest.raises(TypeError, match="reduce_dtype must be None, torch.float32"):
        ShardedOptimizer(list(TinyNet().parameters()), reduce_dtype=np.array([1, 2]))


def test_numpy_options_are_taken_as_python_values():
    import numpy
    opt = ShardedOptimizer(list(TinyNet().parameters()), bucket_numel=numpy.int64(4096), overlap=numpy.bool_(False),
                           stage=numpy.int32(2))
    assert (opt.config.bucket_numel, opt.config.overlap, opt.config.stage) == (4096, False, 2)
    assert type(opt.config.bucket_numel) is int and type(opt.config.overlap) is bool
    opt = ShardedOptimizer(list(TinyNet().parameters()), grad_comm=np.str_("int8"))
    assert type(opt.config.grad_comm) is str and opt.config.grad_comm == "int8"


@pytest.mark.parametrize("stage", [1, 2])
def test_parameters_sharing_memory_are_refused(stage):
    """torch steps views of one tensor in place, aliased; flat buffers would split them apart silently."""
    w = nn.Parameter(torch.randn(8))
    part = nn.Parameter(w.data[:4])
    with pytest.raises(ValueError, match="share memory"):
        ShardedOptimizer([w, part], stage=stage)
    with pytest.raises(ValueError, match="share memory"):
        ShardedOptimizer([{"params": [w]}, {"params": [part], "lr": 0.1}], stage=stage)
    pieces = torch.randn(8).split(4)  # disjoint views of one tensor: fine
    ShardedOptimizer([nn.Parameter(pieces[0]), nn.Parameter(pieces[1])], stage=stage)


def _one_option_differs(rank, ws):
    try:
        ShardedOptimizer(list(TinyNet().parameters()), stage=2, max_live_units=1 + rank, lr=1e-3 * (1 + rank % 1))
    except ValueError as e:
        return str(e)


def test_an_option_that_differs_across_ranks_is_named():
    """The refusal names the option and both values, not two whole option dicts."""
    for message in run_ranks(_one_option_differs, 2, timeout=60):
        assert "max_live_units = 2, rank 0 has 1" in message and len(message) < 400, message


def _refused_on_rank_1(rank, world_size, bad):
    model = TinyNet()
    kw = {"lr": dict(lr=-1.0), "stage": dict(stage=4), "capturable": dict(capturable=True),
          "process_group": dict(process_group="gloo")}.get(bad, {})
    params = list(model.parameters())
    if bad == "non-leaf":
        params = [params[0] * 2]
    elif bad == "float64":
        params = list(model.double().parameters())
    got = None
    try:
        ShardedOptimizer(params if rank == 1 else list(TinyNet().parameters()),
                         **{"stage": 2, **(kw if rank == 1 else {})})
    except (ValueError, TypeError) as e:
        got = (type(e).__name__, str(e))
    ShardedOptimizer(list(TinyNet().parameters()), stage=2)  # the next build meets as usual
    return got


@pytest.mark.parametrize("bad", ["lr", "stage", "capturable", "process_group", "non-leaf", "float64"])
def test_an_argument_refused_on_one_rank_is_refused_on_every_rank(bad):
    """A bad argument on one rank alone is raised there before the build meets the other ranks; they raise its
    reason too (the same class, naming the rank) instead of waiting for that rank until the group's timeout, and
    the next build on every rank goes as usual."""
    theirs, mine = run_ranks(_refused_on_rank_1, 2, bad, timeout=120)
    assert mine is not None and theirs is not None, (theirs, mine)
    assert theirs[0] == mine[0] and theirs[1] == f"rank 1 failed to build the ShardedOptimizer: {mine[1]}", theirs


def _rebuild_refused(rank, world_size, stage, bad):
    model = TinyNet()
    ref = TinyNet()
    opt = ShardedOptimizer(model if stage == 3 else model.parameters(), stage=stage, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(rank))

    def step(m, o):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    step(model, opt)
    kw = {"nvme": dict(offload_optimizer="nvme", nvme_path="/nonexistent/folder"),
          "units": dict(units=[nn.Linear(2, 2)])}[bad]
    try:
        ShardedOptimizer(model if stage == 3 else model.parameters(), stage=stage, **kw)
        refused = None
    except ValueError as e:
        refused = str(e)
    step(model, opt)  # the first optimizer goes on as if nothing happened
    if world_size == 1:
        step(ref, ref_opt)
        step(ref, ref_opt)
    with opt.full_parameters():
        return refused, max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("stage,bad", [(2, "nvme"), (3, "nvme"), (3, "units")])
def test_a_refused_rebuild_leaves_the_previous_optimizer_working(stage, bad):
    """A constructor that raises changes nothing: the NVMe folder and units= are checked before a previous
    optimizer over the same parameters is closed (it was closed first: 'a newer ShardedOptimizer took over')."""
    for refused, err in run_ranks(_rebuild_refused, 1, stage, bad, timeout=60):
        assert refused is not None and ("is not a folder" in refused or "not a submodule" in refused), refused
        assert err < 1e-6, err


def _built_before_init(rank, world_size, folder, stage):
    import torch.distributed as dist
    dist.destroy_process_group()  # as a script that builds the optimizer first, then init_process_group()
    model = TinyNet()
    opt = ShardedOptimizer(model if stage == 3 else model.parameters(), stage=stage)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world_size)
    model(torch.randn(2, 4, 16)).square().mean().backward()
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("stage", [1, 3])
def test_an_optimizer_built_before_init_process_group_refuses_to_step_alone(tmp_path, stage):
    """Built with no process group it trains its rank alone; once a group of several ranks exists, stepping
    would silently train every rank on its own data: refused on every rank."""
    for message in run_ranks(_built_before_init, 2, str(tmp_path), stage, timeout=60):
        assert message is not None and "built before torch.distributed.init_process_group()" in message, message


def _after_destroy(rank, world_size, folder):
    import torch.distributed as dist
    model = TinyNet()
    opt = ShardedOptimizer(model, stage=3, min_unit_numel=0)
    model(torch.randn(2, 4, 16)).square().mean().backward()
    opt.step()
    dist.barrier()
    dist.destroy_process_group()
    out = []
    for call in (lambda: model(torch.randn(2, 4, 16)), opt.close):
        try:
            call()
            out.append(None)
        except RuntimeError as e:
            out.append(str(e))
    dist.init_process_group("gloo", init_method=f"file://{folder}/again", rank=rank, world_size=world_size)
    return out


def test_collective_calls_after_destroy_process_group_name_the_order(tmp_path):
    """torch said 'Group <...ProcessGroup object at 0x...> is not registered'."""
    for out in run_ranks(_after_destroy, 2, str(tmp_path), timeout=60):
        assert all(m is not None and m.startswith("torch.distributed.destroy_process_group() ran before") for m in out)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lazy_module_not_materialized_is_refused_naming_the_dry_run(stage):
    import torch.nn as tnn

    from fused_zero import ShardedOptimizer
    model = tnn.Sequential(tnn.LazyLinear(4), tnn.ReLU(), tnn.Linear(4, 2))
    with pytest.raises(ValueError, match="Run one forward"):
        ShardedOptimizer(model if stage == 3 else model.parameters(), stage=stage, lr=1e-3)
    model(torch.randn(2, 3))  # materialized: built as any model
    ShardedOptimizer(model if stage == 3 else model.parameters(), stage=stage, lr=1e-3)


def test_complex_parameter_refusal_names_a_fix_that_works():
    import torch.nn as tnn

    from fused_zero import ShardedOptimizer
    w = tnn.Parameter(torch.randn(4, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"nn.Parameter\(torch.view_as_real\(w\)\)"):
        ShardedOptimizer([w], lr=1e-3)
    ShardedOptimizer([tnn.Parameter(torch.view_as_real(w.detach()))], lr=1e-3)  # what it says works


@pytest.mark.parametrize("stage", [1, 2])
def test_a_parameter_resized_in_place_is_refused_naming_it(stage):
    """HF's resize_token_embeddings keeps the Parameter and gives it bigger data: refused with the resize named
    (before: torch's size mismatch from the packing kernel's twin)."""
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 4))
    opt = ShardedOptimizer(model.parameters(), stage=stage, lr=1e-2, module=model)
    model[0].weight.data = torch.randn(20, 8)
    with pytest.raises(RuntimeError, match=r"parameter 0\.weight changed shape from \(16, 8\) to \(20, 8\).*resize"):
        model(torch.tensor([[1, 19]])).sum().backward()
        opt.step()


def test_grad_dtype_other_than_the_parameters_is_refused_naming_it():
    """torch 2.13's p.grad_dtype: set before the build it is refused there; set after, at the backward, naming it
    (the message blamed a .grad assigned by hand)."""
    model = nn.Linear(4, 2).bfloat16()
    for p in model.parameters():
        p.grad_dtype = torch.float32
    with pytest.raises(TypeError, match=r"grad_dtype torch.float32 \(its dtype is torch.bfloat16\).*unset"):
        ShardedOptimizer(model.parameters(), stage=2)
    model = nn.Linear(4, 2).bfloat16()
    opt = ShardedOptimizer(model.parameters(), stage=2)
    for p in model.parameters():
        p.grad_dtype = torch.float32
    with pytest.raises(RuntimeError, match="was given grad_dtype torch.float32 after the optimizer was built"):
        model(torch.randn(3, 4).bfloat16()).float().sum().backward()
    del opt
