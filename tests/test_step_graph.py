"""``capturable=True``: step()'s device work captured once and replayed (fused_zero/step_graph.py).

On CPU a CUDA graph is stood in for by ``_graph_twin.GraphTwin``: it records the body's aten ops and c10d
collectives at capture (running none of them for good: what they wrote is put back) and a replay runs them
again on the same tensors with the same numbers, without the body's Python. What a replay would miss (a
number baked in that changes between steps, a tensor that moved, host bookkeeping skipped) shows as a
difference from the same optimizer never captured, which every test here compares against bit for bit,
with an lr schedule, clipping, a GradScaler that overflows, accumulation, unused parameters, and a
``clip_grad_norm_`` call now and then (those steps run eagerly between replays). tests/test_step_graph_cuda.py
runs the same on a GPU with CUDA graphs.
"""
from __future__ import annotations

import contextlib
import gc
import os

import pytest
import torch

from _dist import run_ranks
from _graph_twin import GraphTwin
from _models import HYPER, PlainNet, TinyNet, batch, flags, loss_fn

STEPS = 10


@pytest.fixture(autouse=True)
def _graph_settings():
    """The tests in this process set step_graph's module settings (_setup): put them back after each."""
    import fused_zero.step_graph as sg

    before = sg.on_cpu, sg.new_graph, sg.WARMUP, os.environ.get("FUSED_ZERO_BACKEND")
    yield
    sg.on_cpu, sg.new_graph, sg.WARMUP, backend = before
    if backend is None:
        os.environ.pop("FUSED_ZERO_BACKEND", None)
    else:
        os.environ["FUSED_ZERO_BACKEND"] = backend


def _setup(capture: bool):
    import fused_zero.step_graph as sg

    # the ops' pure-torch twins, which decide a skipped step on the device as the Triton kernels do (torch's fused
    # CPU AdamW, the CPU default, reads the verdict on the host: no CUDA graph could hold that)
    os.environ["FUSED_ZERO_BACKEND"] = "torch"
    sg.on_cpu, sg.new_graph = True, GraphTwin
    sg.WARMUP = 2 if capture else 10 ** 9  # never captured: the eager body, every step


def _train(rank, world_size, stage, capture, recipe, dtype=torch.float32, capturable=True, new_graph=None):
    import fused_zero.step_graph as sg
    from fused_zero import ShardedOptimizer
    from fused_zero.host_read import counting

    _setup(capture)
    if new_graph is not None:
        sg.new_graph = new_graph
    model = TinyNet(dtype=dtype)
    opt = ShardedOptimizer(model.parameters(), **HYPER, stage=stage, bucket_numel=1000, capturable=capturable,
                           max_grad_norm=0.05 if "clip" in recipe else None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))  # lr changes every step
    amp = "amp" in recipe
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=3, enabled=amp)
    k = 2 if "accumulate" in recipe else 1
    reads, found = [], []
    for step in range(STEPS):
        with counting() as counted:
            opt.zero_grad()
            for micro in range(k):
                x, y = batch(step, rank, micro, dtype=dtype)
                # "unused": rank 1 leaves one parameter without a gradient every third step (a step it runs
                # eagerly: it reads the has-grad flags), while rank 0 replays; "never_used": one parameter never
                # gets a gradient
                uses = {"use_side": flags(step, rank)["use_side"]} if "unused" in recipe else \
                    {"use_branch": False} if "never_used" in recipe else {}
                with opt.no_sync() if micro < k - 1 else contextlib.nullcontext():
                    loss = loss_fn(model(x, **uses), y) / k
                    if amp and step == 6:
                        loss = loss * float("inf")  # an overflow: the step is skipped on every rank
                    scaler.scale(loss).backward()
            if "user_clip" in recipe and step % 4 == 3 or "clip_each_step" in recipe:
                if amp:
                    scaler.unscale_(opt)
                opt.clip_grad_norm_(0.05)
            if "unscale_every_other" in recipe and step % 2:  # keys taking turns at stage 1 (the scale applied)
                scaler.unscale_(opt)
            scaler.step(opt)
            if amp:  # kept, not copied: each step's verdict must stay what it was
                found += list(scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
            scaler.update()
            sched.step()
        reads.append(sum(counted.values()))
    graph = opt._graph
    states = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
              for s in opt.state_dict()["state"].values()]
    return dict(params=[p.detach().clone() for p in model.parameters()], states=states,
                versions=[p._version for p in model.parameters()],  # each step marks them written, replayed too
                scale=scaler.get_scale() if amp else None, bytes=opt.comm_bytes(), reads=reads,
                found=[float(t) for t in found], captures=graph.captures if graph else 0,
                replays=graph.replays if graph else 0)


def _same(a: dict, b: dict) -> None:
    assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))
    assert a["versions"] == b["versions"]
    for s, t in zip(a["states"], b["states"]):
        assert s.keys() == t.keys()
        for key in s:
            assert torch.equal(torch.as_tensor(s[key]), torch.as_tensor(t[key])), key
    assert a["scale"] == b["scale"] and a["bytes"] == b["bytes"] and a["found"] == b["found"]


def _both(rank, world_size, stage, recipe, dtype=torch.float32):
    return _train(rank, world_size, stage, False, recipe, dtype), _train(rank, world_size, stage, True, recipe, dtype)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("recipe", ["plain", "clip", "amp+clip"])
def test_replayed_steps_equal_eager_steps_bitwise_alone(stage, recipe):
    eager, replayed = _both(0, 1, stage, recipe)
    _same(eager, replayed)
    # and the optimizer built without capturable=True: lr goes to the kernels as float64 either way
    _same(_train(0, 1, stage, False, recipe, capturable=False), replayed)
    if "amp" in recipe:
        assert replayed["found"][6] == 1.0 and sum(replayed["found"]) == 1.0
    # step 1 gives the states, 2-3 warm up, 4 captures: every step after replays (an overflow too: the skip is
    # decided on the device)
    assert replayed["captures"] == 1 and replayed["replays"] == STEPS - 3
    assert eager["replays"] == 0
    assert sum(replayed["reads"][1:]) == 0  # a replayed step reads nothing on the host either


@pytest.mark.parametrize("stage", [1, 2])
def test_replayed_steps_equal_eager_steps_bitwise_in_bf16(stage):
    eager, replayed = _both(0, 1, stage, "amp+clip", torch.bfloat16)
    _same(eager, replayed)
    assert replayed["replays"] == STEPS - 3


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("recipe", ["accumulate+clip", "amp+user_clip", "unused+clip"])
def test_replayed_steps_equal_eager_steps_bitwise_on_two_ranks(stage, recipe):
    """Two gloo ranks: the stats all-reduce and the all-gather replayed (their bytes counted as eager). A step
    after ``clip_grad_norm_`` and one where a rank saw some parameter without a gradient run eagerly, and the
    graph serves the steps after them again (or is captured anew where the step counts parted)."""
    for eager, replayed in run_ranks(_both, 2, stage, recipe, timeout=300):
        _same(eager, replayed)
        assert replayed["replays"] >= 2, replayed
        if recipe == "accumulate+clip":
            assert replayed["captures"] == 1 and replayed["replays"] == STEPS - 3


@pytest.mark.parametrize("recipe", ["amp+clip_each_step", "clip_each_step"])
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage", [1, 2])
def test_steps_after_clip_grad_norm_replay_too(stage, world_size, recipe):
    """The frameworks' way (Accelerate, HF Trainer, Lightning): scaler.unscale_, clip_grad_norm_, scaler.step
    every step (or clip_grad_norm_ and step without a scaler). The clip's all-reduce runs eagerly before step();
    the step's body replays with the clip's norm and verdicts copied into static tensors. The first step runs
    eagerly (its states are new, and the scaler was not known to the clip)."""
    for eager, replayed in run_ranks(_both, world_size, stage, recipe, timeout=200):
        _same(eager, replayed)
        assert replayed["captures"] == 1 and replayed["replays"] == STEPS - 3


@pytest.mark.parametrize("stage", [1, 2])
def test_keys_taking_turns_each_keep_their_graph(stage):
    """Stage 1 with scaler.unscale_() every other step: the step applies the scale or not, two keys in turn."""
    eager, replayed = _both(0, 1, stage, "amp+unscale_every_other")
    _same(eager, replayed)
    assert replayed["captures"] == (2 if stage == 1 else 1)
    assert replayed["replays"] >= STEPS - 5


@pytest.mark.parametrize("stage", [1, 2])
def test_a_parameter_never_used_is_captured_alone(stage):
    """Alone, this rank's own has-grad flags are the answer: nothing to read, the step is captured."""
    eager, replayed = _both(0, 1, stage, "clip+never_used")
    _same(eager, replayed)
    assert replayed["replays"] == STEPS - 3 and sum(replayed["reads"]) == 0


def _never_used_among_ranks(rank, world_size):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _train(rank, world_size, 2, True, "clip+never_used")
    return out["replays"], [str(w.message) for w in caught if "capturable" in str(w.message)]


def test_a_parameter_never_used_among_ranks_is_warned_about():
    """Among ranks a missing gradient must be asked of the others (a read): such steps run eagerly, and after ten
    in a row the user is told which parameters and what to do."""
    for replays, messages in run_ranks(_never_used_among_ranks, 2, timeout=120):
        assert replays == 0
        assert len(messages) == 1, messages
        assert "no gradient for 2 parameters (" in messages[0] and "of shape (64, 64)" in messages[0]
        assert "requires_grad=False" in messages[0]


class _FailingGraph:
    def capture(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    def replay(self):
        raise AssertionError("never captured")


def test_a_failed_capture_warns_once_and_runs_eagerly():
    eager = _train(0, 1, 2, False, "clip")
    with pytest.warns(RuntimeWarning, match="capturing step.. as a CUDA graph failed") as caught:
        failed = _train(0, 1, 2, True, "clip", new_graph=_FailingGraph)
    assert len([w for w in caught if "capturing" in str(w.message)]) == 1
    _same(eager, failed)
    assert failed["captures"] == 0 and failed["replays"] == 0


class _GcWatchingGraph(GraphTwin):
    """The CPU twin, noting whether Python's garbage collector was on while the body was captured."""
    gc_during_capture: list = []

    @contextlib.contextmanager
    def capture(self):
        with super().capture():
            _GcWatchingGraph.gc_during_capture.append(gc.isenabled())
            yield


def test_no_garbage_is_collected_while_capturing():
    """A finalizer run by the collector mid-capture (an earlier optimizer's pinned buffer or event freed) is a CUDA
    call on the capturing thread and invalidates the capture (once on an H100, after the other CUDA tests): the
    collector is off during the capture and on again after it, and replays still equal eager steps."""
    assert gc.isenabled()
    eager = _train(0, 1, 2, False, "clip")
    _GcWatchingGraph.gc_during_capture.clear()
    replayed = _train(0, 1, 2, True, "clip", new_graph=_GcWatchingGraph)
    assert _GcWatchingGraph.gc_during_capture == [False] and gc.isenabled()
    _same(eager, replayed)
    assert replayed["captures"] == 1


def _detail(rank, world_size):
    import torch.distributed as dist

    import fused_zero.step_graph as sg
    from fused_zero import ShardedOptimizer

    sg.on_cpu = True
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        ShardedOptimizer(PlainNet().parameters(), capturable=True)
    except ValueError as e:
        return str(e)
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)


def test_capturable_is_refused_under_detail_debug_among_ranks():
    for message in run_ranks(_detail, 2, timeout=60):
        assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in message


def _new_key_mid_run(rank, world_size):
    from fused_zero import ShardedOptimizer

    out = []
    for capture in (False, True):
        _setup(capture)
        model = PlainNet()
        opt = ShardedOptimizer(model.parameters(), **HYPER, stage=2, capturable=True)
        for step in range(12):
            if step == 6:
                for g in opt.param_groups:
                    g["betas"] = (0.8, 0.99)  # baked into the graph: a new key, captured again
            opt.zero_grad()
            model(torch.randn(4, 16, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            opt.step()
        out.append(([p.detach().clone() for p in model.parameters()], opt._graph.captures, opt._graph.replays))
    return out


def _group_added_mid_run(rank, world_size, stage):
    from fused_zero import ShardedOptimizer

    out = []
    for capture in (False, True):
        _setup(capture)
        torch.manual_seed(7)
        model, extra = PlainNet(), torch.nn.Linear(16, 16)
        opt = ShardedOptimizer(model.parameters(), **HYPER, stage=stage, capturable=True)
        for step in range(12):
            if step == 6:
                opt.add_param_group({"params": extra.parameters(), "lr": 3e-3})  # new partitions: a new graph
            opt.zero_grad()
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
            model(extra(x) if step >= 6 else x).square().mean().backward()
            opt.step()
        out.append(([p.detach().clone() for p in [*model.parameters(), *extra.parameters()]], opt._graph.captures))
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_a_param_group_added_mid_run_is_captured_again(stage):
    for (eager, _), (replayed, captures) in run_ranks(_group_added_mid_run, 2, stage, timeout=200):
        assert all(torch.equal(p, q) for p, q in zip(eager, replayed))
        assert captures == 2


def test_a_changed_hyperparameter_is_captured_again():
    (eager, _, _), (replayed, captures, replays) = _new_key_mid_run(0, 1)
    assert all(torch.equal(p, q) for p, q in zip(eager, replayed))
    assert captures == 2 and replays == 3 + 4  # steps 4-6 under the first graph, 9-12 under the second


def test_capturable_is_refused_where_it_cannot_be_served(monkeypatch):
    import fused_zero.step_graph as sg
    from fused_zero import ShardedOptimizer

    with pytest.raises(ValueError, match="needs the parameters on a CUDA device"):
        ShardedOptimizer(PlainNet().parameters(), capturable=True)
    monkeypatch.setattr(sg, "on_cpu", True)
    with pytest.raises(ValueError, match="serves stages 1 and 2"):
        ShardedOptimizer(PlainNet(), stage=3, capturable=True)
    with pytest.raises(ValueError, match="offload_optimizer='cpu'"):
        ShardedOptimizer(PlainNet().parameters(), stage=2, capturable=True, offload_optimizer="cpu")
    model = PlainNet()
    opt = ShardedOptimizer(model.parameters(), capturable=True)
    opt.param_groups[0]["capturable"] = False  # the optimizer's setting, not a group's
    model(torch.randn(2, 16)).sum().backward()
    with pytest.raises(ValueError, match="capturable=False is not supported in a param group"):
        opt.step()


def test_a_torch_state_dict_keeps_the_optimizer_capturable(monkeypatch):
    """Loading torch AdamW's state (capturable=False in its groups) keeps this optimizer's own setting."""
    import fused_zero.step_graph as sg
    from fused_zero import ShardedOptimizer

    monkeypatch.setattr(sg, "on_cpu", True)
    model = PlainNet()
    ref = torch.optim.AdamW(model.parameters(), **HYPER)
    model(torch.randn(2, 16)).sum().backward()
    ref.step()
    opt = ShardedOptimizer(model.parameters(), capturable=True, **HYPER)
    opt.load_state_dict(ref.state_dict())
    assert opt.param_groups[0]["capturable"] is True
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
