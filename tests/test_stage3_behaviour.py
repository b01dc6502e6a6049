"""ZeRO stage 3 mechanics: gather order and prefetch, the pool bound, release on an exception,
full parameters on demand, eval, accounting (16Ψ/N bytes, 3Ψ traffic) and bad input.

Parity with DDP over many steps is tests/test_stage3_parity.py; here one spawn of two gloo
ranks measures the mechanics on the example GPT, and the tests assert.
"""
import collections
import copy
import dataclasses
import os
import sys

import pytest
import torch
from torch import nn

from _dist import run_ranks
from _models import HYPER, TinyNet, param_groups, rel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT, Block, GPTConfig, synthetic_batch  # noqa: E402

CFG = GPTConfig(vocab=96, d_model=32, n_layer=3, n_head=2, seq_len=16)
BUCKET = 2000


#: one stage-3 unit per module (no merging of small units): these tests watch each unit's gathers
PER_MODULE = dict(min_unit_numel=0)


class ReversedGPT(GPT):
    """Runs its blocks in reverse registration order: the recorded order must win."""

    def forward(self, idx, targets=None):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
        for block in reversed(self.blocks):
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _step(model, opt, step, rank):
    idx, tgt = synthetic_batch(CFG, 4, step=step, rank=rank)
    opt.zero_grad()
    loss = model(idx, tgt)[1]
    loss.backward()
    opt.step()
    return float(loss.detach())


def gather_log(opt) -> list:
    """The units in the order their gathers are issued from now on (a recorder around the gatherer)."""
    g = opt._stage.gatherer
    log, issue = [], g._issue

    def recording(u):
        if not (u.gathered or u.handles is not None):
            log.append(u.index)
        issue(u)
    g._issue = recording
    return log


def _snapshots(model, log):
    """Record the gather log as each block's forward starts (after our own pre-hook)."""
    seen = []
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: seen.append((i + 1, list(log))))
    return seen


def _mechanics(rank, world_size):
    from fused_zero import ShardedOptimizer

    out = {}
    model = GPT(CFG, seed=0)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER, foreach=False)
    opt = ShardedOptimizer(model, **HYPER, stage=3, bucket_numel=BUCKET, **PER_MODULE)
    g = opt._stage.gatherer
    out["units"] = [type(u.modules[0]).__name__ for u in g.units]
    log = gather_log(opt)
    seen = _snapshots(model, log)

    def both(step, ranks_data=True):
        _step(model, opt, step, rank)
        # the reference: the average of both ranks' gradients, as DDP would make them
        ref_opt.zero_grad()
        for r in range(world_size):
            idx, tgt = synthetic_batch(CFG, 4, step=step, rank=r)
            (ref(idx, tgt)[1] / world_size).backward()
        ref_opt.step()

    both(0)
    out["released_numel"] = [p.numel() for p in model.parameters()]
    seen.clear()
    log.clear()
    g.peak_bytes = 0
    idx, tgt = synthetic_batch(CFG, 4, step=1, rank=rank)
    opt.zero_grad()
    loss = model(idx, tgt)[1]
    out["log_forward"] = list(log)
    out["live"] = [(g.live_bytes, g.gathered_bytes())]  # the running total against the storages, as it goes
    loss.backward()
    out["log_step"] = list(log)
    out["seen"] = list(seen)
    out["peak"], out["pool"] = g.peak_bytes, g.pool_bytes()
    out["unit_bytes"] = [u.nbytes for u in g.units]
    opt.step()
    ref_opt.zero_grad()
    for r in range(world_size):
        i, t = synthetic_batch(CFG, 4, step=1, rank=r)
        (ref(i, t)[1] / world_size).backward()
    ref_opt.step()
    out["comm"] = opt.comm_bytes()
    out["flat_bytes"] = sum(part.layout.numel * 4 for part in opt.partitions)
    out["memory"] = opt.memory_bytes()
    out["shard_numel"] = sum(part.layout.shard_numel for part in opt.partitions)
    out["gathered_after_step"] = g.gathered_bytes()
    out["live"].append((g.live_bytes, g.gathered_bytes()))

    # eval under no_grad: one forward's gathers, all released
    log.clear()
    model.eval()
    with torch.no_grad():
        logits = model(idx)
    model.train()
    out["eval_log"], out["gathered_after_eval"] = list(log), g.gathered_bytes()
    out["live"].append((g.live_bytes, g.gathered_bytes()))
    with torch.no_grad():
        out["eval_err"] = rel(logits, ref(idx))

    # an exception inside a unit's forward releases what was gathered; training goes on
    blk = model.blocks[1]
    blk.forward = lambda x: (_ for _ in ()).throw(RuntimeError("boom"))
    try:
        model(idx, tgt)
        out["raised"] = False
    except RuntimeError as e:
        out["raised"] = "boom" in str(e)
    del blk.forward
    out["after_exception"] = (g.gathered_bytes(), g.state.value)
    out["live"].append((g.live_bytes, g.gathered_bytes()))
    both(2)

    # full parameters: readable, and writeback reaches the masters
    with opt.full_parameters(writeback=True):
        out["full_numel"] = [p.numel() for p in model.parameters()]
        out["live"].append((g.live_bytes, g.gathered_bytes()))
        with torch.no_grad():
            model.ln_f.weight.add_(0.5)
            ref.ln_f.weight.add_(0.5)
    both(3)
    with opt.full_parameters():
        refs = dict(ref.named_parameters())
        out["param_err"] = max(rel(p, refs[n]) for n, p in model.named_parameters() if not n.endswith("qkv.bias"))

    # no prefetch with one live unit
    m1 = GPT(CFG, seed=0)
    o1 = ShardedOptimizer(m1, **HYPER, stage=3, bucket_numel=BUCKET, max_live_units=1, **PER_MODULE)
    seen1 = _snapshots(m1, gather_log(o1))
    _step(m1, o1, 0, rank)
    out["seen_live1"] = list(seen1)
    out["peak_live1"], out["pool_live1"] = o1._stage.gatherer.peak_bytes, o1._stage.gatherer.pool_bytes()

    # the forward order is recorded on the first step and used from then on
    m2 = ReversedGPT(CFG, seed=0)
    o2 = ShardedOptimizer(m2, **HYPER, stage=3, bucket_numel=BUCKET, **PER_MODULE)
    _step(m2, o2, 0, rank)
    log2 = gather_log(o2)
    out["schedule_reversed"] = list(o2._stage.gatherer.schedule)
    idx, tgt = synthetic_batch(CFG, 4, step=1, rank=rank)
    o2.zero_grad()
    m2(idx, tgt)[1].backward()
    out["log_reversed"] = list(log2)
    o2.step()
    return out


@pytest.fixture(scope="module")
def mech():
    return run_ranks(_mechanics, 2, timeout=240)


def test_units_are_root_then_blocks(mech):
    assert mech[0]["units"] == ["GPT", "Block", "Block", "Block"]


def test_forward_then_reversed_backward_gather_order(mech):
    for r in mech:
        assert r["log_forward"] == [0, 1, 2, 3]
        # the root and the last block stay gathered into backward (it needs that block first, as FSDP2
        # keeps its root); every other block is gathered again, last first
        assert r["log_step"] == [0, 1, 2, 3, 2, 1]


def test_next_unit_is_prefetched_before_the_current_one_computes(mech):
    for r in mech:
        for unit, log in r["seen"]:
            expected_last = min(unit + 1, 3)
            assert log[-1] == expected_last, (unit, log)


def test_one_live_unit_means_no_prefetch(mech):
    for r in mech:
        for unit, log in r["seen_live1"]:
            assert log[-1] == unit, (unit, log)
        assert r["peak_live1"] <= r["pool_live1"]


def test_peak_gathered_bytes_within_pool(mech):
    for r in mech:
        root, blocks = r["unit_bytes"][0], r["unit_bytes"][1:]
        assert r["pool"] == root + 2 * max(blocks)
        assert root + max(blocks) < r["peak"] <= r["pool"]


def test_recorded_forward_order_drives_gathers(mech):
    for r in mech:
        assert r["schedule_reversed"] == [3, 2, 1]
        assert r["log_reversed"] == [0, 3, 2, 1, 2, 3]  # unit 1 ran last: kept gathered into backward


def test_parameters_are_empty_placeholders_between_steps(mech):
    r = mech[0]
    assert set(r["released_numel"]) == {0}
    assert all(n > 0 for n in r["full_numel"])
    assert r["gathered_after_step"] == 0
    assert all(kept == counted for kept, counted in r["live"]), r["live"]  # gatherer.live_bytes, kept per gather
    assert r["live"][0][0] > 0 and r["live"][-1][0] == sum(r["unit_bytes"])  # (after forward; all gathered)


def test_traffic_is_3_psi_minus_the_root_and_last_unit_kept_through_backward(mech):
    for r in mech:
        blocks = sum(r["unit_bytes"][1:-1])  # the last block (the schedule's last unit) is not gathered again
        assert r["comm"]["all_gather"] == r["flat_bytes"] + blocks
        assert r["comm"]["reduce_scatter"] == r["flat_bytes"]


def test_resident_state_is_16_psi_over_n(mech):
    for r in mech:
        m = r["memory"]
        total = m["params"] + m["grads"] + m["master"] + m["exp_avg"] + m["exp_avg_sq"]
        assert total == 16 * r["shard_numel"]
        assert m["params"] == 0  # fp32: the master shard is the resident parameter copy


def test_eval_under_no_grad(mech):
    for r in mech:
        assert r["eval_log"] == [0, 1, 2, 3]
        assert r["gathered_after_eval"] == 0
        assert r["eval_err"] < 1e-5


def test_exception_in_forward_releases_everything(mech):
    for r in mech:
        assert r["raised"]
        assert r["after_exception"] == (0, "idle")


def test_training_continues_after_exception_and_writeback(mech):
    for r in mech:
        assert r["param_err"] < 1e-5


# -- single process -------------------------------------------------------------------------

def test_bf16_resident_state_is_16_psi():
    from fused_zero import ShardedOptimizer
    model = GPT(CFG, seed=0).to(torch.bfloat16)
    opt = ShardedOptimizer(model, stage=3, bucket_numel=BUCKET, **PER_MODULE)
    _step(model, opt, 0, 0)
    m = opt.memory_bytes()
    n = sum(part.layout.shard_numel for part in opt.partitions)
    # bf16 param shard 2 + fp32 master, exp_avg, exp_avg_sq 12 + bf16 gradient shard 2
    assert m["params"] + m["grads"] + m["master"] + m["exp_avg"] + m["exp_avg_sq"] == 16 * n


def test_groups_with_module():
    from fused_zero import ShardedOptimizer
    model = TinyNet()
    opt = ShardedOptimizer(param_groups(model), stage=3, module=model, bucket_numel=1000, **PER_MODULE)
    assert [g["lr"] for g in opt.param_groups] == [2e-3, 1e-3, 3e-3]
    assert {part.group_index for part in opt.partitions} == {0, 1, 2}


def test_parameter_missing_from_groups():
    from fused_zero import ShardedOptimizer
    model = TinyNet()
    with pytest.raises(ValueError, match="in no param group"):
        ShardedOptimizer(param_groups(model)[:2], stage=3, module=model)


def test_foreign_parameter_in_groups():
    from fused_zero import ShardedOptimizer
    model = TinyNet()
    groups = param_groups(model) + [{"params": [nn.Parameter(torch.zeros(3))]}]
    with pytest.raises(ValueError, match="not parameters of the model passed as module=: .*Register such a parameter "
                                         "on a module of the model .* or train it at stage 1 or 2"):
        ShardedOptimizer(groups, stage=3, module=model)


def test_add_param_group_after_construction():
    from fused_zero import ShardedOptimizer
    opt = ShardedOptimizer(GPT(CFG), stage=3, **PER_MODULE)
    with pytest.raises(RuntimeError, match="module=model"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    assert len(opt.param_groups) == 1


def test_units_need_stage_3():
    from fused_zero import ShardedOptimizer
    with pytest.raises(ValueError, match="units= only applies to stage 3"):
        ShardedOptimizer(GPT(CFG), stage=2, units=[Block])


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1M"])
def test_invalid_min_unit_numel(bad):
    from fused_zero import ShardedOptimizer
    with pytest.raises(ValueError, match=r"min_unit_numel must be an int >= 0 \(0: one stage-3 unit per module\)"):
        ShardedOptimizer(GPT(CFG), stage=3, min_unit_numel=bad)


def test_invalid_max_live_units():
    from fused_zero import ShardedOptimizer
    with pytest.raises(ValueError, match="max_live_units"):
        ShardedOptimizer(GPT(CFG), stage=3, max_live_units=0)


def test_full_parameters_inside_forward_raises():
    from fused_zero import ShardedOptimizer
    model = GPT(CFG)
    opt = ShardedOptimizer(model, stage=3, **PER_MODULE)

    def hook(module, args):
        with opt.full_parameters():
            pass
    handle = model.blocks[0].register_forward_pre_hook(hook)
    idx, tgt = synthetic_batch(CFG, 2, step=0)
    with pytest.raises(RuntimeError, match="inside the model's forward"):
        model(idx, tgt)
    assert opt._stage.gatherer.gathered_bytes() == 0
    handle.remove()
    _step(model, opt, 0, 0)  # still usable


def test_user_units_classes():
    from fused_zero import ShardedOptimizer
    from gpt import MLP
    model = GPT(CFG)
    opt = ShardedOptimizer(model, stage=3, units=[MLP])
    assert [type(u.modules[0]).__name__ for u in opt._stage.gatherer.units] == ["GPT", "MLP", "MLP", "MLP"]
    _step(model, opt, 0, 0)


# -- small units merged (min_unit_numel) ---------------------------------------------------------

CFG4 = GPTConfig(vocab=96, d_model=32, n_layer=4, n_head=2, seq_len=16)


def _merged(rank, world_size):
    """Units of two blocks each (min_unit_numel of two blocks), in model order and in reverse."""
    from fused_zero import ShardedOptimizer
    out = {}
    for name, cls in (("forward", GPT), ("reversed", ReversedGPT)):
        model = cls(CFG4, seed=0)
        ref = copy.deepcopy(model)
        ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER, foreach=False)
        per_block = sum(p.numel() for p in model.blocks[0].parameters())
        opt = ShardedOptimizer(model, **HYPER, stage=3, bucket_numel=BUCKET, min_unit_numel=2 * per_block)
        g = opt._stage.gatherer
        out[name, "units"] = [[type(m).__name__ for m in u.modules] for u in g.units]
        log = gather_log(opt)
        steps = []
        for step in range(3):
            log.clear()
            idx, tgt = synthetic_batch(CFG4, 4, step=step, rank=rank)
            opt.zero_grad()
            loss = model(idx, tgt)[1]
            steps.append(list(log))
            loss.backward()
            steps[-1] = (steps[-1], list(log)[len(steps[-1]):])
            out[name, "peak"], out[name, "pool"] = g.peak_bytes, g.pool_bytes()
            opt.step()
            ref_opt.zero_grad()
            for r in range(world_size):
                i, t = synthetic_batch(CFG4, 4, step=step, rank=r)
                (ref(i, t)[1] / world_size).backward()
            ref_opt.step()
        out[name, "log"] = steps
        out[name, "released"] = [p.numel() for p in model.parameters()]
        with opt.full_parameters():
            refs = dict(ref.named_parameters())
            out[name, "err"] = max(rel(p, refs[n]) for n, p in model.named_parameters() if not n.endswith("qkv.bias"))
    return out


@pytest.fixture(scope="module")
def merged():
    return run_ranks(_merged, 2, timeout=240)


def test_small_units_merge_in_model_order(merged):
    for r in merged:
        for name in ("forward", "reversed"):
            assert r[name, "units"][1:] == [["Block", "Block"], ["Block", "Block"]]  # the root apart
            assert r[name, "released"] == [0] * len(r[name, "released"])  # every unit released after the step
            assert 0 < r[name, "peak"] <= r[name, "pool"]
            assert r[name, "err"] < 1e-5  # trains as torch AdamW on the averaged gradients


def test_a_merged_unit_is_gathered_once_a_forward_and_once_a_backward(merged):
    """Gathered at its first module, released after its last: not once per module."""
    for r in merged:
        # the root, then both units ahead (prefetch); backward gathers them again in reverse
        # the root, then both units ahead (prefetch); backward gathers the first again (the last unit of the
        # schedule stays gathered into backward, which needs it first)
        assert r["forward", "log"][1:] == [([0, 1, 2], [1])] * 2
        # blocks run in reverse: the first forward (registration order, unit 1 prefetched, unit 2 the one kept)
        # releases the unit of blocks 0-1 after block 1 (its last in model order) and block 0 gathers it again;
        # from then on each is released after the module that ran last in it, and unit 1 (now last) is kept
        assert r["reversed", "log"][0] == ([0, 1, 2, 1], [1])
        assert r["reversed", "log"][1:] == [([0, 2, 1], [2])] * 2


class _Residual(nn.Module):
    """Residual blocks of Linear + LayerNorm (bench/bench_host.py's model, small)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x.square().mean()


def test_small_default_units_merged_into_one_are_the_root():
    """Default units that all merge into one (a model under about twice min_unit_numel) are held by the root:
    gathered from the forward's start to the end of backward, as that one unit would be, without a hook on each
    of its modules (bench_host's 200 blocks). The steps still equal torch AdamW's."""
    from fused_zero import ShardedOptimizer
    model = _Residual(6)
    ref = copy.deepcopy(model)
    opt = ShardedOptimizer(model, **HYPER, stage=3)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER, foreach=False)
    g = opt._stage.gatherer
    assert [u.modules for u in g.units] == [(model,)]
    assert all(not block._forward_pre_hooks and not block._forward_hooks for block in model.blocks)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).backward()
            o.step()
    with opt.full_parameters():
        refs = dict(ref.named_parameters())
        assert max(rel(p, refs[name]) for name, p in model.named_parameters()) < 1e-6
    opt.close()


@pytest.mark.parametrize("reshard", [True, False])
def test_a_merged_unit_kept_into_backward_hooks_only_its_last_output(reshard):
    """A merged unit that stays gathered into backward (the schedule's last, or reshard_after_forward=False)
    needs no gather before its backward: one output hook (its last module's) starts backward's schedule, not one
    per module (bench_host: 200 of them a step); a merged unit resharded after forward hooks each module's outputs
    (backward may reach it through any of them). The steps still equal torch AdamW's."""
    from fused_zero import ShardedOptimizer
    model, n = _Residual(6), 6
    ref = copy.deepcopy(model)
    per_block = sum(p.numel() for p in model.blocks[0].parameters())
    opt = ShardedOptimizer(model, **HYPER, stage=3, reshard_after_forward=reshard, min_unit_numel=3 * per_block)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER, foreach=False)
    g = opt._stage.gatherer
    assert [len(u.modules) for u in g.units] == [1, n // 2, n // 2]  # the root and two units of three blocks
    hooked, hook = [], g._hook_outputs
    g._hook_outputs = lambda u, output: (hooked.append(u.index), hook(u, output))
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        hooked.clear()
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).backward()
            o.step()
        # the root's output, and each unit's last block's; unit 1, resharded, every block's
        assert sorted(hooked) == ([0, 1, 1, 1, 2] if reshard else [0, 1, 2]), hooked
    with opt.full_parameters():
        refs = dict(ref.named_parameters())
        assert max(rel(p, refs[name]) for name, p in model.named_parameters()) < 1e-6


# --- a rank whose data skips the schedule's last unit ----------------------------------------------

class _FourBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x, skip_last=False):
        for i, b in enumerate(self.blocks):
            if not (skip_last and i == 3):
                x = x + torch.tanh(b(x))
        return x


def _skip_last_unit(rank, world_size, max_live_units, accumulate):
    import contextlib
    import torch.distributed as dist
    import torch.nn.functional as F
    from fused_zero import ShardedOptimizer
    model, ref = _FourBlocks(), _FourBlocks()
    opt = ShardedOptimizer(model, stage=3, lr=1e-2, min_unit_numel=0, max_live_units=max_live_units)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    micros = 2 if accumulate else 1
    for step in range(4):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(micros):
            g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
            x, y = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
            # the last unit stays gathered from the forward into backward; a rank whose data skips it
            skip = step >= 1 and (rank == micro if accumulate else rank == 1)
            with opt.no_sync() if micro < micros - 1 else contextlib.nullcontext():
                (F.mse_loss(model(x, skip_last=skip), y) / micros).backward()
            (F.mse_loss(ref(x, skip_last=skip), y) / micros).backward()
        opt.step()
        for p in ref.parameters():  # DDP's average (find_unused_parameters: zeros where a rank skipped)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= world_size
        ref_opt.step()
    with opt.full_parameters():
        return max(rel(p, q) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("max_live_units", [1, 2])
def test_a_rank_skipping_the_last_unit_gathers_in_step_with_the_others(max_live_units, accumulate):
    """With one live unit, backward's first gather used to re-gather the kept last unit on the rank that ran
    it: a hang, or (accumulating, the counts evening out) gathers paired with other units' and wrong weights."""
    errors = run_ranks(_skip_last_unit, 2, max_live_units, accumulate, timeout=120)
    assert max(errors) < 1e-6, errors


def _ddp_step(ref, ref_opt, world_size):
    """The reference's step: DDP's average of the gradients, then torch's AdamW."""
    import torch.distributed as dist
    if world_size > 1:
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
    ref_opt.step()


def _steps_inside_except_blocks(rank, world_size, min_unit_numel):
    """Every step runs inside an ``except`` block (a retry after a caught error), one step's loss also through a
    block called directly outside the model's forward; against DDP + torch AdamW."""
    import torch.nn.functional as F
    from fused_zero import ShardedOptimizer
    model, ref = _FourBlocks(), _FourBlocks()
    opt = ShardedOptimizer(model, stage=3, lr=1e-2, **({} if min_unit_numel is None else
                                                        {"min_unit_numel": min_unit_numel}))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
        for m, o in ((model, opt), (ref, ref_opt)):
            try:
                raise KeyError("a caught error")
            except KeyError:
                o.zero_grad()
                loss = F.mse_loss(m(x), y)
                if step == 1:
                    loss = loss + m.blocks[2](x).square().mean()
                loss.backward()
                if m is model:
                    o.step()
        _ddp_step(ref, ref_opt, world_size)
    with opt.full_parameters():
        return max(rel(p, q) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("min_unit_numel", [0, None])
def test_a_step_inside_an_except_block_trains_as_ddp(world_size, min_unit_numel):
    """Before: the gatherer took a forward returning inside user code's ``except`` block (``sys.exc_info()`` set)
    for a forward that raised, released its units or left its outputs unhooked, and backward failed on the
    empty placeholders (``setStorage: ... out of bounds for storage of size 0``)."""
    errors = run_ranks(_steps_inside_except_blocks, world_size, min_unit_numel, timeout=120)
    assert max(errors) < 1e-6, errors


def _gradient_penalty(rank, world_size, stage):
    import torch.nn.functional as F
    from fused_zero import ShardedOptimizer
    model, ref = _FourBlocks(), _FourBlocks()
    opt = ShardedOptimizer(model if stage == 3 else model.parameters(), stage=stage, lr=1e-2,
                           **({"min_unit_numel": 0} if stage == 3 else {}))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            xi = x.clone().requires_grad_(True)
            loss = F.mse_loss(m(xi), y)
            (gx,) = torch.autograd.grad(loss, xi, create_graph=True)  # WGAN-GP / R1: the input gradient's norm
            (loss + 0.1 * gx.pow(2).sum()).backward()
        opt.step()
        _ddp_step(ref, ref_opt, world_size)
    with opt.full_parameters() if stage == 3 else torch.no_grad():
        return max(rel(p, q) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradient_penalty_double_backward(stage, world_size):
    """autograd.grad(create_graph=True) then backward through it: stage 3 keeps the units gathered from the
    first backward through the second (its graph reads the parameters), instead of failing on freed storage."""
    errors = run_ranks(_gradient_penalty, world_size, stage, timeout=120)
    assert max(errors) < 1e-6, errors


@dataclasses.dataclass
class _BlockOut:
    h: torch.Tensor
    extra: dict


class _PlainOut:
    """A plain object (no dataclass, no pytree node) holding the block's tensors, one of them in a nested one."""

    def __init__(self, h, pre):
        self.h = h
        self.extra = {"pre": _Nested(pre)}
        self.me = self  # a cycle: followed once


class _Nested:
    def __init__(self, t):
        self.t = t


class _DataclassBlocks(nn.Module):
    """Blocks that return a plain (unregistered) dataclass or a plain object: their tensors are found for
    backward's hooks (else a released unit's backward ran on empty placeholders)."""

    class Block(nn.Module):
        def __init__(self, kind):
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.kind = kind

        def forward(self, x):
            h = x + torch.tanh(self.fc(x))
            if self.kind == "object":
                return _PlainOut(h, h * 0.5)
            return _BlockOut(h=h, extra={"pre": h * 0.5})

    def __init__(self, kind="dataclass"):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(self.Block(kind) for _ in range(3))

    def forward(self, x):
        out = 0
        for b in self.blocks:
            o = b(x)
            pre = o.extra["pre"]
            x, out = o.h, out + (pre.t if isinstance(pre, _Nested) else pre).sum()
        return x.square().mean() + 1e-3 * out


@pytest.mark.parametrize("kind", ["dataclass", "object"])
def test_units_returning_a_dataclass_or_plain_object_train_as_torch(kind):
    _equals_torch_over_three_steps(_DataclassBlocks(kind), _DataclassBlocks(kind), 16, min_unit_numel=0)


def _equals_torch_over_three_steps(model, ref, width, exact=True, **kw):
    """Stage 3 at world size 1 against torch's fused AdamW: bitwise after three steps of ``model(x).backward()``
    (``exact=False``: within an ulp or so)."""
    from fused_zero import ShardedOptimizer
    opt = ShardedOptimizer(model, stage=3, lr=1e-2, **kw)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for step in range(3):
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).backward()
            o.step()
    with opt.full_parameters():
        for p, q in zip(model.parameters(), ref.parameters()):
            if exact:
                assert torch.equal(p, q)
            else:
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8)


def _eval_on_rank0_inside_full_parameters(rank, world_size):
    import torch.nn.functional as F
    from fused_zero import ShardedOptimizer
    model = _FourBlocks()
    opt = ShardedOptimizer(model, stage=3, lr=1e-2, min_unit_numel=0)
    evals = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        with opt.full_parameters():  # every rank enters; rank 0 alone evaluates: no gather inside
            if rank == 0:
                with torch.no_grad():
                    evals.append(model(x).sum().item())
    with opt.full_parameters():
        return evals, [p.detach().clone() for p in model.parameters()]


def test_rank0_alone_evaluates_inside_full_parameters():
    """The README's recipe for DDP's `if rank == 0: evaluate(model)` at stage 3."""
    (evals, a), (_, b) = run_ranks(_eval_on_rank0_inside_full_parameters, 2, timeout=60)
    assert len(evals) == 3 and all(torch.equal(p, q) for p, q in zip(a, b))


class _LoopedSequential(nn.Module):
    """No ModuleList: blocks in an nn.Sequential that the forward loops over to keep every block's output (VGG-style
    feature taps), or runs through checkpoint_sequential; neither runs the Sequential's own forward."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.emb = nn.Linear(8, 32)
            self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3)))
            self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = self.emb(x)
        if self.how == "loop":
            taps = []
            for block in self.blocks:
                h = block(h)
                taps.append(h.square().mean())
            return self.head(h).square().mean() + 0.1 * sum(taps)
        from torch.utils.checkpoint import checkpoint_sequential
        return self.head(checkpoint_sequential(self.blocks, 2, h, use_reentrant=False)).square().mean()


@pytest.mark.parametrize("how", ["loop", "checkpoint_sequential"])
@pytest.mark.parametrize("min_unit_numel", [0, None])
def test_default_units_serve_a_loop_over_a_sequential_as_torch(how, min_unit_numel):
    kw = {} if min_unit_numel is None else dict(min_unit_numel=min_unit_numel)
    # checkpoint_sequential: on an AMD EPYC the head's bias came out an ulp off torch's after three steps
    _equals_torch_over_three_steps(_LoopedSequential(how), _LoopedSequential(how), 8, exact=how == "loop", **kw)


class _Holder(nn.Module):
    """A module whose own forward never runs: the root calls its layers directly."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 16), nn.Linear(16, 16)


class _CallsIntoHolder(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.holder = _Holder()
        self.out = nn.Linear(16, 2)

    def forward(self, x):
        return self.out(self.holder.l2(self.holder.l1(self.inp(x)).relu())).square().mean()


def _calls_into_holder(rank, world_size, units):
    from fused_zero import ShardedOptimizer
    model = _CallsIntoHolder()
    layers = dict(units=[model.holder.l1, model.holder.l2]) if units == "layers" else {}
    opt = ShardedOptimizer(model, stage=3, min_unit_numel=0, **layers)
    try:
        model(torch.randn(4, 8)).backward()
    except RuntimeError as e:
        first = str(e)
    else:
        first = None
    # nothing is left gathered or half-started: the same optimizer trains once the call goes through units
    # that run (here the holder's layers called directly are fine once they are units themselves)
    return first, opt._stage.gatherer.state.name, opt._stage.gatherer.live_bytes


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_unit_whose_forward_never_wraps_its_modules_is_refused_naming_units(world_size):
    """The holder is a default unit, yet its forward never runs: its layers would compute with empty placeholders
    (torch's shape error, naming nothing). The first training forward checks it and raises on every rank."""
    for first, state, live in run_ranks(_calls_into_holder, world_size, None, timeout=60):
        assert first is not None and "module 'holder.l1' (Linear) ran inside the model's forward while the unit " \
            "holding its parameters ('holder') was not running" in first and "units=[" in first, first
        assert state == "IDLE" and live == 0


def test_a_module_called_directly_inside_a_running_unit_is_fine_and_units_given_as_the_layers_serve():
    for first, state, _ in run_ranks(_calls_into_holder, 1, "layers", timeout=60):
        assert first is None and state == "IDLE"


class _ClampedLinear(nn.Linear):
    """Weight clipping inside forward (a WGAN critic's habit): an in-place write to a gathered parameter."""

    def forward(self, x):
        with torch.no_grad():
            self.weight.clamp_(-0.05, 0.05)
        return super().forward(x)


class _WritesInForward(nn.Module):
    """An ``nn.Embedding(max_norm=1.0)`` renormalises the rows it looks up, in place, inside its forward; two
    clamped blocks; a head."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.emb = nn.Embedding(32, 16, max_norm=1.0)
            self.blocks = nn.ModuleList(_ClampedLinear(16, 16) for _ in range(2))
            self.head = nn.Linear(16, 4)
            with torch.no_grad():
                self.emb.weight.mul_(3.0)  # rows well above max_norm: the renormalisation moves them

    def forward(self, ids):
        h = self.emb(ids).mean(dim=1)
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.head(h).square().mean()


def _writes_in_forward(rank, world_size, min_unit_numel):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fused_zero import ShardedOptimizer
    model, ref = _WritesInForward(), _WritesInForward()
    ddp = DDP(ref) if world_size > 1 else ref
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = ShardedOptimizer(model, stage=3, lr=1e-2, min_unit_numel=min_unit_numel)
    for step in range(3):  # the same batch on every rank: DDP's replicas write the same rows alike
        ids = torch.randint(0, 32, (4, 3), generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ddp, ref_opt)):
            o.zero_grad()
            m(ids).backward()
            o.step()
    with torch.no_grad():
        model.eval(), ref.eval()
        evals = model(ids).item(), ref(ids).item()  # an eval forward writes too (torch renormalises there as well)
    with opt.full_parameters():
        return evals, [(p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())]


@pytest.mark.parametrize("world_size,min_unit_numel", [(1, None), (1, 0), (2, 0)])
def test_in_place_writes_inside_forward_are_kept_as_torch(world_size, min_unit_numel):
    """Before, stage 3 released the unit with the write in its full buffer only: the next gather and the update
    started from the old shard (torch's renormalised rows at norm 1.01, stage 3's at 14)."""
    kw = 2 ** 20 if min_unit_numel is None else min_unit_numel
    for (got, want), diffs in run_ranks(_writes_in_forward, world_size, kw, timeout=90):
        # within an ulp (torch's CPU fused Adam rounds a tensor's vectorised body and its scalar tail apart: over
        # the flat shard and over each parameter the lanes differ, and these values hit one such case at stage 1
        # too, where nothing is gathered); the lost writes were off by 9.5
        assert got == pytest.approx(want, rel=1e-6) and max(diffs) < 1e-8, (got, want, diffs)


def test_writes_inside_full_parameters_without_writeback_are_dropped():
    """What a unit's release takes in (writes inside a forward) is not what leaving full_parameters() takes in:
    without writeback=True the block's writes go, as documented; with it they stay."""
    from fused_zero import ShardedOptimizer
    model = _WritesInForward()
    opt = ShardedOptimizer(model, stage=3, lr=1e-2, min_unit_numel=0)
    ids = torch.randint(0, 32, (4, 3), generator=torch.Generator().manual_seed(0))
    model(ids).backward()
    opt.step()
    with opt.full_parameters():
        before = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    with opt.full_parameters():
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    with opt.full_parameters(writeback=True), torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with opt.full_parameters():
        assert all(torch.equal(p, q + 1.0) for p, q in zip(model.parameters(), before))


def _lossy_gather_write(rank, world_size):
    import warnings

    from fused_zero import ShardedOptimizer
    model = _WritesInForward()
    model.emb.max_norm = 1e6  # renormalises nothing, yet writes (and bumps the version) in place
    opt = ShardedOptimizer(model, stage=3, lr=0.0, weight_decay=0.0, min_unit_numel=0, param_comm="int8")
    with opt.full_parameters():
        before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            ids = torch.randint(0, 32, (4, 3), generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            model(ids).backward()
            opt.step()
    with opt.full_parameters():
        same = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    return same, sum("param_comm" in str(w.message) and "in place" in str(w.message) for w in caught)


def test_a_write_inside_forward_is_not_taken_from_a_quantized_gather():
    """param_comm="int8" gathers approximations: taking a forward's in-place write in would round the whole
    master through int8 (at lr=0 the embedding drifted 7e-3 in 5 steps). The write is dropped, once warned."""
    for same, warned in run_ranks(_lossy_gather_write, 2, timeout=90):
        assert same and warned == 1


def _submodule_state_dicts(rank, world_size):
    """A submodule's state_dict() and load_state_dict() (a head, a block), and a load into the dict that
    model.state_dict() gives inside full_parameters(writeback=True), against the same on a plain model."""
    from fused_zero import ShardedOptimizer
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    opt = ShardedOptimizer(model, stage=3, lr=1e-2, **PER_MODULE)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    out = {}
    try:
        model[4].state_dict()
    except RuntimeError as e:
        out["refused"] = str(e)
    new_head = {"weight": torch.full((3, 8), 0.25), "bias": torch.full((3,), -1.0)}
    new_mid = torch.full((8, 8), 0.5)
    for m in (model, ref):
        m[4].load_state_dict(new_head)  # released: loads into the shards
    with opt.full_parameters(writeback=True):
        out["head_sd"] = {k: v.clone() for k, v in model[4].state_dict().items()}
        model.state_dict()["2.weight"].copy_(new_mid)  # in place into the dict, as dcp.load does
    with torch.no_grad():
        ref[2].weight.copy_(new_mid)
    for t in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(t))  # the same on every rank
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    with opt.full_parameters():
        out["diff"] = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return out


def test_a_submodules_state_dict_and_loads_into_the_models_dict_serve_as_torch():
    """Before: ``model.head.state_dict()`` returned 0-element tensors silently and its load_state_dict failed in
    torch's shape check; a load into ``model.state_dict()`` inside full_parameters(writeback=True) (dcp.load, a
    copy_) never reached the model (the dict holds copies)."""
    for out in run_ranks(_submodule_state_dicts, 2, timeout=120):
        assert "full_parameters" in out["refused"] and "4.weight" in out["refused"]
        assert torch.equal(out["head_sd"]["weight"], torch.full((3, 8), 0.25))
        assert torch.equal(out["head_sd"]["bias"], torch.full((3,), -1.0))
        assert out["diff"] < 1e-6


def test_state_dict_keep_vars_inside_full_parameters_gives_the_parameters_themselves():
    """torch's ``state_dict(keep_vars=True)`` returns the Parameters (code that edits or compares them by identity);
    stage 3 returned detached copies (FSDP2 port). The model's and a submodule's, with and without a prefix; the
    plain call still gives copies, which outlive the gathered memory."""
    from fused_zero import ShardedOptimizer
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = ShardedOptimizer(model, stage=3, lr=1e-3, min_unit_numel=0)
    with opt.full_parameters():
        sd = model.state_dict(keep_vars=True)
        assert all(sd[n] is p for n, p in model.named_parameters())
        sub = model[2].state_dict(prefix="head.", keep_vars=True)
        assert sub["head.weight"] is model[2].weight and sub["head.bias"] is model[2].bias
        plain = model.state_dict()
        assert all(plain[n] is not p and torch.equal(plain[n], p) for n, p in model.named_parameters())
    assert all(v.numel() > 0 for v in plain.values())


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.lin(self.emb(ids))))


def test_state_dicts_under_other_names_hold_copies_and_a_tied_weight_loads_through_either_name():
    """Entries were copied by their parameters' names: a prefix without a dot, a submodule hook renaming its keys
    (torch's checkpoint_wrapper strips '_checkpoint_wrapped_module.') or a root hook registered before the build
    left views of the gathered memory, and reading them after full_parameters() crashed (SIGSEGV). A tied weight
    loaded through its second name only (strict=False) kept its old values (its first name was missing). Both as
    torch (state-dict port)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from fused_zero import ShardedOptimizer

    def build(sharded):
        torch.manual_seed(0)
        model = _Tied()
        model.lin = checkpoint_wrapper(model.lin)
        model._register_state_dict_hook(lambda m, sd, prefix, meta: {"model." + k: v for k, v in sd.items()})
        return model, ShardedOptimizer(model, stage=3, lr=1e-2, min_unit_numel=0) if sharded else None

    model, opt = build(True)
    ref, _ = build(False)
    ids = torch.arange(6).reshape(2, 3)
    with opt.full_parameters():
        renamed = model.state_dict()
        undotted = model.emb.state_dict(prefix="emb_")
    want = ref.state_dict()
    assert sorted(renamed) == sorted(want) and any("_checkpoint_wrapped_module" in n for n, _ in ref.named_parameters())
    for k in want:  # (read after the block: the memory the gathered parameters viewed is gone)
        assert torch.equal(renamed[k], want[k]), k
    assert torch.equal(undotted["emb_weight"], ref.emb.weight.detach())
    new = torch.full((10, 4), 0.5)
    for m in (model, ref):
        missing = m.load_state_dict({"head.weight": new}, strict=False).missing_keys
        assert "emb.weight" in missing
    with opt.full_parameters():
        assert torch.equal(model.emb.weight, new) and torch.equal(model(ids), ref(ids))


# --- a unit whose output is a view of its own parameters ---------------------------------------------------------

@dataclasses.dataclass
class _ViewOut:
    rows: torch.Tensor
    weight: torch.Tensor


class _Record(collections.OrderedDict):
    """A dict subclass pytree keeps whole (as a leaf): its items are not attributes."""


class _ViewOfOwn(nn.Module):
    """A learned position table returning a slice of itself (GPT-2's wpe as a slice), and the transpose of its
    parameter, in the output structure ``kind`` (each unit of a stage-3 model is its own module here)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(8, 6))
        self.kind = kind

    def forward(self, n: int):
        rows, weight = self.pos[:n], self.pos.t()
        return {"tensor": rows, "tuple": (rows, weight), "dict": {"rows": rows, "weight": weight},
                "dataclass": _ViewOut(rows, weight), "record": _Record(rows=rows, weight=weight)}[self.kind]


class _UsesViews(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.pos, self.lin = _ViewOfOwn(kind), nn.Linear(6, 6)

    def forward(self, x):
        out = self.pos(x.shape[0])
        if isinstance(out, torch.Tensor):
            rows, weight = out, None
        elif isinstance(out, tuple):
            rows, weight = out
        elif isinstance(out, dict):  # (and _Record)
            rows, weight = out["rows"], out["weight"]
        else:
            rows, weight = out.rows, out.weight
        h = self.lin(x + rows)
        return h if weight is None else h @ weight @ weight.t()


def _views_of_own_parameters(rank, world_size, kind):
    from _models import ddp_reference
    from fused_zero import ShardedOptimizer

    torch.manual_seed(0)
    model = _UsesViews(kind)
    ref, ref_opt = ddp_reference(model, groups=False, **HYPER)
    opt = ShardedOptimizer(model, **HYPER, stage=3, min_unit_numel=0)
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    with torch.no_grad():  # an eval forward releases every unit after it: the output must stay readable
        got, want = model(torch.ones(4, 6)), ref.module(torch.ones(4, 6))
    with opt.full_parameters():
        params = max(rel(p, q) for p, q in zip(model.parameters(), ref.module.parameters()))
    return params, rel(got, want)


@pytest.mark.parametrize("kind", ["tensor", "tuple", "dict", "dataclass", "record"])
def test_a_unit_returning_views_of_its_own_parameters_trains_as_ddp(kind):
    """A unit's output that views its gathered parameters (``self.pos[:n]``, ``self.weight.t()``) would read freed
    memory once the unit is released (an outside probe: a segmentation fault on every rank, or torch's "data is not
    allocated yet"): such outputs are copies, with the same values and gradient path."""
    for params, evaluated in run_ranks(_views_of_own_parameters, 2, kind, timeout=120):
        assert params < 1e-6 and evaluated < 1e-6, (params, evaluated)
