"""fused_zero.comm.collectives on 1-4 gloo ranks (one spawn per world size), the local path, and the harness."""
from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from _dist import RanksFailed, free_port, run_ranks
from fused_zero.comm import pins
from fused_zero.comm.collectives import Comm, Handle

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _data(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers, different per rank: every sum over <= 4 ranks is exact in bf16 and fp16."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(-8, 9, (numel,), generator=g).to(dtype)


def _check_tensor_collectives(comm: Comm, rank: int, ws: int) -> None:
    n = 5  # odd on purpose: no alignment assumptions
    for dtype in FLOATS:
        everyone = [_data(r, ws * n, dtype) for r in range(ws)]
        total = torch.stack([x.double() for x in everyone]).sum(0).to(dtype)
        mine = total[rank * n:(rank + 1) * n]
        for async_op in (False, True):
            out = torch.full((n,), 99, dtype=dtype)
            h = comm.reduce_scatter(out, everyone[rank].clone(), async_op=async_op)
            assert isinstance(h, Handle)
            h.wait()
            h.wait()  # waiting twice is harmless
            assert torch.equal(out, mine), (dtype, async_op, out, mine)
            # scratch input: gloo runs it as all_reduce + a copy of this rank's slice
            out = torch.full((n,), 99, dtype=dtype)
            comm.reduce_scatter(out, everyone[rank].clone(), async_op=async_op, scratch_input=True).wait()
            assert torch.equal(out, mine), (dtype, async_op, "scratch input")
            # in place: output is this rank's slice of the input (NCCL's in-place form)
            buf = everyone[rank].clone()
            comm.reduce_scatter(buf[rank * n:(rank + 1) * n], buf, async_op=async_op).wait()
            assert torch.equal(buf[rank * n:(rank + 1) * n], mine), (dtype, async_op, "in-place")
            buf = everyone[rank].clone()  # in place on a scratch input: gloo's all-reduce leaves it there
            comm.reduce_scatter(buf[rank * n:(rank + 1) * n], buf, async_op=async_op, scratch_input=True).wait()
            assert torch.equal(buf[rank * n:(rank + 1) * n], mine), (dtype, async_op, "in-place scratch")
            # all_gather, out of place and in place, into a 2-D output (shape is free, numel counts)
            gathered = torch.cat([_data(r, n, dtype) for r in range(ws)])
            out = torch.full((ws, n), 99, dtype=dtype)
            comm.all_gather(out, _data(rank, n, dtype), async_op=async_op).wait()
            assert torch.equal(out.view(-1), gathered), (dtype, async_op, "all_gather")
            buf = torch.full((ws * n,), 99, dtype=dtype)
            buf[rank * n:(rank + 1) * n] = _data(rank, n, dtype)
            comm.all_gather(buf, buf[rank * n:(rank + 1) * n], async_op=async_op).wait()
            assert torch.equal(buf, gathered), (dtype, async_op, "in-place all_gather")
        for op, reduce in (("sum", lambda x: x.sum(0)), ("max", lambda x: x.max(0).values),
                           ("min", lambda x: x.min(0).values)):
            t = everyone[rank][:n].clone()
            comm.all_reduce(t, op=op).wait()
            expect = reduce(torch.stack([x[:n].double() for x in everyone])).to(dtype)
            assert torch.equal(t, expect), (dtype, op)

    # several async collectives in flight at once, waited on in reverse order
    a, b, c = torch.empty(n), torch.empty(ws * n), torch.full((3,), float(rank))
    hs = [comm.reduce_scatter(a, torch.ones(ws * n), async_op=True),
          comm.all_gather(b, torch.full((n,), float(rank)), async_op=True),
          comm.all_reduce(c, op="max", async_op=True)]
    for h in reversed(hs):
        h.wait()
    assert torch.equal(a, torch.full((n,), float(ws)))
    assert torch.equal(b, torch.arange(ws).repeat_interleave(n).float())
    assert torch.equal(c, torch.full((3,), float(ws - 1)))

    # broadcast from the last rank (non-zero when ws > 1)
    t = torch.full((4,), float(rank), dtype=torch.bfloat16)
    comm.broadcast(t, src=ws - 1)
    assert torch.equal(t, torch.full((4,), float(ws - 1), dtype=torch.bfloat16))
    assert comm.all_gather_object({"rank": rank}) == [{"rank": r} for r in range(ws)]
    comm.barrier()


def _check_traffic(comm: Comm, ws: int) -> dict:
    comm.reset_traffic()
    assert comm.traffic() == {"reduce_scatter": 0, "all_gather": 0, "all_reduce": 0}
    comm.reduce_scatter(torch.empty(6, dtype=torch.bfloat16), torch.ones(ws * 6, dtype=torch.bfloat16))
    comm.reduce_scatter(torch.empty(2), torch.ones(ws * 2), async_op=True).wait()
    comm.all_gather(torch.empty(ws * 3), torch.ones(3))
    comm.all_reduce(torch.ones(7, dtype=torch.float64))
    comm.broadcast(torch.ones(100), src=0)  # set-up: not counted
    comm.all_gather_object("x")
    # a reduce-scatter counts its input, an all-gather its output, an all-reduce twice its tensor (the ZeRO paper's 2Ψ)
    expect = {"reduce_scatter": ws * 6 * 2 + ws * 2 * 4, "all_gather": ws * 3 * 4, "all_reduce": 2 * 7 * 8}
    if ws == 1:
        expect = dict.fromkeys(expect, 0)
    assert comm.traffic() == expect, (comm.traffic(), expect)
    counted = comm.traffic()
    comm.reset_traffic()
    assert comm.traffic() == {"reduce_scatter": 0, "all_gather": 0, "all_reduce": 0}
    return counted


def _check_all_to_all(comm: Comm, rank: int, ws: int) -> None:
    """uint8 (the codecs' payloads) slice r to rank r, async, counted under its kind; bad shapes refused."""
    comm.reset_traffic()
    send = torch.tensor([10 * rank + r for r in range(ws) for _ in range(3)], dtype=torch.uint8)
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, async_op=True, kind="reduce_scatter_int8").wait()
    assert recv.tolist() == [10 * r + rank for r in range(ws) for _ in range(3)]
    assert comm.traffic().get("reduce_scatter_int8", 0) == (3 * ws if ws > 1 else 0)
    with pytest.raises(ValueError, match="one shape and dtype"):
        comm.all_to_all(torch.empty(3 * ws + 1, dtype=torch.uint8), send)
    with pytest.raises(ValueError, match="overlaps its input"):
        comm.all_to_all(send, send)
    comm.reset_traffic()


def _check_bad_arguments(comm: Comm, ws: int) -> None:
    """Every one of these raises before communicating, so no rank waits for another."""
    with pytest.raises(ValueError, match=rf"input has {ws * 3 + 1} elements; it must be world_size \({ws}\)"):
        comm.reduce_scatter(torch.empty(3), torch.empty(ws * 3 + 1))
    with pytest.raises(ValueError, match=r"all_gather output has .* elements"):
        comm.all_gather(torch.empty(ws * 3 + 2), torch.empty(3))
    with pytest.raises(TypeError, match="must match"):
        comm.reduce_scatter(torch.empty(3), torch.empty(ws * 3, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="must match"):
        comm.all_gather(torch.empty(ws * 3, dtype=torch.float16), torch.empty(3))
    with pytest.raises(ValueError, match="contiguous"):
        comm.reduce_scatter(torch.empty(3), torch.empty(ws * 6)[::2])
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(torch.empty(4, 4).t())
    with pytest.raises(TypeError, match="torch.Tensor"):
        comm.all_reduce([1.0, 2.0])
    with pytest.raises(ValueError, match="op must be one of"):
        comm.all_reduce(torch.empty(3), op="avg")
    with pytest.raises(ValueError, match="src must be a rank"):
        comm.broadcast(torch.empty(3), src=ws)
    buf = torch.empty(ws * 3 + 1)  # input overlapping output at the wrong place
    with pytest.raises(ValueError, match="overlaps"):
        comm.all_gather(buf[:ws * 3], buf[1 + comm.rank * 3:1 + comm.rank * 3 + 3])


def _check_same(comm: Comm, rank: int, ws: int) -> list[str]:
    params = [("a", (4,), "float32"), ("w", (4, 4), "float32"), ("b", (2,), "bfloat16")]
    comm.check_same(params, "parameters")
    comm.check_same(7, "seeds")
    messages = []
    odd = ws - 1  # the last rank differs; with one rank nothing can differ
    hint = "build the optimizer with the same parameters, in the same order, on every rank"
    variants = [
        (params[:1] + [("w", (4, 5), "float32")] + params[2:],
         "rank {odd} has entry 1 = ('w', (4, 5), 'float32'), rank 0 has ('w', (4, 4), 'float32')"),
        (params[:2], "rank {odd} has 2 entries, rank 0 has 3"),
    ]
    for value, expect in variants:
        try:
            comm.check_same(value if rank == odd and ws > 1 else params, "parameters", hint=hint)
        except ValueError as e:
            assert ws > 1
            assert str(e).startswith("parameters differ across ranks: " + expect.format(odd=odd)), str(e)
            assert str(e).endswith("on every rank"), str(e)
            messages.append(str(e))
    try:
        comm.check_same(rank == odd and ws > 1, "flags")
    except ValueError as e:
        messages.append(str(e))
    return messages


def _subgroup_checks(rank: int, ws: int) -> None:
    """A group of ranks 1..ws-1: group ranks, broadcast src translation, non-members refused."""
    members = list(range(1, ws))
    group = dist.new_group(members)  # every rank must call new_group
    if rank == 0:
        with pytest.raises(ValueError, match="not a member"):
            Comm(group)
        return
    comm = Comm(group)
    assert (comm.rank, comm.world_size) == (rank - 1, ws - 1)
    t = torch.full((2,), float(rank))
    comm.broadcast(t, src=comm.world_size - 1)  # group rank ws-2 is global rank ws-1
    assert torch.equal(t, torch.full((2,), float(ws - 1)))
    out = torch.empty(comm.world_size * 2)
    comm.all_gather(out, torch.full((2,), float(rank)))
    assert torch.equal(out, torch.tensor(members).repeat_interleave(2).float())
    assert comm.all_gather_object(rank) == members
    with pytest.raises(ValueError, match="rank 1 has 2, rank 0 has 1"):  # ranks of the group, values global
        comm.check_same(rank, "group ranks")


def _check_pins(comm: Comm, rank: int, ws: int) -> None:
    """What a collective's Work holds is a pinned alias: a Work destroyed on gloo's thread never takes
    an alias's count to 1 (which would need the GIL: the exit abort, tests/test_clean_exit.py)."""
    if ws == 1:
        return
    pins._reap()
    buf = torch.ones(ws * 4)
    out = torch.empty(4)
    for launch in (lambda: comm.all_reduce(buf, async_op=True),
                   lambda: comm.reduce_scatter(out, buf.clone(), async_op=True, scratch_input=True),
                   lambda: comm.all_gather(buf, out, async_op=True)):
        handle = launch()
        held = list(pins._PINS)
        assert held, "the collective pinned nothing"
        for pin in held:
            assert all(a._base is not None and a._use_count() >= 2 for a in pin.aliases)
        handle.wait()
        del handle
    comm.barrier()
    for _ in range(200):  # gloo's threads let go of the finished Works within moments
        pins._reap()
        if not pins._PINS:
            break
        time.sleep(0.01)
    assert not pins._PINS, "pins were never released after their Works were gone"
    assert comm.all_gather_object("x" * (rank * 1000)) == ["x" * (r * 1000) for r in range(ws)]


def _all_checks(rank: int, ws: int) -> dict:
    warnings.simplefilter("error", FutureWarning)  # no deprecated torch.distributed names
    comm = Comm()
    assert (comm.rank, comm.world_size, comm.backend, comm.group) == (rank, ws, "gloo", None)
    _check_tensor_collectives(comm, rank, ws)
    _check_all_to_all(comm, rank, ws)
    counted = _check_traffic(comm, ws)
    _check_bad_arguments(comm, ws)
    messages = _check_same(comm, rank, ws)
    _check_pins(comm, rank, ws)
    if ws >= 3:
        _subgroup_checks(rank, ws)
    return {"traffic": counted, "messages": messages, "threads": torch.get_num_threads()}


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_collectives_on_gloo(ws):
    results = run_ranks(_all_checks, ws)
    assert len(results) == ws
    assert all(r["threads"] == 1 for r in results)
    assert all(r["traffic"] == results[0]["traffic"] for r in results)
    # every rank raised, with the same message naming the differing rank: no rank was left waiting
    n_msgs = 3 if ws > 1 else 0
    for r in results:
        assert len(r["messages"]) == n_msgs
        assert r["messages"] == results[0]["messages"]
    if ws > 1:
        flags = results[0]["messages"][2]
        assert flags == f"flags differ across ranks: rank {ws - 1} has True, rank 0 has False", flags


def test_local_path_without_process_group():
    assert not dist.is_initialized()
    comm = Comm()
    assert (comm.rank, comm.world_size, comm.backend, comm.group) == (0, 1, "none", None)
    x = torch.arange(6.0)
    out = torch.empty(2, 3)
    h = comm.reduce_scatter(out, x, async_op=True)
    assert h.work is None
    h.wait()
    assert torch.equal(out.view(-1), x)
    assert comm.reduce_scatter(x, x).work is None and torch.equal(x, torch.arange(6.0))  # aliased: untouched
    out = torch.empty(6, dtype=torch.bfloat16)
    comm.all_gather(out, x.bfloat16())
    assert torch.equal(out, x.bfloat16())
    comm.all_gather(x, x)
    for op in ("sum", "max", "min"):
        comm.all_reduce(x, op=op).wait()
    comm.broadcast(x, src=0)
    assert torch.equal(x, torch.arange(6.0))
    assert comm.all_gather_object(("a", 1)) == [("a", 1)]
    comm.barrier()
    comm.check_same([1, 2], "anything")
    assert comm.traffic() == {"reduce_scatter": 0, "all_gather": 0, "all_reduce": 0}
    _check_bad_arguments(comm, 1)
    with pytest.raises(RuntimeError, match="not initialised"):
        Comm(group=object())


# ---- the harness itself ------------------------------------------------------------------
def _nested_failure(rank):
    raise ValueError(f"boom from rank {rank}")


def _one_rank_raises(rank, ws):
    if rank == 1:
        _nested_failure(rank)
    dist.barrier()  # rank 0 would wait here forever: the harness must kill it


def _one_rank_hangs(rank, ws):
    if rank == 1:
        _sleep_forever()
    return rank


def _sleep_forever():
    while True:
        time.sleep(0.1)


def _dies(rank, ws):
    os._exit(3)


def _echo(rank, ws, *args, **kwargs):
    return rank, ws, args, kwargs, torch.initial_seed(), os.environ.get("FUSED_ZERO_HARNESS_PROBE")


def test_harness_returns_in_rank_order_and_passes_arguments(monkeypatch):
    monkeypatch.setenv("FUSED_ZERO_HARNESS_PROBE", "42")  # the caller's environment now, not the server's
    expect = [(r, 2, ("x",), {"k": 3}, 1234, "42") for r in range(2)]
    assert run_ranks(_echo, 2, "x", k=3) == expect
    assert 1024 <= free_port() < 65536


def test_harness_reports_the_failing_rank_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_one_rank_raises, 2, timeout=60)
    msg = str(info.value)
    assert "rank 1 of 2 raised" in msg and "Traceback" in msg, msg
    assert "_nested_failure" in msg and "ValueError: boom from rank 1" in msg, msg
    assert time.monotonic() - t0 < 30  # rank 0 was killed, not waited for


def test_harness_kills_and_names_stuck_ranks():
    t0 = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_one_rank_hangs, 2, timeout=10)
    msg = str(info.value)
    assert "ranks [1] of 2 did not finish within 10 s" in msg, msg
    assert "ranks [0] had returned" in msg, msg
    assert "_sleep_forever" in msg, msg  # its stack, dumped before the kill
    assert time.monotonic() - t0 < 20


def test_harness_reports_a_rank_that_dies_without_raising():
    with pytest.raises(RanksFailed, match="rank 0 of 1 died with exit code 3"):
        run_ranks(_dies, 1)
    with pytest.raises(TypeError, match="module-level"):
        run_ranks(lambda rank, ws: None, 1)


class _RacingWork:
    """A gloo Work whose sliced wait times out just as the collective ends (ok) or fails (not ok)."""

    def __init__(self, ok: bool) -> None:
        self.ok, self.calls = ok, []

    def wait(self, timeout=None):
        self.calls.append(timeout)
        if timeout is not None:
            raise RuntimeError("Operation timed out!")
        if not self.ok:
            raise RuntimeError("Connection closed by peer")
        return True

    def is_completed(self) -> bool:
        return True  # it ended between the time-out and this check


def test_a_slice_timing_out_as_the_collective_ends_is_no_error(monkeypatch):
    from fused_zero.comm import rendezvous, works

    monkeypatch.setattr(rendezvous, "watching", lambda: True)
    monkeypatch.setattr(rendezvous, "peer_failure", lambda: None)
    ended = _RacingWork(ok=True)
    works._Watched(ended).wait()  # returns: the collective succeeded
    assert ended.calls == [works.WAIT_SLICE, None]
    with pytest.raises(RuntimeError, match="Connection closed"):  # its own error, not the slice's time-out
        works._Watched(_RacingWork(ok=False)).wait()
    monkeypatch.setattr(rendezvous, "peer_failure", lambda: "rank 1 stopped in step(): it raised")
    with pytest.raises(RuntimeError, match="rank 1 stopped"):
        works._Watched(_RacingWork(ok=False)).wait()


def _groups_dropped_with_their_optimizer(rank, world_size):
    import gc

    from torch import nn
    from torch.distributed.distributed_c10d import _world

    from fused_zero import ShardedOptimizer

    def train(stage, **kw):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
        opt = ShardedOptimizer(model if stage == 3 else model.parameters(), stage=stage, lr=1e-3,
                               **({"module": model} if kw.get("update_behind") else {}), **kw)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        return opt

    base = len(_world.pg_map)
    counts = {}
    for name, stage, kw in (("stage3", 3, {}), ("stage1_behind", 1, {"update_behind": True}),
                            ("stage2", 2, {})):
        made = []
        for _ in range(3):
            opt = train(stage, **kw)
            made.append(len(_world.pg_map) - base)
            del opt
            gc.collect()
        counts[name] = made
    opt = None
    counts["reassigned"] = []
    for _ in range(4):  # a sweep in a notebook: each new optimizer replaces the last in one variable (built while
        for _ in range(3):  # the last is open, it reduces over a group of its own too)
            opt = train(3)
        gc.collect()
        counts["reassigned"].append(len(_world.pg_map) - base)
    del opt
    return counts


def test_process_groups_an_optimizer_made_are_reused_by_the_next():
    """Each optimizer's own groups (stage 3's gathers, the gathers behind step()) stayed registered, with their
    sockets, after it was dropped: a sweep in one process ran out of file descriptors. They go back to a pool
    when their optimizer goes and the next optimizer takes them (group_pool.py): the groups registered stop
    growing at what the optimizers alive at once need."""
    for counts in run_ranks(_groups_dropped_with_their_optimizer, 2, timeout=180):
        for kind in ("stage3", "stage1_behind", "stage2"):
            assert len(set(counts[kind])) == 1, counts  # the 2nd and 3rd optimizers made none
        assert counts["stage3"][0] > 0 and counts["stage1_behind"][0] > 0, counts
        # (an optimizer not collected yet keeps its groups: the first rounds fill the pool, then it stops growing)
        assert counts["reassigned"][1] == counts["reassigned"][-1] <= counts["reassigned"][0] + 1, counts


def _rebuilds_over_a_group(rank, world_size, group):
    """A sweep or a reload over process_group= / mesh=: state_dict(), a new optimizer taking over, load_state_dict,
    with the ranks a little apart and garbage collected at different moments."""
    import gc
    import random

    from torch import nn
    from torch.distributed.distributed_c10d import _world

    from fused_zero import ShardedOptimizer

    pg = dist.new_group([0, 1]) if group == "process_group" else None
    mesh = None
    if group == "mesh":
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2,))
    jitter = random.Random(rank)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    counts = []
    opt = ShardedOptimizer(model.parameters(), lr=1e-2, stage=2, process_group=pg, mesh=mesh)
    for it in range(12):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
        state = opt.state_dict()  # (its control group: one made by the optimizer)
        time.sleep(jitter.random() * 0.05)
        if rank == 0 and it % 2:
            gc.collect()
        opt = ShardedOptimizer(model.parameters(), lr=1e-2, stage=2, process_group=pg, mesh=mesh)
        opt.load_state_dict(state)
        counts.append(len(_world.pg_map))
    return counts


@pytest.mark.parametrize("group", ["process_group", "mesh"])
def test_rebuilding_over_a_group_of_the_users_reuses_the_optimizers_groups(group):
    """Before, the groups an optimizer made were destroyed when it was collected, and torch names a group over a
    subgroup's ranks by the number of groups registered: the next optimizer's group took a dead group's name and
    read its addresses from the store ("Gloo connectFullMesh failed ... Connection refused"), or, where the ranks
    collected at different moments, named it differently on each rank and hung."""
    for counts in run_ranks(_rebuilds_over_a_group, 2, group, timeout=180):
        assert counts[-1] == counts[3], counts  # no growth once the pool serves the rebuilds
