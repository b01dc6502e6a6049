"""Checkpoints of ShardedOptimizer that load at any world size and stage, and consolidate.

    tag = save(directory, model, optimizer, scheduler=None, *, tag=None, extra=None)  # every rank
    extra = load(directory, model, optimizer, scheduler=None, *, tag=None)             # every rank
    model_sd, optim_sd = consolidate(directory, tag=None)     # one process: plain PyTorch
    load_torch_state(model, optimizer, optim_sd, model_sd=None)  # a torch.optim.AdamW state in
    python -m fused_zero.checkpoint consolidate DIR OUT [--tag TAG]

On disk (``DIR`` on a filesystem every rank sees)::

    DIR/latest               the tag of the newest complete checkpoint (one line)
    DIR/<tag>/metadata.json  written last: every parameter by its name in model.named_parameters()
                             (aliases, shape, dtype, param group, step count, and the saved chunks
                             that hold its elements, with their crc32), the param groups'
                             hyperparameters and members, the state-dict key order, and every
                             file's size and sha256
    DIR/<tag>/shards-rank<r>-of-<n>.safetensors  rank r's fp32 master, exp_avg and exp_avg_sq: a
                             1-D tensor "<name>:<kind>:<first element>" per run of at most
                             chunk_numel elements of a parameter in that rank's shard
    DIR/<tag>/model.safetensors  rank 0's persistent buffers (by state-dict key) and any parameter
                             the optimizer does not train
    DIR/<tag>/scheduler.json, extra.json  the LR scheduler's state_dict and ``extra``: JSON, or
                             scheduler.pt / extra.pt (torch.save, loadable with weights_only=True)

Nothing needs unpickling code to load. Crash safety: every rank writes and fsyncs its files in
``DIR/.tmp-<tag>-<id>/``; when all have succeeded rank 0 writes metadata.json there, renames the
folder to ``DIR/<tag>`` and then atomically replaces ``DIR/latest`` (write, fsync, rename). A save
that dies at any point leaves ``latest`` naming the previous complete checkpoint; load ignores
``.tmp-*`` folders and the next save removes them. Overwriting a tag first moves the old folder
to ``.old-<tag>-<id>``, which load falls back to if the save died before the new one took its place.

Load checks that the model has exactly the saved parameters and buffers (names, shapes) and the
optimizer the saved param groups; each rank then reads only the chunks that overlap its shard
pieces (safe_open per tensor), checks each one's crc32 and reshards them into its partitions.
Small files are checked against their sha256; consolidate checks every chunk and every file.
Every phase ends in one all_gather_object that carries any rank's error to all ranks, which all
raise it, so none is left waiting; the optimizer changes only after every rank has read all it
needs. load_torch_state is the reverse of consolidate: torch.optim.AdamW's state_dict in.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import uuid
import warnings
from contextlib import ExitStack
from typing import Any

import safetensors.torch
import torch
from safetensors import safe_open
from torch import nn

from .checkpoint_format import (DEFAULT_CHUNK_NUMEL, KINDS, LATEST, METADATA, MODEL_FILE, OLD_PREFIX, TMP_PREFIX,
                                VERSION, FORMAT, CheckpointError, Chunk, ModelView, adamw_state_dict, aliases,
                                build_metadata, check_match, check_metadata, check_tag, crc32, decode, from_blob,
                                from_torch, numel_of, rank_file, reshard, shard_tensors, tensor_key, to_blob)
from .optimizer import ShardedOptimizer

__all__ = ["save", "load", "consolidate", "load_torch_state", "read_extras", "CheckpointError", "main"]


def _comm(optimizer):
    if not isinstance(optimizer, ShardedOptimizer):
        raise TypeError(f"optimizer must be a fused_zero.ShardedOptimizer, got {type(optimizer).__name__}; "
                        "save a torch.optim optimizer with torch.save(optimizer.state_dict())")
    return optimizer.comm


def _agree(comm, fn, share=None):
    return comm.agree(fn, share, errors=(CheckpointError,))


# -- files ---------------------------------------------------------------------------------------

def _write_file(path: str, data: bytes) -> dict:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # not every platform can fsync a directory
        pass


def _set_latest(directory: str, tag: str) -> None:
    tmp = os.path.join(directory, LATEST + ".tmp")
    _write_file(tmp, (tag + "\n").encode())
    os.replace(tmp, os.path.join(directory, LATEST))
    _fsync_dir(directory)


def _read_checked(path: str, meta: dict, name: str) -> bytes:
    with open(os.path.join(path, name), "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != meta["files"][name]["sha256"]:
        raise CheckpointError(f"{os.path.join(path, name)} fails its sha256 check: the file is corrupted; "
                              "restore it or load an older tag")
    return data


def _unblob(path: str, meta: dict, name: str | None) -> Any:
    return None if name is None else from_blob(name, _read_checked(path, meta, name))


def _model_tensors(path: str, meta: dict) -> dict[str, torch.Tensor]:
    """model.safetensors; a corrupted file names the buffers and parameters that differ."""
    try:
        return safetensors.torch.load(_read_checked(path, meta, MODEL_FILE))
    except CheckpointError:
        with open(os.path.join(path, MODEL_FILE), "rb") as f:
            data = f.read()
        try:
            tensors = safetensors.torch.load(data)
        except Exception:  # noqa: BLE001 - the header itself is damaged
            tensors = {}
        bad = [k for k, info in meta["model_tensors"].items() if k not in tensors or crc32(tensors[k]) != info["crc32"]]
        raise CheckpointError(f"{os.path.join(path, MODEL_FILE)} fails its sha256 check (tensors that differ: "
                              f"{bad or 'none; its header'}): the file is corrupted; restore it or load an older tag"
                              ) from None


class _Reader:
    """Reads saved chunks from the rank files, checking each one's crc32."""

    def __init__(self, path: str, meta: dict, stack: ExitStack) -> None:
        self.path, self.meta, self.stack, self.files = path, meta, stack, {}

    def chunk(self, name: str, c: Chunk) -> list[torch.Tensor]:
        fname = self.meta["rank_files"][c.file]
        file = os.path.join(self.path, fname)
        try:
            if fname not in self.files:
                self.files[fname] = self.stack.enter_context(safe_open(file, framework="pt"))
            out = []
            for kind, crc in zip(KINDS, c.crcs):
                key = tensor_key(name, kind, c.start)
                t = self.files[fname].get_tensor(key)
                if t.numel() != c.numel or t.dtype != torch.float32 or crc32(t) != crc:
                    raise CheckpointError(f"{file}: tensor {key!r} (parameter {name!r}, {kind}, elements "
                                          f"{c.start}..{c.start + c.numel}) fails its crc32 check: the file is "
                                          "corrupted; restore it or load an older tag")
                out.append(t)
            return out
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors' own errors, made to name the file
            raise CheckpointError(f"{file} cannot be read ({str(e).splitlines()[0]}) for parameter {name!r}: "
                                  "the file is corrupted; restore it or load an older tag") from None

    def full(self, name: str) -> list[torch.Tensor]:
        rec = self.meta["params"][name]
        out = [torch.zeros(numel_of(rec["shape"])) for _ in KINDS]
        for row in rec["chunks"]:
            c = Chunk.parse(row)
            for dst, src in zip(out, self.chunk(name, c)):
                dst[c.start:c.start + c.numel] = src
        return [t.view(rec["shape"]) for t in out]


def _resolve(directory, tag: str | None) -> str:
    """The folder of checkpoint ``tag`` (default: the one ``latest`` names, or ``directory`` itself)."""
    directory = os.fspath(directory)
    if tag is None:
        if os.path.isfile(os.path.join(directory, METADATA)):
            return directory
        latest = os.path.join(directory, LATEST)
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"no checkpoint in {directory}: it has no {LATEST!r} file; check the path, "
                                    "or pass tag= to name one")
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(directory, check_tag(tag))
    if os.path.isfile(os.path.join(path, METADATA)):
        return path
    entries = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    olds = [e for e in entries if e.startswith(f"{OLD_PREFIX}{tag}-") and os.path.isfile(os.path.join(directory, e,
                                                                                                     METADATA))]
    if olds:
        warnings.warn(f"{path} is missing (a save overwriting it died): loading its previous version {olds[-1]}")
        return os.path.join(directory, olds[-1])
    tags = [e for e in entries if not e.startswith(".") and os.path.isfile(os.path.join(directory, e, METADATA))]
    raise FileNotFoundError(f"checkpoint {path} does not exist (or has no {METADATA}); tags in {directory}: {tags}")


def _read_metadata(path: str) -> tuple[dict, str]:
    """The metadata (checked for format, version, file sizes, chunk tiling) and its sha256."""
    file = os.path.join(path, METADATA)
    with open(file, "rb") as f:
        data = f.read()
    try:
        meta = json.loads(data)
    except ValueError as e:
        raise CheckpointError(f"{file} is not valid JSON ({e}): the checkpoint is corrupted") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not the metadata of a fused_zero checkpoint")
    if meta.get("version", 0) > VERSION:
        raise CheckpointError(f"{file} has format version {meta['version']}; this fused_zero reads up to {VERSION}: "
                              "upgrade fused_zero")
    for fname, info in meta["files"].items():
        full = os.path.join(path, fname)
        size = os.path.getsize(full) if os.path.isfile(full) else None
        if size != info["bytes"]:
            raise CheckpointError(f"{full} is {'missing' if size is None else f'{size} bytes'}; the metadata says "
                                  f"{info['bytes']} bytes: the checkpoint is incomplete or corrupted")
    check_metadata(meta)
    return meta, hashlib.sha256(data).hexdigest()


def read_extras(directory, tag: str | None = None) -> dict[str, Any]:
    """``{"scheduler": the saved scheduler state_dict or None, "extra": the saved extra or None}``."""
    path = _resolve(directory, tag)
    meta, _ = _read_metadata(path)
    return {k: _unblob(path, meta, meta[k]) for k in ("scheduler", "extra")}


# -- save ----------------------------------------------------------------------------------------

def save(directory, model: nn.Module, optimizer: ShardedOptimizer, scheduler=None, *, tag: str | None = None,
         extra: Any = None, chunk_numel: int = DEFAULT_CHUNK_NUMEL) -> str:
    """Save (model, optimizer, scheduler, extra) as checkpoint ``directory/<tag>``; every rank calls it.

    ``tag`` defaults to ``step<N>``, N the largest step count. ``extra`` may hold tensors, numbers,
    strings, lists, tuples and dicts; load returns it. Returns the tag.
    """
    directory, comm = os.fspath(directory), _comm(optimizer)

    def prepare():
        view = ModelView(model, optimizer)
        if not isinstance(chunk_numel, int) or chunk_numel < 1:
            raise ValueError(f"chunk_numel must be a positive int, got {chunk_numel!r}")
        _check_scheduler(scheduler, optimizer)
        steps = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
        name = check_tag(f"step{max(steps, default=0)}" if tag is None else tag)
        blobs = {}
        if comm.rank == 0:
            if scheduler is not None:
                blobs["scheduler"] = to_blob(scheduler.state_dict(), "scheduler", "the scheduler's state_dict()")
            if extra is not None:
                blobs["extra"] = to_blob(extra, "extra", "extra")
        return view, name, blobs

    (view, name, blobs), tags = _agree(comm, prepare, share=lambda r: r[1])
    if len(set(tags)) != 1:
        raise ValueError(f"ranks passed different tags {tags}: pass the same tag (or none) on every rank")

    def make_tmp():
        if comm.rank != 0:
            return None
        os.makedirs(directory, exist_ok=True)
        final = os.path.join(directory, name)
        if os.path.exists(final) and not os.path.isfile(os.path.join(final, METADATA)):
            raise FileExistsError(f"{final} exists and is not a fused_zero checkpoint: choose another tag")
        _clean(directory)
        tmp = f"{TMP_PREFIX}{name}-{uuid.uuid4().hex[:12]}"
        os.mkdir(os.path.join(directory, tmp))
        return tmp

    _, tmps = _agree(comm, make_tmp, share=lambda r: r)
    tmp = os.path.join(directory, tmps[0])

    def write():
        if not os.path.isdir(tmp):
            raise FileNotFoundError(f"rank {comm.rank} does not see {tmp}, which rank 0 created: pass the same "
                                    "directory on every rank, on a filesystem that all ranks share")
        tensors, table = shard_tensors(view, chunk_numel)
        fname = rank_file(comm.rank, comm.world_size)
        files = {fname: _write_file(os.path.join(tmp, fname), safetensors.torch.save(tensors))}
        del tensors
        if comm.rank != 0:
            return files, table, None
        own = {k: b.detach().to("cpu", copy=True).contiguous() for k, b in view.buffers.items()}
        own.update({n: p.detach().to("cpu", copy=True).contiguous() for n, p in view.unmanaged().items()})
        files[MODEL_FILE] = _write_file(os.path.join(tmp, MODEL_FILE), safetensors.torch.save(own))
        for fname, data in blobs.values():
            files[fname] = _write_file(os.path.join(tmp, fname), data)
        info = {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "crc32": crc32(t)}
                for k, t in own.items()}
        return files, table, info

    _, written = _agree(comm, write, share=lambda r: r)

    def finish():
        if comm.rank != 0:
            return
        meta = build_metadata(view, name, written, {k: fname for k, (fname, _) in blobs.items()})
        _write_file(os.path.join(tmp, METADATA), json.dumps(meta, indent=1).encode())
        _fsync_dir(tmp)
        final = os.path.join(directory, name)
        if os.path.exists(final):
            os.rename(final, os.path.join(directory, f"{OLD_PREFIX}{name}-{uuid.uuid4().hex[:12]}"))
        os.rename(tmp, final)
        _fsync_dir(directory)
        _set_latest(directory, name)
        _clean(directory)  # the replaced folder, and one an earlier overwrite that died left

    _agree(comm, finish)
    return name


def _clean(directory: str) -> None:
    """Remove what saves that died left behind, and replaced tags (rank 0)."""
    for entry in os.listdir(directory):
        path = os.path.join(directory, entry)
        if entry.startswith(TMP_PREFIX):
            shutil.rmtree(path, ignore_errors=True)
        elif entry.startswith(OLD_PREFIX):
            tag = entry[len(OLD_PREFIX):].rsplit("-", 1)[0]
            if os.path.isfile(os.path.join(directory, tag, METADATA)):
                shutil.rmtree(path, ignore_errors=True)


def _check_scheduler(scheduler, opt) -> None:
    if scheduler is None:
        return
    if not (hasattr(scheduler, "state_dict") and hasattr(scheduler, "load_state_dict")):
        raise TypeError(f"scheduler must be an LR scheduler (with state_dict and load_state_dict), got "
                        f"{type(scheduler).__name__}")
    if getattr(scheduler, "optimizer", opt) is not opt:
        raise ValueError("the scheduler drives another optimizer: pass the scheduler built on this optimizer")


# -- load ----------------------------------------------------------------------------------------

def load(directory, model: nn.Module, optimizer: ShardedOptimizer, scheduler=None, *, tag: str | None = None) -> Any:
    """Load a checkpoint saved at any world size and stage; every rank calls it. Returns ``extra``.

    ``tag`` defaults to the one ``directory/latest`` names (``directory`` may also be a tag's
    folder). The scheduler's state is restored when one is passed.
    """
    comm = _comm(optimizer)

    def prepare():
        view = ModelView(model, optimizer)
        _check_scheduler(scheduler, optimizer)
        path = _resolve(directory, tag)
        meta, digest = _read_metadata(path)
        check_match(view, meta, path)
        if scheduler is not None and meta["scheduler"] is None:
            raise ValueError(f"{path} holds no LR scheduler state (it was saved without scheduler=): load it "
                             "without scheduler=")
        return view, path, meta, digest

    (view, path, meta, _), digests = _agree(comm, prepare, share=lambda r: r[3])
    if len(set(digests)) != 1:
        raise CheckpointError(f"ranks read different {METADATA} files for {directory}: every rank must load the "
                              "same checkpoint, from a filesystem that all ranks share")

    def read():
        with ExitStack() as stack:
            staged = reshard(view, meta, _Reader(path, meta, stack).chunk)
        alias = aliases(meta)
        saved = _model_tensors(path, meta)
        tensors = {k: saved[alias.get(k, k)] for k in [*view.buffers, *view.unmanaged()]}
        steps = {n: meta["params"][alias[n]]["step"] for n in view.group_of}
        hypers = [decode(g["hyper"]) for g in meta["param_groups"]]
        extras = {k: _unblob(path, meta, meta[k]) for k in ("scheduler", "extra")}
        return staged, steps, hypers, tensors, extras

    (staged, steps, hypers, tensors, extras), _ = _agree(comm, read)
    _commit(view, staged, steps, hypers, tensors, scheduler, extras["scheduler"])
    return extras["extra"]


@torch.no_grad()
def _commit(view: ModelView, staged, steps: dict, hypers: list, tensors: dict, scheduler=None,
            sched_state=None) -> None:
    """Write what every rank has read into the optimizer, model and scheduler (all ranks join)."""
    opt = view.opt
    for info in opt.shard_index():
        for p in info.params:
            opt.state.pop(p, None)
            step = steps.get(view.name(p))
            if step is not None:
                opt.state[p]["step"] = torch.tensor(float(step))
    for group, hyper in zip(opt.param_groups, hypers):
        group.update(hyper)
    for key, b in view.buffers.items():
        b.copy_(tensors[key])
    for name, p in view.unmanaged().items():
        p.copy_(tensors[name])
    if scheduler is not None:
        scheduler.load_state_dict(sched_state)
    opt.load_shards([dict(zip(KINDS, new)) for new in staged])


# -- plain PyTorch -------------------------------------------------------------------------------

def consolidate(directory, tag: str | None = None) -> tuple[dict, dict]:
    """(the model's state_dict with fp32 parameters, a torch.optim.AdamW state_dict), in one process.

    Parameters come from the fp32 masters (whatever the model's dtype), buffers as saved, keys in
    model.state_dict() order; the optimizer state numbers parameters in param_groups order, as
    ``torch.optim.AdamW(groups).state_dict()`` does. Checks every chunk's crc32 and file's sha256.
    """
    path = _resolve(directory, tag)
    meta, _ = _read_metadata(path)
    saved = _model_tensors(path, meta)
    full = {}
    with ExitStack() as stack:
        reader = _Reader(path, meta, stack)
        for name, rec in meta["params"].items():
            full[name] = reader.full(name) if rec["group"] is not None else [saved[name].float(), None, None]
    for fname in meta["rank_files"]:
        _read_checked(path, meta, fname)
    alias = aliases(meta)
    model_sd = {k: full[alias[k]][0] if k in alias else saved[k] for k in meta["state_dict_keys"]}
    return model_sd, adamw_state_dict(meta, {n: t[1:] for n, t in full.items()})


def load_torch_state(model: nn.Module, optimizer: ShardedOptimizer, optim_state_dict: dict,
                     model_state_dict: dict | None = None) -> None:
    """Load a ``torch.optim.AdamW`` state_dict (and optionally the model's) into a ShardedOptimizer.

    The optimizer must have the torch optimizer's param groups, in the same order. Without
    ``model_state_dict`` the weights stay those the optimizer holds (the model's when it was built,
    or after its last step); with it, the fp32 masters, buffers and untrained parameters come from
    it at full precision. Every rank calls it with the same state dicts.
    """
    comm = _comm(optimizer)

    def prepare():
        view = ModelView(model, optimizer)
        staged, steps, hypers = from_torch(view, optim_state_dict, model_state_dict)
        names = [*view.buffers, *view.unmanaged()]
        if model_state_dict is None:
            tensors = {**view.buffers, **{n: p.detach() for n, p in view.unmanaged().items()}}
        else:
            tensors = {k: model_state_dict[k] for k in names}
        return view, staged, steps, hypers, tensors

    (view, staged, steps, hypers, tensors), _ = _agree(comm, prepare)
    _commit(view, staged, steps, hypers, tensors)


# -- command line --------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fused_zero.checkpoint", description="fused_zero checkpoints")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write a checkpoint's full fp32 model state_dict and torch.optim.AdamW "
                       "state_dict to OUT with torch.save: {'model': ..., 'optimizer': ..., 'scheduler': state_dict "
                       "or None, 'extra': ... or None}; read it with torch.load(OUT, weights_only=True)")
    c.add_argument("directory", help="the checkpoint directory (holding 'latest'), or one tag's folder")
    c.add_argument("out", help="the file to write")
    c.add_argument("--tag", default=None, help="the tag to consolidate (default: the one 'latest' names)")
    args = parser.parse_args(argv)
    try:
        model_sd, optim_sd = consolidate(args.directory, args.tag)
        extras = read_extras(args.directory, args.tag)
    except (CheckpointError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tmp = args.out + ".tmp"
    torch.save({"model": model_sd, "optimizer": optim_sd, **extras}, tmp)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}: {len(model_sd)} model tensors ({sum(t.numel() for t in model_sd.values())} elements), "
          f"AdamW state of {len(optim_sd['state'])} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
