"""save and load: every rank calls them; each phase ends in one Comm.agree, so an error on any rank
is raised on every rank before the next collective, and the optimizer changes only after every
rank has read all it needs."""
from __future__ import annotations

import abc
import json
import os
import uuid
from contextlib import ExitStack
from typing import Any

import safetensors.torch
import torch
from torch import nn

from . import files
from .codec import decode, to_blob
from .errors import CheckpointError
from .files import METADATA, MODEL_FILE, OLD_PREFIX, TMP_PREFIX, check_tag, crc32, rank_file
from .metadata import build_metadata, check_group_values, check_match, read_metadata
from .reshard import DEFAULT_CHUNK_NUMEL, aliases, reshard
from .shards import Reader, model_state, model_tensors, shard_tensors, unblob
from .view import ModelView, plain_name
from ..state_views import OWN_KEYS


class ShardOwner(abc.ABC):
    """What checkpoints save and load: ``ShardedOptimizer`` registers itself (optimizer.py), so that this
    package never imports the optimizer (which imports ``optim_state`` for its state_dict()). Checkpoints
    use only its public shard interface: ``comm``, ``collective_call``, ``check_states_kept``, ``take_in_state_edits``,
    ``shard_index``, ``read_shard``, ``load_shards``, ``state``, ``param_groups``, ``config``."""


def comm_of(optimizer):
    if not isinstance(optimizer, ShardOwner):
        raise TypeError(f"optimizer must be a fused_zero.ShardedOptimizer, got {type(optimizer).__name__}; "
                        "save a torch.optim optimizer with torch.save(optimizer.state_dict()), and load a "
                        "checkpoint's weights alone (a new optimizer) with checkpoint.load(directory, model, None)")
    return optimizer.comm


def replicas_of(optimizer):
    """HSDP: the group of this rank's replicas (they hold the same shards), or None."""
    topology = getattr(optimizer, "topology", None)
    return None if topology is None else topology.replicate


def agree(comm, fn, share=None):
    return comm.agree(fn, share, errors=(CheckpointError,))


def read_extras(directory, tag: str | None = None) -> dict[str, Any]:
    """``{"scheduler": the saved scheduler state_dict or None, "extra": the saved extra or None}``."""
    path = files.resolve(directory, tag)
    meta, _ = read_metadata(path)
    return {k: unblob(path, meta, meta[k]) for k in ("scheduler", "extra")}


def save(directory, model: nn.Module, optimizer, scheduler=None, *, tag: str | None = None,
         extra: Any = None, chunk_numel: int = DEFAULT_CHUNK_NUMEL) -> str:
    """Save (model, optimizer, scheduler, extra) as checkpoint ``directory/<tag>``; every rank calls it.

    ``tag`` defaults to ``step<N>``, N the largest step count. ``extra`` may hold tensors, numbers,
    strings, lists, tuples and dicts; load returns it. Returns the tag.
    """
    comm_of(optimizer)
    if hasattr(optimizer, "check_agreement"):  # a step whose ranks disagreed raises on every rank, before any write
        optimizer.check_agreement()
    with optimizer.collective_call("checkpoint.save()"):
        replicas = replicas_of(optimizer)
        if replicas is None:
            return _save(directory, model, optimizer, scheduler, tag, extra, chunk_numel)
        # HSDP: the first replica's shard group writes the checkpoint (the others hold the same shards); every
        # rank returns once it is written, and raises if it failed
        writer = replicas.rank == 0
        _, tags = replicas.agree(lambda: _save(directory, model, optimizer, scheduler, tag, extra, chunk_numel)
                                 if writer else None, share=lambda t: t, errors=(CheckpointError,))
        return tags[0]


def _folder(directory, what: str) -> str:
    try:
        return os.fspath(directory)
    except TypeError:
        raise TypeError(f"fused_zero.checkpoint.{what}() takes the checkpoint folder (a str or os.PathLike), got "
                        f"{type(directory).__name__}: every rank calls it with the same folder (each rank writes "
                        "and reads its own shard), not only rank 0") from None


def _save(directory, model, optimizer, scheduler, tag, extra, chunk_numel) -> str:
    comm = comm_of(optimizer)

    def prepare():
        folder = _folder(directory, "save")  # (on every rank: DDP scripts pass None on all but rank 0)
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise FileExistsError(f"{folder} is a file, not a folder: fused_zero.checkpoint.save() writes a folder of "
                                  "shards there; pass a folder path (it is made if missing)")
        optimizer.check_states_kept()  # (closed with its states in NVMe files: nothing to save)
        optimizer.take_in_state_edits()  # moments put in optimizer.state since the last step: saved
        view = ModelView(model, optimizer)
        if not isinstance(chunk_numel, int) or chunk_numel < 1:
            raise ValueError(f"chunk_numel must be a positive int, got {chunk_numel!r}")
        _check_scheduler(scheduler, optimizer)
        check_group_values(optimizer.param_groups)  # metadata.json holds them: refused here, before any write
        steps = [int(s["step"]) for p, s in optimizer.state.items() if id(p) in view.where and "step" in s]
        name = check_tag(f"step{max(steps, default=0)}" if tag is None else tag)
        blobs = {}
        if comm.rank == 0:
            if scheduler is not None:
                blobs["scheduler"] = to_blob(scheduler.state_dict(), "scheduler", "the scheduler's state_dict()")
            if extra is not None:
                blobs["extra"] = to_blob(extra, "extra", "extra")
            kept = state_extras(view)
            if kept is not None:
                blobs["optim_extra"] = to_blob(kept, "optim_extra", "optimizer.state's entries beyond its moments "
                                               "and steps (under keys that are no parameter, or keys of its own)")
        return view, name, blobs, folder

    (view, name, blobs, directory), shared = agree(comm, prepare, share=lambda r: (r[1], scheduler is not None))
    tags = [t for t, _ in shared]
    if len(set(tags)) != 1:
        raise ValueError(f"ranks passed different tags {tags}: pass the same tag (or none) on every rank")
    _check_scheduler_everywhere([given for _, given in shared], "save")

    def make_tmp():
        if comm.rank != 0:
            return None
        os.makedirs(directory, exist_ok=True)
        final = os.path.join(directory, name)
        if os.path.exists(final) and not os.path.isfile(os.path.join(final, METADATA)):
            raise FileExistsError(f"{final} exists and is not a fused_zero checkpoint: choose another tag")
        files.clean(directory)
        tmp = f"{TMP_PREFIX}{name}-{uuid.uuid4().hex[:12]}"
        os.mkdir(os.path.join(directory, tmp))
        return tmp

    _, tmps = agree(comm, make_tmp, share=lambda r: r)
    frozen = optimizer.frozen_weights()  # stage 3: the frozen weights, whole on rank 0 (every rank gathers)
    tmp = os.path.join(directory, tmps[0])

    def write():
        if not os.path.isdir(tmp):
            raise FileNotFoundError(f"rank {comm.rank} does not see {tmp}, which rank 0 created: pass the same "
                                    "directory on every rank, on a filesystem that all ranks share")
        tensors, table = shard_tensors(view, chunk_numel)
        fname = rank_file(comm.rank, comm.world_size)
        written = {fname: files.write_file(os.path.join(tmp, fname), safetensors.torch.save(tensors))}
        del tensors
        if comm.rank != 0:
            return written, table, None
        own = {k: b.detach().to("cpu", copy=True).contiguous() for k, b in view.buffers.items()}
        own.update({n: frozen[p].contiguous() if p in frozen else p.detach().to("cpu", copy=True).contiguous()
                    for n, p in view.unmanaged().items()})
        written[MODEL_FILE] = files.write_file(os.path.join(tmp, MODEL_FILE), safetensors.torch.save(own))
        for fname, data in blobs.values():
            written[fname] = files.write_file(os.path.join(tmp, fname), data)
        info = {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "crc32": crc32(t)}
                for k, t in own.items()}
        return written, table, info

    _, written = agree(comm, write, share=lambda r: r)

    def finish():
        if comm.rank != 0:
            return
        meta = build_metadata(view, name, written, {k: fname for k, (fname, _) in blobs.items()})
        files.write_file(os.path.join(tmp, METADATA), json.dumps(meta, indent=1).encode())
        files.fsync_dir(tmp)
        final = os.path.join(directory, name)
        if os.path.exists(final):
            os.rename(final, os.path.join(directory, f"{OLD_PREFIX}{name}-{uuid.uuid4().hex[:12]}"))
        os.rename(tmp, final)
        files.fsync_dir(directory)
        files.set_latest(directory, name)
        files.clean(directory)  # the replaced folder, and one an earlier overwrite that died left

    agree(comm, finish)
    return name


def _check_scheduler_everywhere(given: list[bool], call: str) -> None:
    """The scheduler passed on every rank or on none (rank 0 saves it; each rank loads its own)."""
    if len(set(given)) != 1:
        ranks = [r for r, g in enumerate(given) if g]
        raise ValueError(f"a scheduler was passed to checkpoint.{call}() on ranks {ranks} only: pass it on every rank "
                         "(each rank's scheduler sets its own optimizer's lr), or on none")


def _check_scheduler(scheduler, opt) -> None:
    if scheduler is None:
        return
    if not (hasattr(scheduler, "state_dict") and hasattr(scheduler, "load_state_dict")):
        raise TypeError(f"scheduler must be an LR scheduler (with state_dict and load_state_dict), got "
                        f"{type(scheduler).__name__}")
    if getattr(scheduler, "optimizer", opt) is not opt:
        raise ValueError("the scheduler drives another optimizer: pass the scheduler built on this optimizer")


def load(directory, model: nn.Module, optimizer, scheduler=None, *, tag: str | None = None) -> Any:
    """Load a checkpoint saved at any world size and stage; every rank calls it. Returns ``extra``.

    ``tag`` defaults to the one ``directory/latest`` names (``directory`` may also be a tag's
    folder). The scheduler's state is restored when one is passed.

    ``optimizer=None`` loads the model's weights only (fine-tuning with a new optimizer, as Megatron's
    ``--no-load-optim`` or DeepSpeed's ``load_optimizer_states=False``): each process reads the fp32
    masters, no collective, into a model not sharded at stage 3 (build the optimizer after, or load
    inside ``with optimizer.full_parameters(writeback=True):``); its dtype is the model's own.
    """
    if optimizer is None:
        return _load_weights(directory, model, scheduler, tag)
    comm_of(optimizer)
    with optimizer.collective_call("checkpoint.load()"):
        return _load(directory, model, optimizer, scheduler, tag)


def _load(directory, model, optimizer, scheduler, tag) -> Any:
    comm = comm_of(optimizer)

    def prepare():
        optimizer.check_states_kept()  # (closed with its states in NVMe files: nowhere to load them)
        view = ModelView(model, optimizer)
        _check_scheduler(scheduler, optimizer)
        path = files.resolve(_folder(directory, "load"), tag)
        meta, digest = read_metadata(path)
        check_match(view, meta, path)
        if scheduler is not None and meta["scheduler"] is None:
            raise ValueError(f"{path} holds no LR scheduler state (it was saved without scheduler=): load it "
                             "without scheduler=")
        return view, path, meta, digest

    (view, path, meta, _), shared = agree(comm, prepare, share=lambda r: (r[3], scheduler is not None))
    digests = [d for d, _ in shared]
    _check_scheduler_everywhere([given for _, given in shared], "load")
    if len(set(digests)) != 1:
        raise CheckpointError(f"ranks read different {METADATA} files for {directory}: every rank must load the "
                              "same checkpoint, from a filesystem that all ranks share")

    def read():
        saved = model_tensors(path, meta)
        with ExitStack() as stack:
            staged = reshard(view, meta, Reader(path, meta, stack).chunk, saved.__getitem__)
        alias = aliases(meta)
        tensors = {k: saved[alias.get(k, k)] for k in [*view.buffers, *view.unmanaged()]}
        steps = {n: meta["params"][alias[n]]["step"] for n in view.group_of}
        hypers = [decode(g["hyper"]) for g in meta["param_groups"]]
        extras = {k: unblob(path, meta, meta.get(k)) for k in ("scheduler", "extra", "optim_extra")}
        return staged, steps, hypers, tensors, extras

    (staged, steps, hypers, tensors, extras), _ = agree(comm, read)
    commit(view, staged, steps, hypers, tensors, scheduler, extras["scheduler"], extras["optim_extra"])
    optimizer.load_codec_state(meta.get("codec_state") or {})
    return extras["extra"]


def _load_weights(directory, model, scheduler, tag) -> Any:
    """``load(directory, model, None)``: the parameters and buffers only, in this process."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if scheduler is not None:
        raise ValueError("load(directory, model, None, scheduler) loads the model's weights only: a scheduler's "
                         "state belongs with its optimizer's; pass the optimizer too, or no scheduler")
    path = files.resolve(_folder(directory, "load"), tag)
    meta, _ = read_metadata(path)
    sd = model_state(path, meta)
    empty = [k for k, p in model.named_parameters() if p.numel() == 0 and k in sd and sd[k].numel() > 0]
    if empty:
        raise RuntimeError(f"{empty[0]} is an empty placeholder: the model is sharded at stage 3 by a "
                           "ShardedOptimizer. Load its weights inside `with optimizer.full_parameters(writeback=True):` "
                           "(every rank), or with the optimizer: checkpoint.load(directory, model, optimizer)")
    own = {plain_name(k): k for named in (model.named_parameters(remove_duplicate=False),
                                          model.named_buffers(remove_duplicate=False))
           for k, _ in named}  # (torch.compile(block) in the model: its keys hold "_orig_mod.")
    sd = {own.get(k, k): v for k, v in sd.items()}
    with torch.no_grad():
        model.load_state_dict(sd)  # (torch's strict load: missing, unexpected and mis-shaped keys named)
    return unblob(path, meta, meta.get("extra"))


def state_extras(view: ModelView) -> dict | None:
    """What ``optimizer.state`` holds beyond the steps and moments, which ``state_dict()`` keeps as torch's does:
    entries under keys that are no parameter (``opt.state["epoch"] = 7``) and keys of user code's own in a
    parameter's state (by the parameter's name); None where there is none."""
    others, own = [], {}
    for key, value in view.opt.state.items():
        if id(key) not in view.where:
            if not isinstance(key, torch.Tensor):  # (a tensor key no param group holds: torch's state_dict() fails)
                others.append([key, value])
        elif isinstance(value, dict):
            mine = {k: v for k, v in value.items() if k not in OWN_KEYS}
            if mine:
                own[view.name(key)] = mine
    return {"state": others, "params": own} if others or own else None


def _replace_other_keys(state: dict, kept: list) -> None:
    """``state``'s entries under keys that are no parameter <- the saved ones (as ``load_state_dict`` replaces
    them)."""
    for key in [k for k in state if not isinstance(k, torch.Tensor)]:
        del state[key]
    for key, value in kept:
        state[key] = value


@torch.no_grad()
def commit(view: ModelView, staged, steps: dict, hypers: list, tensors: dict, scheduler=None,
           sched_state=None, state_extra=None) -> None:
    """Write what every rank has read into the optimizer, model and scheduler (all ranks join)."""
    opt = view.opt
    own = state_extra["params"] if state_extra else {}  # per parameter name: keys of user code's own
    for info in opt.shard_index():
        for p in info.params:
            opt.state.pop(p, None)
            name = view.name(p)
            step = steps.get(name)
            if step is not None:
                opt.state[p]["step"] = torch.tensor(float(step), dtype=torch.float32)
            if name in own:
                opt.state[p].update(own[name])
    _replace_other_keys(opt.state, state_extra["state"] if state_extra else [])
    for group, hyper in zip(opt.param_groups, hypers):
        group.update(hyper)
    for key, b in view.buffers.items():
        b.copy_(tensors[key])
    sharded = {id(p) for part in opt.frozen_index() for p in part.params}  # stage 3's frozen weights
    for name, p in view.unmanaged().items():
        if id(p) not in sharded:
            p.copy_(tensors[name])
    opt.load_frozen_weights({p: tensors[name] for name, p in view.unmanaged().items() if id(p) in sharded})
    if scheduler is not None:
        scheduler.load_state_dict(sched_state)
    opt.load_shards(staged)
