"""Stage-3 parameter offload (offload_params="cpu" | "nvme"): bitwise the run without offload.

- 2 gloo ranks, stage 3, 10 steps in lockstep with the same run without offload, parameters
  bitwise equal after every step: fp32 models with the optimizer states offloaded too (the
  param shard of fp32 parameters exists only then: otherwise they are gathered from the fp32
  master on their device), and bf16 models without optimizer offload. 704-element chunks, so
  the update's runs are cut as they never are in memory.
- memory_bytes() counts the param shards under their tier; the scratch files are one per
  partition, private (0600), never shared by two optimizers, removed on close and when collected.
- a checkpoint saved with offload_params resumes without it, and the reverse, bitwise.
- bad options refused when built; a failed read names the file; a failed write of the shard mid-update never
  leaves a half-written shard to gather (undone with the states on NVMe, else done and rewritten).
"""
import errno
import gc
import os
import re
import stat
import warnings

import pytest
import torch

from _dist import run_ranks
from _faults import failing_fallocate
from _models import HYPER, TinyNet, batch, flags, loss_fn
from fused_zero import ShardedOptimizer
from fused_zero import checkpoint as ckpt

CHUNK = dict(offload_chunk_numel=700)
FP32 = [dict(), dict(offload_params="cpu", offload_optimizer="cpu", **CHUNK),
        dict(offload_params="nvme", offload_optimizer="nvme", **CHUNK),
        dict(offload_params="nvme", offload_optimizer="cpu", **CHUNK),
        dict(offload_params="cpu", offload_optimizer="nvme", **CHUNK)]
BF16 = [dict(), dict(offload_params="cpu", **CHUNK), dict(offload_params="nvme", **CHUNK)]


#: one stage-3 unit per module (no merging of small units): these tests watch each unit's gathers
PER_MODULE = dict(min_unit_numel=0)


def _build(model, folder=None, **kw):
    if "nvme" in (kw.get("offload_optimizer"), kw.get("offload_params")):
        kw["nvme_path"] = folder
    return ShardedOptimizer(model, **HYPER, stage=3, bucket_numel=1000, **kw, **PER_MODULE)


def _step(model, opt, t, rank):
    opt.zero_grad()
    x, y = batch(t, rank)
    loss_fn(model(x.to(next(model.parameters()).dtype), **flags(t, rank)), y).backward()
    opt.step()


def _params(model, opt):
    with opt.full_parameters():
        return [p.detach().clone() for p in model.parameters()]


def _lockstep(rank, world_size, folder):
    out = {}
    for name, dtype, configs in (("fp32", torch.float32, FP32), ("bf16", torch.bfloat16, BF16)):
        own = os.path.join(folder, f"{name}-rank{rank}")
        os.makedirs(own)
        models = [TinyNet(dtype=dtype) for _ in configs]
        opts = [_build(m, own, **kw) for m, kw in zip(models, configs)]
        unequal = []
        for t in range(10):
            for m, o in zip(models, opts):
                _step(m, o, t, rank)
            ref = _params(models[0], opts[0])
            for i in range(1, len(configs)):
                if not all(torch.equal(a, b) for a, b in zip(ref, _params(models[i], opts[i]))):
                    unequal.append((t, i))
        files = sorted(os.listdir(own))
        modes = {stat.S_IMODE(os.stat(os.path.join(own, f)).st_mode) for f in files}
        out[name] = {"unequal": unequal, "mem": [o.memory_bytes() for o in opts], "files": files, "modes": modes,
                     "partitions": [len(o.partitions) for o in opts],
                     "frozen_partitions": [len(o.frozen_index()) for o in opts],  # TinyNet.frozen's: weights only
                     "shard_bytes": [sum(part.shard_numel for part in o.shard_index() + o.frozen_index())
                                     * m.inp.weight.element_size() for o, m in zip(opts, models)]}
        for o in opts:
            o.close()
        out[name]["files_after_close"] = os.listdir(own)
    return out


def test_offload_params_is_bitwise_the_run_without(tmp_path):
    for r in run_ranks(_lockstep, 2, str(tmp_path), timeout=240):
        for name, configs in (("fp32", FP32), ("bf16", BF16)):
            res = r[name]
            assert res["unequal"] == [], name
            ref = res["mem"][0]
            states = ref["master"] + ref["exp_avg"] + ref["exp_avg_sq"]
            for kw, mem, parts, shard in zip(configs[1:], res["mem"][1:], res["partitions"][1:],
                                             res["shard_bytes"][1:]):
                tiers = {"host": 0, "nvme": 0}
                tiers[{"cpu": "host", "nvme": "nvme"}[kw["offload_params"]]] += shard
                if kw.get("offload_optimizer"):  # the states, and the reduced gradient shard on the host
                    tiers[{"cpu": "host", "nvme": "nvme"}[kw["offload_optimizer"]]] += states
                    tiers["host"] += ref["grads"]
                    assert mem["grads"] == 0, (name, kw)
                assert {k: mem.get(k, 0) for k in tiers} == tiers, (name, kw)
                assert mem["params"] == 0 and mem["master"] == (0 if kw.get("offload_optimizer") else ref["master"])
            n_params = sum(p + f for kw, p, f in zip(configs, res["partitions"], res["frozen_partitions"])
                           if kw.get("offload_params") == "nvme")
            n_states = sum(p for kw, p in zip(configs, res["partitions"]) if kw.get("offload_optimizer") == "nvme")
            assert sum(f.endswith(".params") for f in res["files"]) == n_params > 0
            assert sum(f.endswith(".states") for f in res["files"]) == n_states
            assert len(res["files"]) == n_params + n_states and (not res["files"] or res["modes"] == {0o600})
            assert res["files_after_close"] == []


def _resume(rank, world_size, folder):
    own = os.path.join(folder, f"rank{rank}")
    os.makedirs(own, exist_ok=True)
    out = {}
    offloaded = FP32[2]
    for name, first, second in (("offloaded->none", offloaded, FP32[0]), ("none->offloaded", FP32[0], offloaded)):
        ref = TinyNet()
        ref_opt = _build(ref, own)
        for t in range(6):
            _step(ref, ref_opt, t, rank)
        model = TinyNet()
        opt = _build(model, own, **first)
        for t in range(3):
            _step(model, opt, t, rank)
        path = os.path.join(folder, name)
        ckpt.save(path, model, opt)
        resumed = TinyNet(seed=9)
        ropt = _build(resumed, own, **second)
        ckpt.load(path, resumed, ropt)
        for t in range(3, 6):
            _step(resumed, ropt, t, rank)
        out[name] = all(torch.equal(a, b) for a, b in zip(_params(ref, ref_opt), _params(resumed, ropt)))
        for o in (ref_opt, opt, ropt):
            o.close()
    return out


def test_checkpoint_resumes_across_offload_params(tmp_path):
    for r in run_ranks(_resume, 2, str(tmp_path), timeout=240):
        assert r == {"offloaded->none": True, "none->offloaded": True}


def test_bad_offload_params_are_refused(tmp_path):
    model = TinyNet()
    with pytest.raises(ValueError, match="offload_params='cpu' needs stage=3"):
        ShardedOptimizer(model.parameters(), stage=2, offload_params="cpu")
    with pytest.raises(ValueError, match="offload_params='nvme' needs stage=3"):
        ShardedOptimizer(model.parameters(), stage=1, offload_params="nvme", nvme_path=str(tmp_path))
    with pytest.raises(ValueError, match='offload_params="nvme" needs nvme_path'):
        ShardedOptimizer(model, stage=3, offload_params="nvme")
    with pytest.raises(ValueError, match="offload_params must be"):
        ShardedOptimizer(model, stage=3, offload_params="disk")
    with pytest.raises(ValueError, match="not a folder"):
        ShardedOptimizer(model, stage=3, offload_params="nvme", nvme_path=str(tmp_path / "missing"))


def test_param_files_are_private_removed_and_errors_name_them(tmp_path, monkeypatch):
    a, b = TinyNet(dtype=torch.bfloat16), TinyNet(seed=1, dtype=torch.bfloat16)
    opt_a = _build(a, str(tmp_path), **BF16[2])
    opt_b = _build(b, str(tmp_path), **BF16[2])  # the same folder: files of its own
    files = os.listdir(tmp_path)
    per_opt = [len(o.partitions) + len(o.frozen_index()) for o in (opt_a, opt_b)]  # frozen weights: a file too
    assert len(files) == len(set(files)) == sum(per_opt)
    _step(a, opt_a, 0, 0)
    opt_a.close()
    assert len(os.listdir(tmp_path)) == per_opt[1]
    real = os.preadv

    def failing(fd, buffers, offset):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(os, "preadv", failing)
    x, y = batch(0, 0)
    with pytest.raises(OSError, match=r"fused_zero-.*\.params.*Input/output error"):
        b(x.to(torch.bfloat16))
    monkeypatch.setattr(os, "preadv", real)
    del opt_b, b
    gc.collect()
    assert os.listdir(tmp_path) == []


def _failing_param_writes(real_pwritev, first: int, last: int | None):
    """``os.pwritev`` that raises EIO on writes ``first``.. ``last`` (None: every one after) of a ``.params`` file."""
    calls = [0]

    def pwritev(fd, buffers, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".params"):
            calls[0] += 1
            if calls[0] >= first and (last is None or calls[0] <= last):
                raise OSError(errno.EIO, "Input/output error")
        return real_pwritev(fd, buffers, offset)
    return pwritev


@pytest.mark.parametrize("states", [None, "cpu", "nvme"])
@pytest.mark.parametrize("fault", ["one write", "every write until the step returns"])
def test_a_failed_param_shard_write_never_trains_on_a_half_written_shard(states, fault, tmp_path, monkeypatch):
    """An I/O error writing the parameter file mid-update. With the states on NVMe the step is undone (an OSError
    naming the file; parameters, states and counts as before; the retried step trains on exactly), even where
    the disk also fails the undo's rewrite of the shard (it is rewritten before the next gather). With the
    states in memory, which a step cannot be undone in, the step is done with a warning naming the file, and the
    shard is rewritten from the fp32 master before its next gather. Either way training is bitwise the run
    without offload (before: the step was half undone, or not at all, and training went on from a shard mixing
    two steps)."""
    model, ref = TinyNet(dtype=torch.bfloat16), TinyNet(dtype=torch.bfloat16)
    options = dict(offload_params="nvme", **CHUNK, **({"offload_optimizer": states} if states else {}))
    opt, ref_opt = _build(model, str(tmp_path), **options), _build(ref)
    for t in range(2):
        _step(model, opt, t, 0)
        _step(ref, ref_opt, t, 0)
    before = _params(model, opt)
    steps = sorted(float(s["step"]) for s in opt.state.values())
    real = os.pwritev
    monkeypatch.setattr(os, "pwritev", _failing_param_writes(real, 2, 2 if fault == "one write" else None))
    if states == "nvme":
        with pytest.raises(OSError, match=r"fused_zero-.*\.params failed \(Input/output error"):
            _step(model, opt, 2, 0)
        monkeypatch.setattr(os, "pwritev", real)
        assert all(torch.equal(a, b) for a, b in zip(before, _params(model, opt)))
        assert sorted(float(s["step"]) for s in opt.state.values()) == steps
        _step(model, opt, 2, 0)  # retried
    else:
        with pytest.warns(RuntimeWarning, match=r"\.params failed \(Input/output error.*the step is done .*"
                                                r"rewritten from the fp32 master before its next gather"):
            _step(model, opt, 2, 0)
        monkeypatch.setattr(os, "pwritev", real)
    _step(ref, ref_opt, 2, 0)
    for t in range(3, 5):
        _step(model, opt, t, 0)
        _step(ref, ref_opt, t, 0)
    assert all(torch.equal(a, b) for a, b in zip(_params(ref, ref_opt), _params(model, opt)))


def test_param_files_reserve_their_space_or_warn_where_the_file_system_cannot(tmp_path, monkeypatch):
    """As the states' file: the space is taken when built (not sparse); a file system that cannot reserve warns
    (the file grows as the steps write it) and trains bitwise as the run without offload."""
    model, ref = TinyNet(dtype=torch.bfloat16), TinyNet(dtype=torch.bfloat16)
    opt = _build(model, str(tmp_path), **BF16[2])
    for name in os.listdir(tmp_path):
        path = os.path.join(tmp_path, name)
        assert os.stat(path).st_blocks * 512 >= os.path.getsize(path) > 0
    opt.close()

    monkeypatch.setattr(os, "posix_fallocate", failing_fallocate(errno.EOPNOTSUPP))
    with pytest.warns(RuntimeWarning, match=r"could not reserve [0-9.]+ [KM]iB for the NVMe parameter shard "
                                            r"\S*\.params \(Operation not supported\)"):
        opt = _build(model, str(tmp_path), **BF16[2])
    ref_opt = _build(ref)
    for t in range(3):
        _step(model, opt, t, 0)
        _step(ref, ref_opt, t, 0)
    assert all(torch.equal(a, b) for a, b in zip(_params(ref, ref_opt), _params(model, opt)))


def test_a_param_file_that_stays_unwritable_raises_at_the_gather(tmp_path, monkeypatch):
    """States in memory, and the disk keeps failing: the step is done (warned) and the next forward's gather,
    which must rewrite the shard first, raises naming the file instead of gathering a half-written shard."""
    model = TinyNet(dtype=torch.bfloat16)
    opt = _build(model, str(tmp_path), offload_params="nvme", **CHUNK)
    _step(model, opt, 0, 0)
    monkeypatch.setattr(os, "pwritev", _failing_param_writes(os.pwritev, 2, None))
    with pytest.warns(RuntimeWarning, match="the step is done"):
        _step(model, opt, 1, 0)
    x, _ = batch(2, 0)
    with pytest.raises(OSError, match=r"fused_zero-.*\.params failed \(Input/output error"):
        model(x.to(torch.bfloat16), **flags(2, 0))


def _full_disk_on_rank_1(rank, world_size, folder, options):
    """Rank 1's disk has no room for its files: every rank must raise at the build, none wait in a collective."""
    own = os.path.join(folder, f"rank{rank}")
    os.makedirs(own)
    if rank == 1:
        os.posix_fallocate = failing_fallocate(errno.ENOSPC)
    model = TinyNet()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        _build(model, own, **options)
    except OSError as e:
        error = (type(e).__name__, str(e))
    else:
        return None
    gc.collect()
    # the refused build leaves the model a plain model (its values, trainable by another optimizer) and no files
    return error, all(torch.equal(a, b) for a, b in zip(before, model.parameters())), os.listdir(own)


@pytest.mark.parametrize("options", [BF16[2], FP32[2]], ids=["params", "params+states"])
def test_a_full_disk_on_one_rank_is_refused_on_every_rank_at_the_build(tmp_path, options):
    (mine, kept0, files0), (theirs, kept1, files1) = run_ranks(_full_disk_on_rank_1, 2, str(tmp_path), options,
                                                               timeout=120)
    assert mine[0] == theirs[0] == "OSError" and mine[1] == f"rank 1 failed: {theirs[1]}"
    assert re.search(r"reserving space for \S*\.(params|states) failed \(No space left on device", theirs[1]), theirs
    assert kept0 and kept1 and files0 == files1 == []


def _failing_param_reads(real_preadv):
    """``os.preadv`` that raises EIO on every read of a ``.params`` file (the states' files read as usual)."""
    def preadv(fd, buffers, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".params"):
            raise OSError(errno.EIO, "Input/output error")
        return real_preadv(fd, buffers, offset)
    return preadv


@pytest.mark.parametrize("options", [BF16[2], FP32[2]], ids=["params", "params+states"])
def test_a_step_retried_inside_the_except_block_of_a_failed_param_read_trains_on_exactly(tmp_path, monkeypatch,
                                                                                         options):
    """One process: the gather's failed read raises its OSError in the forward; the step retried inside the
    ``except`` block that caught it (the disk back) trains on bitwise as the run without offload. Before: the
    retried forward was taken for a failed one (``sys.exc_info()`` set) and its backward failed on empty
    placeholders (``setStorage: ... out of bounds``)."""
    dtype = torch.bfloat16 if options is BF16[2] else torch.float32
    model, ref = TinyNet(dtype=dtype), TinyNet(dtype=dtype)
    opt, ref_opt = _build(model, str(tmp_path), **options), _build(ref)
    real = os.preadv
    for t in range(4):
        _step(ref, ref_opt, t, 0)
        if t != 1:
            _step(model, opt, t, 0)
            continue
        monkeypatch.setattr(os, "preadv", _failing_param_reads(real))
        try:
            _step(model, opt, t, 0)
        except OSError:
            monkeypatch.setattr(os, "preadv", real)
            _step(model, opt, t, 0)
        else:
            raise AssertionError("the failed read raised nothing")
    assert all(torch.equal(a, b) for a, b in zip(_params(model, opt), _params(ref, ref_opt)))


def _read_fails_on_rank_1(rank, world_size, folder, options, dtype, phase):
    """Rank 1 alone cannot read its parameter files during step 2's forward or backward (EIO); a run without offload
    beside it, in lockstep, skips steps 2 and 3 (what the refusal leaves undone)."""
    own = os.path.join(folder, f"rank{rank}")
    os.makedirs(own)
    model, ref = TinyNet(dtype=dtype), TinyNet(dtype=dtype)
    opt, ref_opt = _build(model, own, **options), _build(ref)
    real = os.preadv
    failing = _failing_param_reads(real)
    out = {"equal": []}
    for t in range(6):
        x, y = batch(t, rank)
        for m, o in ((model, opt), (ref, ref_opt)):
            fails = m is model and rank == 1 and t == 2
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                o.zero_grad()
                os.preadv = failing if fails and phase == "forward" else real
                loss = loss_fn(m(x.to(dtype), **flags(t, rank)), y)
                os.preadv = failing if fails and phase == "backward" else real
                loss.backward()
                os.preadv = real
                if m is ref and t in (2, 3):
                    continue  # the refused step, and the one where the other ranks raise
                try:
                    o.step()
                    out[t] = None
                except (OSError, RuntimeError) as e:
                    out[t] = type(e).__name__, str(e), " ".join(getattr(e, "__notes__", ()))
            if m is model:
                out[f"warned{t}"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        out["equal"].append(all(torch.equal(a, b) for a, b in zip(_params(model, opt), _params(ref, ref_opt))))
    return out


@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("options", [BF16[2], FP32[2], FP32[3]], ids=["params", "params+states", "params+cpu"])
def test_a_failed_param_read_on_one_rank_is_refused_on_every_rank_without_hanging(tmp_path, options, phase):
    """A read of the parameter file that fails on one rank among several (during a forward's or a backward's gather)
    raised there alone while the other ranks waited in that gather until the timeout. Now that rank's gather serves
    the fp32 master's values, says so at once (a RuntimeWarning naming the file), and its step raises the OSError
    after the step's collectives, changing nothing; the other rank skips that step and both raise at the next one
    (the ranks' disagreement); then training goes on, bitwise the run without offload that skipped those steps."""
    dtype = torch.bfloat16 if options is BF16[2] else torch.float32
    first, second = run_ranks(_read_fails_on_rank_1, 2, str(tmp_path), options, dtype, phase, timeout=240)
    assert second[2] is not None and second[2][0] == "OSError", second[2]
    assert re.search(r"reading \S*\.params failed \(Input/output error", second[2][1]), second[2]
    assert f"found by a stage-3 {phase} since the last step" in second[2][2], second[2]
    assert first[2] is None
    assert all(r[3] is not None and "ranks disagree" in r[3][1] for r in (first, second)), (first[3], second[3])
    assert all(r[t] is None for r in (first, second) for t in (0, 1, 4, 5))
    assert any(".params failed (Input/output error)" in w and "refused" in w for w in second["warned2"])
    assert not first["warned2"] and not any(r[f"warned{t}"] for r in (first, second) for t in (0, 1, 3, 4, 5))
    assert first["equal"] == second["equal"] == [True] * 6, (first["equal"], second["equal"])


def _read_fails_on_rank_1_between_steps(rank, world_size, folder, where):
    """Rank 1 cannot read its parameter files during ``full_parameters()`` or a checkpoint's save (its frozen
    weights are gathered from their files); the run goes on after."""
    own = os.path.join(folder, f"rank{rank}")
    os.makedirs(own)
    model, ref = TinyNet(dtype=torch.bfloat16), TinyNet(dtype=torch.bfloat16)
    opt, ref_opt = _build(model, own, **BF16[2]), _build(ref)
    real = os.preadv
    failing = _failing_param_reads(real)
    for t in range(2):
        _step(model, opt, t, rank)
        _step(ref, ref_opt, t, rank)
    if rank == 1:
        os.preadv = failing
    try:
        if where == "full_parameters":
            with opt.full_parameters():
                pass
        else:
            ckpt.save(os.path.join(folder, "ckpt"), model, opt)
        error = None
    except OSError as e:
        error = str(e)
    finally:
        os.preadv = real
    for t in range(2, 4):
        _step(model, opt, t, rank)
        _step(ref, ref_opt, t, rank)
    return error, all(torch.equal(a, b) for a, b in zip(_params(model, opt), _params(ref, ref_opt)))


@pytest.mark.parametrize("where", ["full_parameters", "checkpoint"])
def test_a_failed_param_read_between_steps_raises_on_every_rank(tmp_path, where):
    """Between steps a gather serves what user code saves, so a failed read on one rank is never served a
    substitute: every rank raises (an OSError naming the file and the rank) before any gather, and training
    goes on after, bitwise (before: rank 1 raised alone and rank 0 waited in the gather)."""
    (mine, same0), (theirs, same1) = run_ranks(_read_fails_on_rank_1_between_steps, 2, str(tmp_path), where,
                                               timeout=240)
    assert theirs is not None and re.search(r"reading \S*\.params failed \(Input/output error", theirs), theirs
    assert mine == f"rank 1 failed: {theirs}"
    assert same0 and same1


def _eval_read_fails_on_rank_1(rank, world_size, folder):
    own = os.path.join(folder, f"rank{rank}")
    os.makedirs(own)
    model = TinyNet()
    opt = _build(model, own, **FP32[3])
    _step(model, opt, 0, rank)
    real = os.preadv
    failing = _failing_param_reads(real)
    x, _ = batch(1, rank)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        os.preadv = failing if rank == 1 else real
        try:
            out = model(x, **flags(1, rank))
        finally:
            os.preadv = real
    return bool(torch.isfinite(out).all()), sum(".params failed" in str(w.message) for w in caught)


def test_a_failed_param_read_in_an_evaluation_forward_shows_on_every_rank(tmp_path):
    """An evaluation forward (no step after it) whose gather could not read rank 1's parameter file served zeros for
    the frozen weights (no fp32 master), and rank 0 computed a plausible wrong output without a word. The
    substitute is NaN where no master can be read: every rank's output shows it (rank 1 also warns)."""
    (finite0, warned0), (finite1, warned1) = run_ranks(_eval_read_fails_on_rank_1, 2, str(tmp_path), timeout=240)
    assert not finite0 and not finite1
    assert warned0 == 0 and warned1 >= 1
