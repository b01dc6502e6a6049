"""fused_zero.checkpoint: resume bitwise, reshard across world sizes and stages, consolidate to
plain PyTorch (and back), crash safety, corruption and wrong-model errors, the command line.

Every step trains on one global batch of 12 samples split evenly over the ranks, so runs at
world sizes 1, 2, 3 and 4 follow the same trajectory up to rounding. Multi-rank scenarios run
in a few module-scoped gloo runs; the rest run in the pytest process at world size 1.
"""
import copy
import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from torch.optim.lr_scheduler import OneCycleLR, StepLR

from _dist import RanksFailed, run_ranks
from _models import D, D_OUT, HYPER, TinyNet, batch, ddp_reference, is_initialized, loss_fn, param_groups, rel
from fused_zero import ShardedOptimizer

# setup.py installs safetensors; the offline GPU machines may lack it
pytest.importorskip("safetensors", reason="fused_zero.checkpoint writes safetensors: pip install safetensors")
from fused_zero import checkpoint as ckpt  # noqa: E402
from fused_zero.checkpoint import files as ckpt_files  # noqa: E402

GLOBAL = 12  # samples per step, split evenly over 1, 2, 3 or 4 ranks
N, M = 4, 3  # steps before the save, steps after it
BUCKET = 1000  # splits several parameters across buckets
CHUNK = 500  # splits saved runs into several chunks
TOL = 1e-5
KINDS = ("master", "exp_avg", "exp_avg_sq")


# -- training helpers (used in the ranks and in the pytest process) -------------------------------

def _data(step, ws, rank, dtype=torch.float32):
    x, y = batch(step, 0, size=GLOBAL, dtype=dtype)
    n = GLOBAL // ws
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _train(model, opt, sched, start, steps, ws, rank, dtype=torch.float32):
    """Local losses of ``steps`` steps from ``start``; ``branch`` is unused on even steps (its step
    count lags the others')."""
    losses = []
    for t in range(start, start + steps):
        opt.zero_grad()
        x, y = _data(t, ws, rank, dtype)
        loss = loss_fn(model(x, use_branch=t % 2 == 1), y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(float(loss.detach()))
    return losses


def _make(stage, groups=True, dtype=torch.float32, bucket=BUCKET):
    """TinyNet, a ShardedOptimizer and a scheduler: 3 param groups + OneCycleLR (cycles lr and
    betas), or the model as one group (the stage-3 form) + StepLR."""
    model = TinyNet(dtype=dtype)
    if groups:
        opt = ShardedOptimizer(param_groups(model), **HYPER, stage=stage, bucket_numel=bucket)
        sched = OneCycleLR(opt, max_lr=[4e-3, 2e-3, 6e-3], total_steps=N + M + 2)
    else:
        opt = ShardedOptimizer(model, **HYPER, stage=stage, bucket_numel=bucket)
        sched = StepLR(opt, step_size=2, gamma=0.7)
    return model, opt, sched


def _hyper(opt):
    return [(g["lr"], tuple(g["betas"]), g["weight_decay"]) for g in opt.param_groups]


def _shards(opt):
    return [[opt.read_shard(i, k, 0, part.shard_numel) for k in KINDS] for i, part in enumerate(opt.shard_index())]


def _steps(model, opt):
    return {n: (float(opt.state[p]["step"]) if "step" in opt.state.get(p, {}) else None)
            for n, p in model.named_parameters()}


def _resume_case(rank, ws, root, stage, dtype=torch.float32):
    """Train N, save, load into a fresh model + optimizer + scheduler, train M on both: bitwise?"""
    model, opt, sched = _make(stage, dtype=dtype)
    _train(model, opt, sched, 0, N, ws, rank, dtype)
    tag = ckpt.save(root, model, opt, sched, extra={"epoch": 7, "rng": torch.arange(100)}, chunk_numel=CHUNK)
    fresh, fopt, fsched = _make(stage, dtype=dtype)
    extra = ckpt.load(root, fresh, fopt, fsched)
    out = {"tag": tag, "extra_ok": extra["epoch"] == 7 and torch.equal(extra["rng"], torch.arange(100)),
           "steps_ok": _steps(model, opt) == _steps(fresh, fopt),
           "sched_ok": fsched.last_epoch == sched.last_epoch == N and _hyper(fopt) == _hyper(opt),
           "shards_after_load": all(torch.equal(a, b) for x, y in zip(_shards(opt), _shards(fopt))
                                    for a, b in zip(x, y))}
    out["losses"] = _train(model, opt, sched, N, M, ws, rank, dtype)
    out["fresh_losses"] = _train(fresh, fopt, fsched, N, M, ws, rank, dtype)
    out["params_equal"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    out["shards_equal"] = all(torch.equal(a, b) for x, y in zip(_shards(opt), _shards(fopt)) for a, b in zip(x, y))
    out["hyper_equal"] = _hyper(opt) == _hyper(fopt)
    return out


def _check_resume(res):
    assert res["extra_ok"] and res["steps_ok"] and res["sched_ok"] and res["shards_after_load"], res
    assert res["losses"] == res["fresh_losses"]
    assert res["params_equal"] and res["shards_equal"] and res["hyper_equal"]


# -- the multi-rank runs ------------------------------------------------------------------------

def _source_rank(rank, ws, root):
    out = {}
    for stage in (1, 2):  # same world size: bitwise; stage 2's checkpoint "A" is the resharding source
        out[f"resume{stage}"] = _resume_case(rank, ws, os.path.join(root, f"A{stage}"), stage)
    model, opt, sched = _make(2)
    out["A_losses"] = _train(model, opt, sched, 0, N + M, ws, rank)
    out["A_params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    # "B": the model as one param group (the stage-3 form), saved after N steps
    model, opt, sched = _make(2, groups=False)
    _train(model, opt, sched, 0, N, ws, rank)
    ckpt.save(os.path.join(root, "B"), model, opt, sched, chunk_numel=CHUNK)
    out["B_cont"] = _train(model, opt, sched, N, M, ws, rank)
    # DDP + torch AdamW on the same data: what consolidation must equal
    ddp, ref_opt = ddp_reference(TinyNet())
    ref_sched = OneCycleLR(ref_opt, max_lr=[4e-3, 2e-3, 6e-3], total_steps=N + M + 2)
    _train(ddp, ref_opt, ref_sched, 0, N, ws, rank)
    if rank == 0:
        out["ddp_model"] = copy.deepcopy(ddp.module.state_dict())
        out["ddp_optim"] = copy.deepcopy(ref_opt.state_dict())
    return out


def _reshard_rank(rank, ws, root, stage, source, corrupted=None, torch_state=None, save_as=None):
    out = {}
    groups = source == "A2"
    if corrupted is not None:  # a chunk only some ranks read is corrupted: every rank must raise
        model, opt, sched = _make(stage, groups=groups)
        before = _shards(opt)
        try:
            ckpt.load(corrupted, model, opt, sched)
            out["corrupted"] = None
        except Exception as e:  # noqa: BLE001
            out["corrupted"] = (type(e).__name__, str(e))
        out["untouched"] = all(torch.equal(a, b) for x, y in zip(before, _shards(opt)) for a, b in zip(x, y))
    model, opt, sched = _make(stage, groups=groups)
    ckpt.load(os.path.join(root, source), model, opt, sched)
    out["last_epoch"] = sched.last_epoch
    out["losses"] = _train(model, opt, sched, N, M, ws, rank)
    if save_as is not None:  # save again at this world size and stage
        ckpt.save(os.path.join(root, save_as), model, opt, sched, chunk_numel=CHUNK)
    if torch_state is not None:  # a plain torch.optim.AdamW checkpoint
        model = TinyNet()
        opt = ShardedOptimizer(param_groups(model), **HYPER, stage=stage, bucket_numel=BUCKET)
        ckpt.load_torch_state(model, opt, torch_state["optim"], torch_state["model"])
        out["torch_losses"] = _train(model, opt, None, N, M, ws, rank)
        out["torch_params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _reshard3_rank(rank, ws, root, corrupted):
    out = {"stage2": _reshard_rank(rank, ws, root, 2, "B", corrupted=corrupted, save_as="C2")}
    out["stage3"] = _reshard_rank(rank, ws, root, 3, "B", save_as="C3")
    return out


def _crash_rank(rank, ws, root):
    model, opt, sched = _make(2)
    _train(model, opt, sched, 0, 2, ws, rank)
    ckpt.save(root, model, opt, sched, tag="first")
    _train(model, opt, sched, 2, 1, ws, rank)
    if rank == 1:  # dies right after writing its first file of the next save
        write = ckpt_files.write_file

        def write_and_die(path, data):
            write(path, data)
            os._exit(7)

        ckpt_files.write_file = write_and_die
    ckpt.save(root, model, opt, sched, tag="second")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def source(root):
    return run_ranks(_source_rank, 2, root, timeout=120)


def _global(results, key):
    return [sum(r[key][i] for r in results) / len(results) for i in range(len(results[0][key]))]


def _torch_adamw_state():
    """A plain torch AdamW run on the global batch: (state dicts after N steps, M more losses, params)."""
    model = TinyNet()
    opt = torch.optim.AdamW(param_groups(model), **HYPER, foreach=False)
    _train(model, opt, None, 0, N, 1, 0)
    state = {"model": copy.deepcopy(model.state_dict()), "optim": copy.deepcopy(opt.state_dict())}
    losses = _train(model, opt, None, N, M, 1, 0)
    return state, losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def torch_run():
    return _torch_adamw_state()


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not is_initialized()


def _tagdir(root, name):
    with open(os.path.join(root, name, "latest")) as f:
        return os.path.join(root, name, f.read().strip())


def _corrupt(file, key, at=-1):
    """Flip one byte of tensor ``key``'s data in a safetensors file."""
    with open(file, "rb") as f:
        data = bytearray(f.read())
    (n,) = struct.unpack("<Q", data[:8])
    begin, end = json.loads(data[8:8 + n])[key]["data_offsets"]
    pos = 8 + n + (begin if at >= 0 else end) + at
    data[pos] ^= 0x5A
    with open(file, "wb") as f:
        f.write(data)


def _first_key(file, needle):
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return sorted(k for k in header if needle in k)[0]


# -- same world size: bitwise -------------------------------------------------------------------

@pytest.mark.parametrize("stage", [1, 2])
def test_resume_bitwise_world_size_2(source, stage):
    for res in source:
        _check_resume(res[f"resume{stage}"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stage", [1, 2])
def test_resume_bitwise_world_size_1(tmp_path, stage, dtype):
    _check_resume(_resume_case(0, 1, str(tmp_path), stage, dtype))


def test_save_does_not_perturb_training(source):
    # the saving run's own continuation equals a run that never saved
    for res in source:
        assert res["resume2"]["losses"] == res["A_losses"][N:]


# -- other world sizes and stages ------------------------------------------------------------------

def test_reshard_2_to_1_stage_1(source, root):
    model, opt, sched = _make(1, bucket=700)
    ckpt.load(os.path.join(root, "A2"), model, opt, sched)
    assert sched.last_epoch == N
    losses = _train(model, opt, sched, N, M, 1, 0)
    want = _global(source, "A_losses")[N:]
    assert max(abs(a - b) / b for a, b in zip(losses, want)) < TOL, (losses, want)
    assert max(rel(p, source[0]["A_params"][n]) for n, p in model.named_parameters()) < TOL


@pytest.fixture(scope="module")
def reshard4(source, root, torch_run):
    return run_ranks(_reshard_rank, 4, root, 2, "A2", torch_state=torch_run[0], timeout=120)


def test_reshard_2_to_4_stage_2(source, reshard4):
    want = _global(source, "A_losses")[N:]
    got = _global(reshard4, "losses")
    assert all(r["last_epoch"] == N for r in reshard4)
    assert max(abs(a - b) / b for a, b in zip(got, want)) < TOL, (got, want)


@pytest.fixture(scope="module")
def reshard3(source, root):
    corrupted = os.path.join(root, "B_corrupted")
    shutil.copytree(os.path.join(root, "B"), corrupted)
    tagdir = _tagdir(root, "B_corrupted")
    file = os.path.join(tagdir, "shards-rank00001-of-00002.safetensors")
    _corrupt(file, _first_key(file, "fc1.weight:exp_avg_sq"))
    return run_ranks(_reshard3_rank, 3, root, corrupted, timeout=120)


@pytest.mark.parametrize("stage", [2, 3])
def test_reshard_2_to_3(source, reshard3, stage):
    results = [r[f"stage{stage}"] for r in reshard3]
    want = [sum(r["B_cont"][i] for r in source) / 2 for i in range(M)]
    got = _global(results, "losses")
    assert all(r["last_epoch"] == N for r in results)
    assert max(abs(a - b) / b for a, b in zip(got, want)) < TOL, (got, want)


def test_stage_3_checkpoint_consolidates_and_reshards(reshard3, root):
    (m2, o2), (m3, o3) = ckpt.consolidate(os.path.join(root, "C2")), ckpt.consolidate(os.path.join(root, "C3"))
    assert list(m3) == list(m2) == list(TinyNet().state_dict())
    assert max(rel(m3[k], m2[k]) for k in m2) < TOL
    assert o3["state"].keys() == o2["state"].keys()
    assert max(rel(o3["state"][i]["exp_avg"], s["exp_avg"]) for i, s in o2["state"].items()) < 1e-4
    assert all(float(o3["state"][i]["step"]) == float(s["step"]) for i, s in o2["state"].items())
    losses = []
    for name in ("C2", "C3"):  # stage 3 at 3 ranks -> stage 1 at 1 rank
        model, opt, sched = _make(1, groups=False)
        ckpt.load(os.path.join(root, name), model, opt, sched)
        losses.append(_train(model, opt, sched, N + M, 2, 1, 0))
    assert max(abs(a - b) / b for a, b in zip(*losses)) < TOL, losses


def test_weights_only_load_for_a_new_optimizer(reshard3, root):
    """load(directory, model, None): the model's weights alone (fine-tuning with a new optimizer, Megatron's
    --no-load-optim): fp32 masters into a plain model in one process, a bf16 model rounded from them; a model sharded
    at stage 3 is refused naming full_parameters(writeback=True), where the load works; a scheduler is refused."""
    path = os.path.join(root, "C3")  # stage 3 at 3 ranks
    model_sd, _ = ckpt.consolidate(path)
    model = TinyNet()
    assert ckpt.load(path, model, None) is None  # (saved without extra)
    assert all(torch.equal(v, model_sd[k]) for k, v in model.state_dict().items())
    half = TinyNet().bfloat16()
    ckpt.load(path, half, None)
    assert all(torch.equal(v, model_sd[k].to(v.dtype)) for k, v in half.state_dict().items())
    fresh = TinyNet()
    opt = ShardedOptimizer(fresh, stage=3, lr=1e-3, min_unit_numel=0)  # new hyperparameters, no saved state
    with pytest.raises(RuntimeError, match=r"full_parameters\(writeback=True\)"):
        ckpt.load(path, fresh, None)
    with opt.full_parameters(writeback=True):
        ckpt.load(path, fresh, None)
    with opt.full_parameters():
        assert all(torch.equal(v, model_sd[k]) for k, v in fresh.state_dict().items())
    assert not opt.state  # nothing of the saved optimizer came in
    with pytest.raises(ValueError, match="weights only"):
        ckpt.load(path, TinyNet(), None, StepLR(torch.optim.SGD(TinyNet().parameters()), 1))
    opt.close()


def test_corruption_found_by_one_rank_raises_on_all(reshard3):
    for rank, res in enumerate(reshard3):
        kind, msg = res["stage2"]["corrupted"]
        assert kind == "CheckpointError", (rank, kind, msg)
        assert "fc1.weight" in msg and "shards-rank00001-of-00002.safetensors" in msg, msg
        assert res["stage2"]["untouched"], f"rank {rank}: a failed load changed the optimizer"


# -- plain PyTorch -------------------------------------------------------------------------------

def test_consolidate_equals_ddp_adamw(source, root):
    model_sd, optim_sd = ckpt.consolidate(os.path.join(root, "A2"))
    ref_model, ref_optim = source[0]["ddp_model"], source[0]["ddp_optim"]
    assert list(model_sd) == list(TinyNet().state_dict())
    for k, v in ref_model.items():
        assert model_sd[k].dtype == torch.float32 and rel(model_sd[k], v) < 1e-6, k
    assert len(optim_sd["param_groups"]) == len(ref_optim["param_groups"])
    for g, rg in zip(optim_sd["param_groups"], ref_optim["param_groups"]):
        assert g["params"] == rg["params"]
        for key in ("lr", "betas", "eps", "weight_decay", "initial_lr", "max_lr", "decoupled_weight_decay"):
            assert g[key] == rg[key], key
    assert optim_sd["state"].keys() == ref_optim["state"].keys()
    for i, s in ref_optim["state"].items():
        got = optim_sd["state"][i]
        assert got["step"].dtype == s["step"].dtype and float(got["step"]) == float(s["step"])
        assert rel(got["exp_avg"], s["exp_avg"]) < 1e-6 and rel(got["exp_avg_sq"], s["exp_avg_sq"]) < 1e-5, i


def test_consolidated_state_continues_in_torch_adamw(source, root):
    model_sd, optim_sd = ckpt.consolidate(os.path.join(root, "A2"))
    model = TinyNet()
    model.load_state_dict(model_sd, strict=True)
    opt = torch.optim.AdamW(param_groups(model), **HYPER, foreach=False)
    sched = OneCycleLR(opt, max_lr=[4e-3, 2e-3, 6e-3], total_steps=N + M + 2)
    opt.load_state_dict(optim_sd)
    sched.load_state_dict(ckpt.read_extras(os.path.join(root, "A2"))["scheduler"])
    losses = _train(model, opt, sched, N, M, 1, 0)
    want = _global(source, "A_losses")[N:]
    assert max(abs(a - b) / b for a, b in zip(losses, want)) < TOL, (losses, want)
    assert max(rel(p, source[0]["A_params"][n]) for n, p in model.named_parameters()) < TOL


def test_torch_adamw_checkpoint_into_sharded(torch_run, reshard4, tmp_path):
    _, want_losses, want_params = torch_run
    # world size 4, stage 2, masters from the model state dict
    got = _global(reshard4, "torch_losses")
    assert max(abs(a - b) / b for a, b in zip(got, want_losses)) < TOL, (got, want_losses)
    assert max(rel(p, want_params[n]) for n, p in reshard4[0]["torch_params"].items()) < TOL
    # world size 1: weights loaded into the model before building the optimizer
    model = TinyNet()
    model.load_state_dict(torch_run[0]["model"])
    opt = ShardedOptimizer(param_groups(model), **HYPER, stage=1, bucket_numel=BUCKET)
    ckpt.load_torch_state(model, opt, torch_run[0]["optim"])
    losses = _train(model, opt, None, N, M, 1, 0)
    assert max(abs(a - b) / b for a, b in zip(losses, want_losses)) < TOL
    # and through a fused_zero checkpoint back to the same consolidated state
    ckpt.save(tmp_path, model, opt)
    model_sd, optim_sd = ckpt.consolidate(tmp_path)
    assert all(torch.equal(model_sd[n], p) for n, p in model.named_parameters())


def test_cli_consolidate(root, source, tmp_path):
    out = str(tmp_path / "full.pt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(ckpt.__file__)),
                                                      os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "fused_zero.checkpoint", "consolidate",
                           os.path.join(root, "A2"), out], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    full = torch.load(out, weights_only=True)
    model_sd, optim_sd = ckpt.consolidate(os.path.join(root, "A2"))
    assert all(torch.equal(full["model"][k], v) for k, v in model_sd.items())
    assert full["optimizer"]["param_groups"] == optim_sd["param_groups"]
    assert full["scheduler"]["last_epoch"] == N and full["extra"]["epoch"] == 7
    TinyNet().load_state_dict(full["model"], strict=True)
    bad = subprocess.run([sys.executable, "-m", "fused_zero.checkpoint", "consolidate", str(tmp_path / "nope"), out],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 1 and "no checkpoint" in bad.stderr


def test_cli_finds_a_frameworks_checkpoint_and_names_its_flags(root, source, tmp_path, capsys):
    """An HF Trainer checkpoint-N (or Accelerate save_state folder) holds the fused_zero checkpoint in
    fused_zero/: the CLI finds it there; its messages name --tag, the command line's flag."""
    trainer_dir = tmp_path / "checkpoint-40"
    shutil.copytree(os.path.join(root, "A2"), trainer_dir / "fused_zero")
    (trainer_dir / "trainer_state.json").write_text("{}")
    out = str(tmp_path / "full.pt")
    assert ckpt.main(["consolidate", str(trainer_dir), out]) == 0
    model_sd, _ = ckpt.consolidate(os.path.join(root, "A2"))
    assert all(torch.equal(torch.load(out, weights_only=True)["model"][k], v) for k, v in model_sd.items())
    os.remove(trainer_dir / "fused_zero" / "latest")  # a tag must now be named
    assert ckpt.main(["consolidate", str(trainer_dir), out]) == 1
    assert "--tag" in capsys.readouterr().err


# -- crash safety, corruption, wrong models -------------------------------------------------------

def test_save_killed_midway_leaves_previous_checkpoint(tmp_path):
    root = str(tmp_path)
    with pytest.raises(RanksFailed, match="exit code 7"):
        run_ranks(_crash_rank, 2, root, timeout=120)
    with open(os.path.join(root, "latest")) as f:
        assert f.read().strip() == "first"
    assert not os.path.exists(os.path.join(root, "second"))
    assert any(e.startswith(".tmp-second-") for e in os.listdir(root))
    model, opt, sched = _make(2)
    ckpt.load(root, model, opt, sched)
    assert sched.last_epoch == 2 and max(_steps(model, opt).values(), key=lambda s: s or 0) == 2
    _train(model, opt, sched, 2, 1, 1, 0)
    ckpt.save(root, model, opt, sched, tag="third")  # cleans up the dead save's folder
    assert not any(e.startswith(".") for e in os.listdir(root))


def test_crash_before_latest_moves_and_while_overwriting_a_tag(tmp_path, monkeypatch):
    root = str(tmp_path)
    model, opt, sched = _make(2)

    def epoch_of(tag=None):
        fresh, fopt, fsched = _make(2)
        ckpt.load(root, fresh, fopt, fsched, tag=tag)
        return fsched.last_epoch

    def crash(*_):
        raise KeyboardInterrupt("simulated crash")

    _train(model, opt, sched, 0, 2, 1, 0)
    ckpt.save(root, model, opt, sched, tag="first")
    _train(model, opt, sched, 2, 1, 1, 0)
    monkeypatch.setattr(ckpt_files, "set_latest", crash)
    with pytest.raises(KeyboardInterrupt):  # dies after renaming its folder, before 'latest' moves
        ckpt.save(root, model, opt, sched, tag="second")
    monkeypatch.undo()
    assert epoch_of() == 2 and epoch_of("second") == 3
    renames = []

    def rename_then_crash(src, dst):
        renames.append(dst)
        if len(renames) == 2:
            raise KeyboardInterrupt("simulated crash")
        os.replace(src, dst)

    monkeypatch.setattr(ckpt_files.os, "rename", rename_then_crash)
    with pytest.raises(KeyboardInterrupt):  # overwrites "first": dies between its two renames
        ckpt.save(root, model, opt, sched, tag="first")
    monkeypatch.undo()
    assert not os.path.exists(os.path.join(root, "first"))
    with pytest.warns(UserWarning, match="previous version"):
        assert epoch_of() == 2  # the old "first", from its .old- folder
    ckpt.save(root, model, opt, sched, tag="first")
    assert epoch_of() == 3 and sorted(os.listdir(root)) == ["first", "latest", "second"]


def test_corrupted_and_truncated_files_are_named(tmp_path):
    model, opt, sched = _make(2)
    _train(model, opt, sched, 0, 2, 1, 0)
    tagdir = os.path.join(tmp_path, ckpt.save(tmp_path, model, opt, chunk_numel=CHUNK))
    file = os.path.join(tagdir, "shards-rank00000-of-00001.safetensors")
    _corrupt(file, _first_key(file, "qkv.weight:master"), at=3)
    with pytest.raises(ckpt.CheckpointError, match=r"shards-rank00000-of-00001\.safetensors.*qkv\.weight"):
        ckpt.load(tmp_path, *_make(2)[:2])
    with pytest.raises(ckpt.CheckpointError, match=r"qkv\.weight"):
        ckpt.consolidate(tmp_path)
    with open(file, "ab") as f:
        f.write(b"x")
    with pytest.raises(ckpt.CheckpointError, match=r"shards-rank00000-of-00001\.safetensors is \d+ bytes"):
        ckpt.load(tmp_path, *_make(2)[:2])
    with open(os.path.join(tagdir, "metadata.json"), "w") as f:
        f.write("{")
    with pytest.raises(ckpt.CheckpointError, match="metadata.json is not valid JSON"):
        ckpt.consolidate(tmp_path)


class _Wider(TinyNet):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(D, D_OUT + 1)
        self.extra = torch.nn.Linear(2, 2)
        del self.side


def test_wrong_model_names_missing_extra_and_misshaped(tmp_path):
    model, opt, _ = _make(2, groups=False)
    ckpt.save(tmp_path, model, opt)
    other = _Wider()
    with pytest.raises(ValueError) as info:
        ckpt.load(tmp_path, other, ShardedOptimizer(other, **HYPER))
    msg = str(info.value)
    assert "missing from the checkpoint: extra.weight, extra.bias" in msg
    assert "the model does not have: side.weight" in msg
    assert "head.weight (checkpoint [8, 64], model [9, 64])" in msg
    fresh = TinyNet()  # the right model in other param groups
    with pytest.raises(ValueError, match="param groups"):
        ckpt.load(tmp_path, fresh, ShardedOptimizer(param_groups(fresh), **HYPER))


class _BufNet(torch.nn.Module):
    """BatchNorm running stats (persistent buffers), a non-persistent buffer, a weight tied to
    another module's (two state-dict keys, one parameter)."""

    def __init__(self, seed=0):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.inp = torch.nn.Linear(16, D)
            self.bn = torch.nn.BatchNorm1d(D)
            self.mid = torch.nn.Linear(D, D)
            self.out = torch.nn.Linear(D, D)
        self.out.weight = self.mid.weight
        self.register_buffer("scratch", torch.full((3,), float(seed)), persistent=False)

    def forward(self, x, **_):
        h = self.out(torch.tanh(self.mid(self.bn(self.inp(x.flatten(0, 1))))))
        return h.view(x.shape[0], -1, D).mean(dim=1)[:, :D_OUT]


def test_buffers_tied_weights_and_untrained_parameters(tmp_path):
    """Buffers come back from rank 0's copy; the optimizer trains all but ``inp`` (saved from the
    model); the tied weight is one parameter under two keys."""

    def build(seed):
        model = _BufNet(seed)
        trained = [p for n, p in model.named_parameters() if not n.startswith("inp.")]
        return model, ShardedOptimizer(trained, **HYPER, stage=2, bucket_numel=BUCKET)

    model, opt = build(0)
    _train(model, opt, None, 0, 3, 1, 0)
    ckpt.save(tmp_path, model, opt)
    fresh, fopt = build(1)  # other weights and buffers: all must come from the checkpoint
    ckpt.load(tmp_path, fresh, fopt)
    sd, fsd = model.state_dict(), fresh.state_dict()
    assert list(sd) == list(fsd) and "out.weight" in sd and "bn.running_mean" in sd and "scratch" not in sd
    assert all(torch.equal(sd[k], fsd[k]) for k in sd), [k for k in sd if not torch.equal(sd[k], fsd[k])]
    assert fresh.out.weight is fresh.mid.weight and float(fresh.scratch[0]) == 1.0
    assert _train(model, opt, None, 3, 2, 1, 0) == _train(fresh, fopt, None, 3, 2, 1, 0)
    model_sd, optim_sd = ckpt.consolidate(tmp_path)
    assert list(model_sd) == list(_BufNet().state_dict())
    _BufNet().load_state_dict(model_sd, strict=True)
    assert len(optim_sd["param_groups"][0]["params"]) == len(opt.param_groups[0]["params"])


def test_bad_arguments(tmp_path):
    model, opt, sched = _make(2)
    with pytest.raises(TypeError, match="ShardedOptimizer"):
        ckpt.save(tmp_path, model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="tag"):
        ckpt.save(tmp_path, model, opt, tag="../x")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ckpt.load(tmp_path, model, opt)
    ckpt.save(tmp_path, model, opt)
    with pytest.raises(ValueError, match="without scheduler"):
        ckpt.load(tmp_path, model, opt, sched)
    with pytest.raises(TypeError, match="neither JSON nor"):
        ckpt.save(tmp_path, model, opt, extra={"f": lambda: 0})
    import numpy as np
    with pytest.raises(TypeError, match=r"neither JSON nor .*\(WeightsUnpickler error: Unsupported global: .*numpy.*"
                                        r"by default\); keep it .*float\(x\)") as refused:
        ckpt.save(tmp_path, model, opt, extra={"n": np.int64(3)})
    assert "\x1b" not in str(refused.value)  # torch's advice and its terminal escapes left out
    opt.param_groups[0]["lr"] = np.float32(5e-3)  # was the codec's own NotJSON, naming nothing
    with pytest.raises(TypeError, match=r"param group 0's 'lr' is float32 .* optimizer.param_groups\[0\]\['lr'\] ="):
        ckpt.save(tmp_path, model, opt, tag="numpy_lr")
    assert not os.path.exists(os.path.join(tmp_path, "numpy_lr"))  # refused before anything was written
    opt.param_groups[0]["lr"] = 5e-3
    with pytest.raises(FileNotFoundError, match="tags in"):
        ckpt.load(tmp_path, model, opt, tag="nope")


def test_bf16_consolidates_fp32_masters(tmp_path):
    model, opt, _ = _make(2, dtype=torch.bfloat16)
    _train(model, opt, None, 0, 3, 1, 0, torch.bfloat16)
    ckpt.save(tmp_path, model, opt)
    model_sd, optim_sd = ckpt.consolidate(tmp_path)
    names = {id(p): n for n, p in model.named_parameters()}
    for k, part in enumerate(opt.shard_index()):
        for piece in part.pieces:
            name = names[id(part.params[piece.param_index])]
            got = model_sd[name].reshape(-1)[piece.param_offset:piece.param_offset + piece.numel]
            assert model_sd[name].dtype == torch.float32
            assert torch.equal(got, opt.read_shard(k, "master", piece.shard_offset, piece.shard_offset + piece.numel))
    TinyNet().load_state_dict(model_sd, strict=True)
    torch.optim.AdamW(param_groups(TinyNet()), **HYPER).load_state_dict(optim_sd)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_of_a_compiled_model_loads_into_the_model_uncompiled(tmp_path, stage):
    """torch.compile(model) names its parameters '_orig_mod.*': the checkpoint keeps the model's own names, so
    it loads with or without compile (before: 'saved from another model', every parameter missing)."""
    from fused_zero import ShardedOptimizer, checkpoint as ckpt
    from _models import TinyNet, batch, flags, loss_fn
    model = TinyNet()
    opt = ShardedOptimizer(model if stage == 3 else model.parameters(), stage=stage, lr=1e-2)
    x, y = batch(0, 0)
    loss_fn(model(x, **flags(0, 0)), y).backward()
    opt.step()
    compiled = torch.compile(model)  # (never called here: nothing is compiled)
    ckpt.save(str(tmp_path), compiled, opt)
    again = TinyNet()
    again_opt = ShardedOptimizer(again if stage == 3 else again.parameters(), stage=stage, lr=1e-2)
    ckpt.load(str(tmp_path), again, again_opt)
    full = (lambda o: o.full_parameters()) if stage == 3 else (lambda o: torch.no_grad())
    with full(opt), full(again_opt):
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    assert all(not k.startswith("_orig_mod") for k in ckpt.consolidate(str(tmp_path))[0])


@pytest.mark.parametrize("stage", [1, 3])
def test_a_checkpoint_of_a_model_with_blocks_compiled_in_place_loads_without_them_and_back(tmp_path, stage):
    """torchtitan's torch.compile(block) registered in the model names the block's parameters
    'blocks.0._orig_mod.*': the checkpoint kept those names, so it loaded into neither the model uncompiled nor,
    saved uncompiled, into the compiled one ('saved from another model'; compile port). Names are the model's own,
    as torch.distributed.checkpoint's: both ways load, the weights alone too."""
    from torch import nn

    from fused_zero import ShardedOptimizer, checkpoint as ckpt

    def blocks(compiled, optimizer=True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Sequential(nn.Linear(6, 6), nn.Tanh()),
                              nn.Linear(6, 2))
        for i in range(2 if compiled else 0):  # (never called here: nothing is compiled)
            model[i] = torch.compile(model[i])
        if not optimizer:
            return model, None
        return model, ShardedOptimizer(model if stage == 3 else model.parameters(), stage=stage, lr=1e-2)

    full = (lambda o: o.full_parameters()) if stage == 3 else (lambda o: torch.no_grad())
    for saved_compiled in (True, False):
        model, opt = blocks(saved_compiled)
        model(torch.ones(3, 6)).sum().backward()
        opt.step()
        folder = str(tmp_path / str(saved_compiled))
        ckpt.save(folder, model, opt)
        again, again_opt = blocks(not saved_compiled)
        ckpt.load(folder, again, again_opt)
        with full(opt), full(again_opt):
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
        weights_only, _ = blocks(not saved_compiled, optimizer=False)
        ckpt.load(folder, weights_only, None)
        with full(opt):
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), weights_only.parameters()))
        assert all("_orig_mod" not in k for k in ckpt.consolidate(folder)[0])
