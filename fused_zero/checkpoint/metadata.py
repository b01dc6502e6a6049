"""metadata.json: building it, sealing it with a checksum of its own content, and checking it
(JSON, checksum, version, every field's type and cross-reference, file sizes, chunk tiling) and
its fit to a model before anything else is read."""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Mapping

import torch

from .codec import NotJSON, decode, encode
from .errors import CheckpointError
from .files import MODEL_FILE, METADATA, rank_file
from .reshard import Chunk, aliases, check_tiling, numel_of
from .view import BASE_KINDS, OPTION_OF_KIND, ModelView, group_hyper

FORMAT = "fused_zero.checkpoint"
VERSION = 2  # 2: a "checksum" of the metadata and the state kinds of every parameter ("kinds")
CHECKSUM = "checksum"


def checksum(meta: Mapping) -> str:
    """sha256 of the canonical JSON of ``meta`` without its checksum field."""
    body = {k: v for k, v in meta.items() if k != CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_group_values(param_groups) -> None:
    """TypeError, naming the group and the key, for a param group value metadata.json cannot hold exactly (a numpy
    scalar lr, a Fraction, a set): every rank checks it before anything is written."""
    for i, g in enumerate(param_groups):
        for key, value in group_hyper(g).items():
            try:
                encode(value)  # as build_metadata writes it
            except NotJSON as e:
                raise TypeError(f"param group {i}'s {key!r} is {type(value).__name__} {value!r}, which a checkpoint "
                                f"cannot hold exactly ({e}): set it as a Python number, string, list or tensor "
                                f"(e.g. optimizer.param_groups[{i}][{key!r}] = float(...))") from None


def build_metadata(view: ModelView, tag: str, written: list, files_of: dict) -> dict:
    """metadata.json from every rank's ``(files, chunk table, model tensor info or None)``, sealed."""
    opt = view.opt
    params = {}
    for pid, p in view.params.items():
        name = view.name(p)
        step = opt.state.get(p, {}).get("step") if pid in view.where else None
        params[name] = {"shape": list(view.shape(p)), "dtype": str(p.dtype).removeprefix("torch."),
                        "aliases": view.names[pid][1:], "group": view.group_of.get(name),
                        "step": None if step is None else float(step), "chunks": [],
                        "kinds": list(view.kinds(p)) if pid in view.where else []}
    files, model_tensors = {}, {}
    for rank, (rank_files, table, info) in enumerate(written):
        files.update(rank_files)
        model_tensors.update(info or {})
        for name, start, n, *crcs in table:
            params[name]["chunks"].append([start, n, rank, *crcs])
    for rec in params.values():
        rec["chunks"].sort()
    cfg, ws = opt.config, opt.comm.world_size
    meta = {
        "format": FORMAT, "version": VERSION, "tag": tag, "torch_version": torch.__version__,
        "world_size": ws, "stage": cfg.stage,
        "config": {"bucket_numel": cfg.bucket_numel, "adam_w_mode": cfg.adam_w_mode,
                   "max_grad_norm": cfg.max_grad_norm, "reduce_dtype": None if cfg.reduce_dtype is None
                   else str(cfg.reduce_dtype)},
        "param_groups": [{"hyper": encode(group_hyper(g)), "params": names}
                         for g, names in zip(opt.param_groups, view.groups)],
        "params": params, "state_dict_keys": view.keys, "model_tensors": model_tensors,
        "rank_files": [rank_file(r, ws) for r in range(ws)],
        "scheduler": files_of.get("scheduler"), "extra": files_of.get("extra"), "files": files,
        "optim_extra": files_of.get("optim_extra"),  # optimizer.state beyond steps and moments (absent before)
        "codec_state": opt.codec_state(),  # qwZ's gathers' count (absent in older checkpoints: 0)
    }
    meta[CHECKSUM] = checksum(meta)
    return meta


# -- reading and checking --------------------------------------------------------------------------

class _Schema:
    """Type and cross-reference checks of a parsed metadata.json; the first failure names the field."""

    def __init__(self, file: str) -> None:
        self.file = file

    def need(self, ok: bool, where: str, what: str) -> None:
        if not ok:
            raise CheckpointError(f"{self.file}: {where} {what}: the metadata is malformed (written by a broken or "
                                  "other tool, or edited); restore the file or load an older tag")

    def typed(self, obj: Mapping, key: str, types, where: str):
        self.need(key in obj, where, f"has no field {key!r}")
        self.need(isinstance(obj[key], types) and not (isinstance(obj[key], bool) and bool not in _tuple(types)),
                  f"{where}[{key!r}]", f"is {type(obj[key]).__name__}, not {_names(types)}")
        return obj[key]

    def ints(self, values, where: str, minimum: int = 0) -> None:
        self.need(isinstance(values, list) and all(type(v) is int and v >= minimum for v in values), where,
                  f"must be a list of ints >= {minimum}")

    def strs(self, values, where: str) -> None:
        self.need(isinstance(values, list) and all(isinstance(v, str) for v in values), where,
                  "must be a list of strings")

    def check(self, meta: dict) -> None:
        number = (int, float)
        for key in ("tag", "torch_version"):
            self.typed(meta, key, str, "metadata")
        for key in ("world_size", "stage"):
            self.typed(meta, key, int, "metadata")
        self.need(meta["world_size"] >= 1, "metadata['world_size']", "must be >= 1")
        self.typed(self.typed(meta, "config", dict, "metadata"), "adam_w_mode", bool, "config")
        files = self.typed(meta, "files", dict, "metadata")
        for fname, info in files.items():
            self.need(os.path.basename(fname) == fname and not fname.startswith("."), f"files[{fname!r}]",
                      "is not a plain file name")
            self.need(isinstance(info, dict), f"files[{fname!r}]", "is not a dict")
            self.typed(info, "bytes", int, f"files[{fname!r}]")
            self.typed(info, "sha256", str, f"files[{fname!r}]")
        rank_files = self.typed(meta, "rank_files", list, "metadata")
        self.strs(rank_files, "rank_files")
        for fname in [*rank_files, MODEL_FILE]:
            self.need(fname in files, f"file {fname!r}", "is not listed in 'files'")
        for key in ("scheduler", "extra", "optim_extra"):
            if key == "optim_extra" and key not in meta:
                continue  # (checkpoints written before it existed)
            blob = self.typed(meta, key, (str, type(None)), "metadata")
            self.need(blob is None or (blob in files and blob.endswith((".json", ".pt"))), f"metadata[{key!r}]",
                      f"names {blob!r}, which is not a listed .json or .pt file")
        if "codec_state" in meta:  # absent in checkpoints written before it existed
            codec = self.typed(meta, "codec_state", dict, "metadata")
            self.need(all(type(v) is int and v >= 0 for v in codec.values()), "metadata['codec_state']",
                      "must map names to ints >= 0")
        groups = self.typed(meta, "param_groups", list, "metadata")
        params = self.typed(meta, "params", dict, "metadata")
        for gi, g in enumerate(groups):
            self.need(isinstance(g, dict), f"param_groups[{gi}]", "is not a dict")
            self.need(_decodes(self.typed(g, "hyper", dict, f"param_groups[{gi}]")), f"param_groups[{gi}]['hyper']",
                      "does not decode to a dict of hyperparameters")
            self.strs(self.typed(g, "params", list, f"param_groups[{gi}]"), f"param_groups[{gi}]['params']")
            self.need(len(set(g["params"])) == len(g["params"]), f"param_groups[{gi}]['params']", "repeats a name")
        tensors = self.typed(meta, "model_tensors", dict, "metadata")
        for k, info in tensors.items():
            self.need(isinstance(info, dict), f"model_tensors[{k!r}]", "is not a dict")
            self.ints(self.typed(info, "shape", list, f"model_tensors[{k!r}]"), f"model_tensors[{k!r}]['shape']")
            self.typed(info, "crc32", int, f"model_tensors[{k!r}]")
        for name, rec in params.items():
            where = f"params[{name!r}]"
            self.need(isinstance(rec, dict), where, "is not a dict")
            self.ints(self.typed(rec, "shape", list, where), where + "['shape']")
            self.typed(rec, "dtype", str, where)
            self.strs(self.typed(rec, "aliases", list, where), where + "['aliases']")
            group = self.typed(rec, "group", (int, type(None)), where)
            self.typed(rec, "step", (*number, type(None)), where)
            rows = self.typed(rec, "chunks", list, where)
            if group is None:
                self.need(name in tensors, where, "is not trained by the optimizer but missing from 'model_tensors'")
                continue
            self.need(0 <= group < len(groups) and name in groups[group]["params"], where + "['group']",
                      f"is {group}, but param group {group} does not list it")
            old = list(BASE_KINDS) if rows else []  # format 1 has no kinds: a frozen parameter has no chunks
            kinds = rec.setdefault("kinds", old) if meta["version"] < 2 else rec.get("kinds")
            self.strs(kinds, where + "['kinds']")
            if not kinds:  # frozen when saved (frozen.py): its weights are a model tensor, it has no state
                self.need(not rows and name in tensors, where, "holds no state kinds, so it must have no chunks "
                          "and its weights in 'model_tensors'")
                continue
            self.need(set(BASE_KINDS) <= set(kinds) and len(set(kinds)) == len(kinds), where + "['kinds']",
                      f"must list {list(BASE_KINDS)} once each")
            for i, row in enumerate(rows):
                self.ints(row, f"{where}['chunks'][{i}]")
                self.need(len(row) == 3 + len(kinds) and row[2] < len(rank_files), f"{where}['chunks'][{i}]",
                          f"must be [start, numel, rank file index < {len(rank_files)}, one crc32 per kind]")
        for gi, g in enumerate(groups):
            for n in g["params"]:
                self.need(n in params and params[n]["group"] == gi, f"param_groups[{gi}]",
                          f"lists {n!r}, which is not a parameter of that group in 'params'")
        self.strs(self.typed(meta, "state_dict_keys", list, "metadata"), "state_dict_keys")
        alias = aliases(meta)
        for k in meta["state_dict_keys"]:
            self.need(k in alias or k in tensors, f"state_dict_keys entry {k!r}", "is neither a parameter nor a buffer")


def _decodes(hyper: dict) -> bool:
    try:
        return isinstance(decode(hyper), dict)
    except Exception:  # noqa: BLE001 - any malformed tag
        return False


def _tuple(types) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def _names(types) -> str:
    return " or ".join("None" if t is type(None) else t.__name__ for t in _tuple(types))


def read_metadata(path: str) -> tuple[dict, str]:
    """The metadata of the checkpoint in folder ``path``, checked, and its sha256."""
    file = os.path.join(path, METADATA)
    with open(file, "rb") as f:
        data = f.read()
    try:
        meta = json.loads(data)
    except ValueError as e:
        raise CheckpointError(f"{file} is not valid JSON ({e}): the checkpoint is corrupted; restore the file or "
                              "load an older tag") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not the metadata of a fused_zero checkpoint (a JSON object with format "
                              f"{FORMAT!r}): check the path, or restore the file")
    version = meta.get("version")
    if type(version) is not int or version < 1:
        raise CheckpointError(f"{file}: 'version' is {version!r}, not a format version: the metadata is malformed; "
                              "restore the file or load an older tag")
    if version > VERSION:
        raise CheckpointError(f"{file} has format version {version}; this fused_zero reads up to {VERSION}: "
                              "upgrade fused_zero")
    if CHECKSUM in meta or version >= 2:
        if meta.get(CHECKSUM) != checksum(meta):
            raise CheckpointError(f"{file} fails its checksum (its content was edited or corrupted, e.g. a step "
                                  "count): restore the file or load an older tag")
    else:
        warnings.warn(f"{file} is a format-{version} checkpoint, whose metadata carries no checksum of its own: "
                      "its files and chunks are still checked, but an edit of the metadata itself would go "
                      "unnoticed; save it again to add one")
    _Schema(file).check(meta)
    for fname, info in meta["files"].items():
        full = os.path.join(path, fname)
        size = os.path.getsize(full) if os.path.isfile(full) else None
        if size != info["bytes"]:
            raise CheckpointError(f"{full} is {'missing' if size is None else f'{size} bytes'}; the metadata says "
                                  f"{info['bytes']} bytes: the checkpoint is incomplete or corrupted; restore the "
                                  "file or load an older tag")
    for name, rec in meta["params"].items():
        if rec["group"] is not None and rec["kinds"]:  # (no kinds: frozen when saved, a model tensor)
            try:
                check_tiling(name, [Chunk.parse(c) for c in rec["chunks"]], numel_of(rec["shape"]))
            except CheckpointError as e:
                raise CheckpointError(f"{file}: {e}") from None
    return meta, hashlib.sha256(data).hexdigest()


# -- the fit to a model --------------------------------------------------------------------------

def describe_mismatch(what: str, expected: Mapping[str, tuple], found: Mapping[str, tuple]) -> list[str]:
    """Lines naming the missing, unexpected and mis-shaped entries of ``found`` against ``expected``."""
    missing = [n for n in expected if n not in found]
    extra = [n for n in found if n not in expected]
    shaped = [f"{n} (checkpoint {list(found[n])}, model {list(expected[n])})"
              for n in expected if n in found and tuple(found[n]) != tuple(expected[n])]
    lines = []
    if missing:
        lines.append(f"{what} of the model missing from the checkpoint: {', '.join(missing)}")
    if extra:
        lines.append(f"{what} in the checkpoint that the model does not have: {', '.join(extra)}")
    if shaped:
        lines.append(f"{what} with another shape: {', '.join(shaped)}")
    return lines


def check_match(view: ModelView, meta: dict, path: str) -> None:
    """ValueError naming every way the checkpoint does not fit the model and the optimizer's groups."""
    saved = {n: tuple(rec["shape"]) for name, rec in meta["params"].items() for n in [name, *rec["aliases"]]}
    saved.update({k: tuple(v["shape"]) for k, v in meta["model_tensors"].items() if k not in meta["params"]})
    lines = describe_mismatch("parameters and buffers", view.expected(), saved)
    if lines:
        raise ValueError(f"{path} was saved from another model: " + "; ".join(lines))
    if len(meta["param_groups"]) != len(view.groups):
        raise ValueError(f"{path} has {len(meta['param_groups'])} param groups, the optimizer has "
                         f"{len(view.groups)}: build the optimizer with the param groups it was saved with")
    alias, moved = aliases(meta), []
    for p in view.params.values():
        n = view.name(p)
        rec, now = meta["params"][alias[n]], view.group_of.get(n)
        # A parameter saved without optimizer state (frozen then) carries nothing of its group: it may sit in any
        # group now, or none (peft's and Trainer's trainable-only groups leave frozen weights out, stage 3's
        # ShardedOptimizer(model) puts them in group 0), and starts its state afresh if it trains now.
        # One trained when saved keeps its group (to none: the "frozen now" refusal below)
        if rec["group"] != now and rec["chunks"] and now is not None:
            moved.append(f"{n} (checkpoint group {rec['group']}, optimizer group {now})")
    if moved:
        raise ValueError(f"{path}: parameters sit in other param groups than when saved: {', '.join(moved)}; "
                         "build the optimizer with the same groups (None: not trained by the optimizer)")
    thawed = [view.name(p) for pid, p in view.params.items() if pid not in view.where
              and meta["params"][alias[view.name(p)]]["chunks"]]
    if thawed:
        raise ValueError(f"{path}: {thawed[:3]}{' and more' if len(thawed) > 3 else ''} were trained when saved "
                         "and are frozen (requires_grad=False) in this optimizer, which keeps no state for them: "
                         "load with them trainable, then freeze them and build a new optimizer")
    for pid, p in view.params.items():
        if pid in view.where:
            n = view.name(p)
            check_kinds(meta["params"][alias[n]]["kinds"], view.kinds(p), f"{path}: parameter {n!r}",
                        view.group_of[n])


def check_kinds(saved, mine, what: str, group: int, flagged: bool = False) -> None:
    """A saved state kind the optimizer's shard lacks is an error naming the option that adds it. ``flagged``:
    ``saved`` are the kinds ``what`` (a saved param group) asks for by its options (amsgrad=True), which its
    states need not hold, rather than kinds its states hold."""
    lacking = [k for k in saved if k not in mine]
    if lacking:
        options = ", ".join(OPTION_OF_KIND.get(k, f"the option that keeps {k}") for k in lacking)
        has = f"sets {options}, which needs" if flagged else "has"
        raise ValueError(f"{what} {has} optimizer state {lacking} that this optimizer does not keep: build param "
                         f"group {group} with {options}")
