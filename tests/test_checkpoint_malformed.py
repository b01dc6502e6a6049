"""Malformed checkpoints: every damaged, missing or edited file raises CheckpointError naming that
file (never IndexError, KeyError, UnpicklingError, SafetensorError, JSONDecodeError, struct.error
or EOFError), on load and on consolidate, and on every rank of a multi-rank load."""
import json
import os
import shutil

import pytest
import torch
from torch.optim.lr_scheduler import StepLR

from _dist import run_ranks
from _models import HYPER, TinyNet, is_initialized
from fused_zero import ShardedOptimizer

pytest.importorskip("safetensors", reason="fused_zero.checkpoint writes safetensors: pip install safetensors")
from fused_zero import checkpoint as ckpt  # noqa: E402
from fused_zero.checkpoint.metadata import checksum  # noqa: E402
from test_checkpoint import _train  # noqa: E402

RANK0 = "shards-rank00000-of-00001.safetensors"


def _make():
    model = TinyNet()
    opt = ShardedOptimizer(model, **HYPER, stage=2, bucket_numel=1000)
    return model, opt, StepLR(opt, step_size=2)


def _save(root, ws=1, rank=0):
    """A checkpoint with a JSON scheduler state and a torch-file extra; its tag folder."""
    model, opt, sched = _make()
    _train(model, opt, sched, 0, 2, ws, rank)
    tag = ckpt.save(root, model, opt, sched, extra={"big": torch.arange(1000)}, chunk_numel=700)
    return os.path.join(root, tag)


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not is_initialized()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pristine"))
    _save(root)
    return root


# -- damage ---------------------------------------------------------------------------------------

def _meta(tagdir):
    with open(os.path.join(tagdir, "metadata.json")) as f:
        return json.load(f)


def _write_meta(tagdir, meta, reseal=True):
    """Write ``meta``; ``reseal`` recomputes its checksum (a broken writer, not a flipped bit)."""
    if reseal:
        meta["checksum"] = checksum(meta)
    with open(os.path.join(tagdir, "metadata.json"), "w") as f:
        json.dump(meta, f, indent=1)


def _edit_text(tagdir, old, new):
    file = os.path.join(tagdir, "metadata.json")
    with open(file) as f:
        text = f.read()
    assert old in text, old
    with open(file, "w") as f:
        f.write(text.replace(old, new, 1))


def _overwrite(tagdir, name, data=None, keep_size=True, at=0):
    file = os.path.join(tagdir, name)
    size = os.path.getsize(file)
    with open(file, "r+b" if keep_size else "wb") as f:
        f.seek(at)
        f.write(data if data is not None else bytes((7 * i + 3) % 256 for i in range(size - at)))


def _reseal_file(tagdir, name):
    """Record ``name``'s current size and sha256 in the metadata (a file written wrong, not damaged)."""
    import hashlib

    meta = _meta(tagdir)
    with open(os.path.join(tagdir, name), "rb") as f:
        data = f.read()
    meta["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    _write_meta(tagdir, meta)


def _set(path, value):
    def edit(tagdir):
        meta = _meta(tagdir)
        *keys, last = path
        obj = meta
        for k in keys:
            obj = obj[k]
        if value is KeyError:
            del obj[last]
        else:
            obj[last] = value
        _write_meta(tagdir, meta)
    return edit


def _truncate(name, size):
    def edit(tagdir):
        with open(os.path.join(tagdir, name), "r+b") as f:
            f.truncate(size)
    return edit


def _latest(text):
    def edit(tagdir):
        with open(os.path.join(os.path.dirname(tagdir), "latest"), "wb") as f:
            f.write(text)
    return edit


def _garbage_blob(tagdir):
    _overwrite(tagdir, "extra.pt", b"PK\x03\x04 not a zip at all", keep_size=False)
    _reseal_file(tagdir, "extra.pt")


def _garbage_scheduler(tagdir):
    _overwrite(tagdir, "scheduler.json", b'{"last_epoch": ', keep_size=False)
    _reseal_file(tagdir, "scheduler.json")


def _garbage_shard_resealed(tagdir):
    _overwrite(tagdir, RANK0)
    _reseal_file(tagdir, RANK0)


def _ghost(tagdir):
    meta = _meta(tagdir)
    meta["param_groups"][0]["params"].append("ghost")
    _write_meta(tagdir, meta)


FIRST = "inp.weight"
CASES = {  # name: (damage, the file the message names, what else it says)
    "step digit flipped": (lambda d: _edit_text(d, '"step": 2.0', '"step": 3.0'), "metadata.json", "checksum"),
    "eps edited": (lambda d: _edit_text(d, '"eps": 1e-08', '"eps": 1e-07'), "metadata.json", "checksum"),
    "checksum removed": (lambda d: _write_meta(d, {k: v for k, v in _meta(d).items() if k != "checksum"},
                                               reseal=False), "metadata.json", "checksum"),
    "not JSON": (lambda d: _overwrite(d, "metadata.json", b"{", keep_size=False), "metadata.json", "not valid JSON"),
    "binary": (lambda d: _overwrite(d, "metadata.json"), "metadata.json", "not valid JSON"),
    "not a dict": (lambda d: _overwrite(d, "metadata.json", b"[1, 2]", keep_size=False), "metadata.json",
                   "not the metadata"),
    "empty": (lambda d: _overwrite(d, "metadata.json", b"", keep_size=False), "metadata.json", "not valid JSON"),
    "version a string": (_set(["version"], "2"), "metadata.json", "'version'"),
    "no rank_files": (_set(["rank_files"], KeyError), "metadata.json", "no field 'rank_files'"),
    "no params": (_set(["params"], KeyError), "metadata.json", "no field 'params'"),
    "no files": (_set(["files"], KeyError), "metadata.json", "no field 'files'"),
    "params a list": (_set(["params"], []), "metadata.json", "'params'] is list"),
    "shape a string": (_set(["params", FIRST, "shape"], "64x16"), "metadata.json", "['shape'] is str"),
    "no chunks": (_set(["params", FIRST, "chunks"], KeyError), "metadata.json", "no field 'chunks'"),
    "chunk in rank 5": (_set(["params", FIRST, "chunks", 0, 2], 5), "metadata.json", "rank file index"),
    "chunk row short": (_set(["params", FIRST, "chunks", 0], [0, 700]), "metadata.json", "['chunks'][0]"),
    "chunks leave a gap": (_set(["params", FIRST, "chunks", 0, 1], 1), "metadata.json", "leave a gap"),
    "group out of range": (_set(["params", FIRST, "group"], 9), "metadata.json", "['group'] is 9"),
    "shape negative": (_set(["params", FIRST, "shape"], [-64, 16]), "metadata.json", "['shape'] must be"),
    "file size a string": (_set(["files", RANK0, "bytes"], "big"), "metadata.json", "'bytes'"),
    "file named outside": (_set(["rank_files", 0], "../x.safetensors"), "metadata.json", "not listed"),
    "group lists a ghost": (_ghost, "metadata.json", "lists 'ghost'"),
    "hyper undecodable": (_set(["param_groups", 0, "hyper"], {"__tuple__": 5}), "metadata.json", "does not decode"),
    "hyper a list": (_set(["param_groups", 0, "hyper"], []), "metadata.json", "'hyper'"),
    "codec state a list": (_set(["codec_state"], [1]), "metadata.json", "'codec_state'] is list"),
    "codec count negative": (_set(["codec_state"], {"param_gathers": -1}), "metadata.json", "ints >= 0"),
    "unknown state key": (_set(["state_dict_keys", 0], "nope"), "metadata.json", "'nope'"),
    "shard truncated": (_truncate(RANK0, 100), RANK0, "100 bytes"),
    "shard header only": (_truncate(RANK0, 8), RANK0, "8 bytes"),
    "shard missing": (lambda d: os.remove(os.path.join(d, RANK0)), RANK0, "missing"),
    "shard garbage": (lambda d: _overwrite(d, RANK0), RANK0, "cannot be read"),
    "shard data garbage": (lambda d: _overwrite(d, RANK0, at=os.path.getsize(os.path.join(d, RANK0)) - 500), RANK0,
                           "crc32"),
    "shard garbage, resealed": (_garbage_shard_resealed, RANK0, "cannot be read"),
    "model file garbage": (lambda d: _overwrite(d, "model.safetensors"), "model.safetensors", "sha256"),
    "model file missing": (lambda d: os.remove(os.path.join(d, "model.safetensors")), "model.safetensors",
                           "missing"),
    "extra.pt corrupted": (lambda d: _overwrite(d, "extra.pt", b"\0\0\0", at=40), "extra.pt", "sha256"),
    "extra.pt garbage, resealed": (_garbage_blob, "extra.pt", "cannot be decoded"),
    "scheduler.json garbage, resealed": (_garbage_scheduler, "scheduler.json", "cannot be decoded"),
    "latest names nothing": (_latest(b"step99\n"), "latest", "step99"),
    "latest binary": (_latest(b"\xff\xfe\x00garbage"), "latest", "not a tag"),
    "latest empty": (_latest(b""), "latest", "not a tag"),
}


@pytest.fixture
def damaged(pristine, tmp_path, request):
    root = str(tmp_path / "ckpt")
    shutil.copytree(pristine, root)
    damage, fname, what = CASES[request.param]
    with open(os.path.join(root, "latest")) as f:
        damage(os.path.join(root, f.read().strip()))
    return root, fname, what


def _raises(fn, fname, what):
    with pytest.raises(ckpt.CheckpointError) as info:
        fn()
    msg = str(info.value)
    assert fname in msg and what in msg, msg
    return msg


@pytest.mark.parametrize("damaged", list(CASES), indirect=True)
def test_load_names_the_file(damaged):
    root, fname, what = damaged
    model, opt, sched = _make()
    shards = opt.state_dict()
    _raises(lambda: ckpt.load(root, model, opt, sched), fname, what)
    after = opt.state_dict()
    assert all(torch.equal(a, b) for i in shards["state"] for a, b in zip(shards["state"][i].values(),
                                                                          after["state"][i].values()))


@pytest.mark.parametrize("damaged", list(CASES), indirect=True)
def test_consolidate_names_the_file(damaged):
    root, fname, what = damaged
    _raises(lambda: (ckpt.consolidate(root), ckpt.read_extras(root)), fname, what)


def test_cli_names_the_file(pristine, tmp_path):
    root = str(tmp_path / "ckpt")
    shutil.copytree(pristine, root)
    with open(os.path.join(root, "latest")) as f:
        _edit_text(os.path.join(root, f.read().strip()), '"step": 2.0', '"step": 3.0')
    assert ckpt.main(["consolidate", root, str(tmp_path / "out.pt")]) == 1
    assert not os.path.exists(tmp_path / "out.pt")


def test_format_1_without_checksum_loads_with_a_warning(pristine, tmp_path):
    """A checkpoint of format 1 (no checksum, no kinds) still loads; the warning says how to seal it."""
    root = str(tmp_path / "ckpt")
    shutil.copytree(pristine, root)
    with open(os.path.join(root, "latest")) as f:
        tagdir = os.path.join(root, f.read().strip())
    meta = _meta(tagdir)
    meta["version"] = 1
    del meta["checksum"]
    for rec in meta["params"].values():
        del rec["kinds"]
    _write_meta(tagdir, meta, reseal=False)
    model, opt, sched = _make()
    with pytest.warns(UserWarning, match="no checksum.*save it again"):
        ckpt.load(root, model, opt, sched)
    assert sched.last_epoch == 2
    with pytest.warns(UserWarning, match="no checksum"):
        ckpt.consolidate(root)
    meta["version"] = 2  # a format-2 checkpoint whose checksum was removed is refused
    _write_meta(tagdir, meta, reseal=False)
    with pytest.raises(ckpt.CheckpointError, match="metadata.json fails its checksum"):
        ckpt.consolidate(root)


# -- two ranks: only one rank's file is bad -------------------------------------------------------

def _two_rank_case(rank, ws, root, case):
    if case == "save":
        _save(root, ws, rank)
        return None
    if case == "save on rank 0 only":  # DDP's habit: save(out if rank == 0 else None); rank 1 hung rank 0 before
        model, opt, sched = _make()
        out = []
        for folder in (root if rank == 0 else None, os.path.join(root, "again")):
            try:
                ckpt.save(folder, model, opt, sched)
                out.append(None)
            except Exception as e:  # noqa: BLE001
                out.append((type(e).__name__, str(e)))
        return out
    if case == "scheduler on rank 1 only":  # rank 0's save dropped it silently; a load set rank 1's lr alone
        model, opt, sched = _make()
        out = []
        for call in (ckpt.save, ckpt.load):
            try:
                call(root, model, opt, sched if rank == 1 else None)
                out.append(None)
            except Exception as e:  # noqa: BLE001
                out.append((type(e).__name__, str(e)))
        return out, sched.step_size
    model, opt, sched = _make()
    try:
        ckpt.load(root, model, opt, sched)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None


RANK1 = "shards-rank00001-of-00002.safetensors"
TWO_RANK = {"garbage": lambda d: _overwrite(d, RANK1), "truncated": _truncate(RANK1, 64),
            "data garbage": lambda d: _overwrite(d, RANK1, at=os.path.getsize(os.path.join(d, RANK1)) - 300)}


@pytest.fixture(scope="module")
def two_rank_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("two"))
    run_ranks(_two_rank_case, 2, root, "save", timeout=120)
    return root


@pytest.mark.parametrize("case", list(TWO_RANK))
def test_one_ranks_bad_file_raises_on_every_rank(two_rank_root, tmp_path, case):
    root = str(tmp_path / "ckpt")
    shutil.copytree(two_rank_root, root)
    with open(os.path.join(root, "latest")) as f:
        TWO_RANK[case](os.path.join(root, f.read().strip()))
    results = run_ranks(_two_rank_case, 2, root, "load", timeout=60)
    for rank, res in enumerate(results):
        assert res is not None and res[0] == "CheckpointError" and RANK1 in res[1], (rank, res)


def test_save_given_a_folder_on_rank_0_only_raises_on_every_rank_and_saves_after(tmp_path):
    for rank, (first, then) in enumerate(run_ranks(_two_rank_case, 2, str(tmp_path), "save on rank 0 only",
                                                   timeout=60)):
        assert first is not None and first[0] == "TypeError" and "every rank calls it" in first[1], (rank, first)
        assert then is None, (rank, then)


def test_a_scheduler_given_on_one_rank_only_is_refused_on_every_rank(two_rank_root):
    """save or load with scheduler= on rank 1 alone: refused on every rank, nothing loaded (before: the save kept no
    scheduler state and the load restored rank 1's scheduler alone, silently)."""
    for rank, (out, step_size) in enumerate(run_ranks(_two_rank_case, 2, two_rank_root, "scheduler on rank 1 only",
                                                      timeout=60)):
        for res in out:
            assert res is not None and res[0] == "ValueError" and "on ranks [1] only" in res[1], (rank, res)
        assert step_size == 2, rank


@pytest.mark.parametrize("bad", ["out is a folder", "out's folder is missing", "dir is missing"])
def test_cli_refuses_bad_paths_before_writing(pristine, tmp_path, capsys, bad):
    """An OUT that is a folder crashed with IsADirectoryError after writing OUT.tmp in full (left behind); a
    missing parent folder crashed in torch.save; a missing DIR was reported as a missing 'latest' file."""
    root, out = str(pristine), str(tmp_path / "out.pt")
    if bad == "out is a folder":
        os.makedirs(out)
    elif bad == "out's folder is missing":
        out = str(tmp_path / "nowhere" / "out.pt")
    else:
        root = str(tmp_path / "no-such-checkpoint")
    assert ckpt.main(["consolidate", root, out]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and ("is not a folder" in err or "must be a file path" in err), err
    assert not os.path.exists(out + ".tmp")
