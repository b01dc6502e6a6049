"""What a checkpoint holds and how it maps onto a model and a ShardedOptimizer.

No files and no collectives here (fused_zero.checkpoint does both; its docstring
describes the files): names, the metadata, the JSON codec, the range math that reshards
saved chunks into any rank's shard pieces, the checks that a checkpoint fits a model, and
the conversions to and from torch.optim.AdamW's state_dict format.
"""
from __future__ import annotations

import bisect
import io
import json
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

FORMAT = "fused_zero.checkpoint"
VERSION = 1
METADATA = "metadata.json"
LATEST = "latest"
MODEL_FILE = "model.safetensors"  # rank 0's persistent buffers and parameters the optimizer does not train
TMP_PREFIX = ".tmp-"  # a save in progress (or one that died): never loaded
OLD_PREFIX = ".old-"  # a tag being overwritten, kept until its replacement is in place
KINDS = ("master", "exp_avg", "exp_avg_sq")
DEFAULT_CHUNK_NUMEL = 1 << 22  # 16 MiB of fp32: the unit of reading and of crc32 checks
# torch.optim.AdamW group keys that say how torch runs, not what the hyperparameters are
TORCH_ONLY = ("amsgrad", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay")


class CheckpointError(RuntimeError):
    """A checkpoint on disk is missing, incomplete or corrupted."""


def rank_file(rank: int, world_size: int) -> str:
    return f"shards-rank{rank:05d}-of-{world_size:05d}.safetensors"


def tensor_key(name: str, kind: str, start: int) -> str:
    """Key of one saved chunk: elements [start, start + numel) of parameter ``name``'s ``kind``."""
    return f"{name}:{kind}:{start}"


def check_tag(tag: Any) -> str:
    if not isinstance(tag, str):
        raise TypeError(f"tag must be a str (a directory name), got {type(tag).__name__}")
    if (not tag or tag in (".", "..", LATEST) or tag.startswith(".") or any(c in tag for c in "/\\\0")
            or tag.strip() != tag):
        raise ValueError(f"tag {tag!r} cannot name a checkpoint directory: use a plain name such as 'step100' "
                         f"(no path separators, no leading '.', not {LATEST!r})")
    return tag


def crc32(t: torch.Tensor) -> int:
    """crc32 of a CPU tensor's bytes (any dtype, bf16 included)."""
    flat = t.detach().contiguous().reshape(-1)
    return zlib.crc32(memoryview(flat.view(torch.uint8).numpy())) if flat.numel() else 0


def numel_of(shape: Sequence[int]) -> int:
    return math.prod(shape)


def chunks(start: int, numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """Split the run [start, start + numel) into (start, numel) pieces of at most ``chunk_numel``."""
    return [(s, min(chunk_numel, start + numel - s)) for s in range(start, start + numel, chunk_numel)]


class Chunk(NamedTuple):
    """One saved chunk of a parameter: elements [start, start + numel), in rank file ``file``."""

    start: int
    numel: int
    file: int
    crcs: tuple[int, int, int]  # crc32 of master, exp_avg, exp_avg_sq

    @classmethod
    def parse(cls, row: Sequence[int]) -> Chunk:  # metadata row: [start, numel, file, crc x3]
        return cls(row[0], row[1], row[2], tuple(row[3:6]))


def check_tiling(name: str, saved: Sequence[Chunk], numel: int) -> None:
    """The chunks (sorted by start) must cover [0, numel) exactly once."""
    end = 0
    for c in saved:
        if c.start != end or c.numel <= 0:
            raise CheckpointError(f"the saved chunks of parameter {name!r} {'overlap' if c.start < end else 'leave a gap'}"
                                  f" at element {min(end, c.start)} of {numel}: metadata.json is inconsistent")
        end = c.start + c.numel
    if end != numel:
        raise CheckpointError(f"the checkpoint holds elements [0, {end}) of parameter {name!r}, which has "
                              f"{numel}: metadata.json is inconsistent")


def overlapping(saved: Sequence[Chunk], starts: Sequence[int], lo: int, hi: int) -> list[tuple[Chunk, int, int]]:
    """(chunk, a, b) for every saved chunk meeting [lo, hi), [a, b) the intersection.

    ``saved`` tiles the parameter in order; ``starts`` are their start offsets.
    """
    out = []
    k = max(bisect.bisect_right(starts, lo) - 1, 0)
    while k < len(saved) and saved[k].start < hi:
        c = saved[k]
        a, b = max(lo, c.start), min(hi, c.start + c.numel)
        if a < b:
            out.append((c, a, b))
        k += 1
    return out


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


# -- a JSON codec for what optimizers and schedulers hold ------------------------------------------

class NotJSON(TypeError):
    """The value holds something the JSON codec does not represent exactly."""


_TENSOR_JSON_MAX = 64  # larger tensors go to a weights_only torch file instead


def encode(obj: Any) -> Any:
    """A JSON-able form of ``obj``: tuples, small tensors, inf/nan and non-str dict keys are tagged."""
    if obj is None or isinstance(obj, (bool, str, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v) for v in obj]}
    if isinstance(obj, list):
        return [encode(v) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode(v) for k, v in obj.items()}
        return {"__dict__": [[encode(k), encode(v)] for k, v in obj.items()]}
    if (isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.numel() <= _TENSOR_JSON_MAX
            and obj.layout == torch.strided and not obj.is_complex() and not obj.requires_grad):
        return {"__tensor__": encode(obj.tolist()), "dtype": str(obj.dtype).removeprefix("torch."),
                "shape": list(obj.shape)}
    raise NotJSON(f"{type(obj).__name__} is not represented in JSON")


def decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__float__" in obj:
        return float(obj["__float__"])
    if "__tuple__" in obj:
        return tuple(decode(v) for v in obj["__tuple__"])
    if "__dict__" in obj:
        return {_hashable(decode(k)): decode(v) for k, v in obj["__dict__"]}
    if "__tensor__" in obj:
        return torch.tensor(decode(obj["__tensor__"]), dtype=getattr(torch, obj["dtype"])).reshape(obj["shape"])
    return {k: decode(v) for k, v in obj.items()}


def _hashable(k: Any) -> Any:
    return tuple(_hashable(v) for v in k) if isinstance(k, list) else k


def json_ok(obj: Any) -> bool:
    """Whether ``encode`` represents ``obj`` (so that ``decode(encode(obj))`` rebuilds it)."""
    try:
        encode(obj)
    except NotJSON:
        return False
    return True


def to_blob(obj: Any, stem: str, what: str) -> tuple[str, bytes]:
    """(file name, bytes): ``obj`` as JSON, or else a torch file that torch.load(weights_only=True) reads."""
    if json_ok(obj):
        return stem + ".json", json.dumps(encode(obj)).encode()
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:
        raise TypeError(f"{what} holds objects that neither JSON nor torch.load(weights_only=True) can restore "
                        f"({str(e).splitlines()[0]}); keep it to tensors, numbers, strings, lists, tuples and dicts"
                        ) from None
    return stem + ".pt", buf.getvalue()


def from_blob(name: str, data: bytes) -> Any:
    return decode(json.loads(data)) if name.endswith(".json") else torch.load(io.BytesIO(data), weights_only=True)


def group_hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters: everything but its parameters."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


# -- the model and optimizer as a checkpoint sees them ----------------------------------------------

class ModelView:
    """Names, shapes and places of the parameters and buffers of (model, ShardedOptimizer)."""

    def __init__(self, model: nn.Module, opt) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be the torch.nn.Module being trained, got {type(model).__name__}")
        self.names: dict[int, list[str]] = {}  # id(param) -> its state-dict keys; the first is its name
        self.params: dict[int, nn.Parameter] = {}
        self.buffers: dict[str, torch.Tensor] = {}  # persistent buffers by state-dict key
        self.keys: list[str] = []  # model.state_dict()'s keys, in its order
        for prefix, mod in model.named_modules(remove_duplicate=False):
            if type(mod).get_extra_state is not nn.Module.get_extra_state:
                raise TypeError(f"module {prefix or type(mod).__name__!r} defines get_extra_state(), which "
                                "fused_zero.checkpoint does not save: pass that state as extra=")
            pre = prefix + "." if prefix else ""
            for n, p in mod._parameters.items():
                if p is not None:
                    self.keys.append(pre + n)
                    self.names.setdefault(id(p), []).append(pre + n)
                    self.params[id(p)] = p
            for n, b in mod._buffers.items():
                if b is not None and n not in mod._non_persistent_buffers_set:
                    self.keys.append(pre + n)
                    self.buffers[pre + n] = b
        self.opt = opt
        self.index = opt.shard_index()
        self.where = {id(p): (k, i) for k, part in enumerate(self.index) for i, p in enumerate(part.params)}
        # Stage 3 releases parameters outside forward (0-element placeholders): take their
        # shapes from the partitions, never from the tensors.
        self.shapes = {k: list(part.shapes) for k, part in enumerate(self.index)}
        self.groups: list[list[str]] = []  # names per param group, in group order
        for gi, group in enumerate(opt.param_groups):
            for p in group["params"]:
                if id(p) not in self.names:
                    raise ValueError(f"param group {gi} holds a parameter of shape {tuple(p.shape)} that is not "
                                     "in model.named_parameters(); pass the model this optimizer trains")
            self.groups.append([self.names[id(p)][0] for p in group["params"]])
        self.group_of = {n: gi for gi, names in enumerate(self.groups) for n in names}

    def name(self, p) -> str:
        return self.names[id(p)][0]

    def shape(self, p) -> tuple[int, ...]:
        if id(p) not in self.where:
            return tuple(p.shape)
        k, i = self.where[id(p)]
        return tuple(self.shapes[k][i])

    def expected(self) -> dict[str, tuple]:
        """state-dict key -> shape, for every parameter (aliases too) and persistent buffer."""
        out = {n: self.shape(p) for pid, p in self.params.items() for n in self.names[pid]}
        out.update({k: tuple(b.shape) for k, b in self.buffers.items()})
        return {k: out[k] for k in self.keys}

    def unmanaged(self) -> dict[str, nn.Parameter]:
        """Model parameters the optimizer does not hold, by name."""
        return {self.name(p): p for pid, p in self.params.items() if pid not in self.where}


# -- save ---------------------------------------------------------------------------------------

def shard_tensors(view: ModelView, chunk_numel: int) -> tuple[dict[str, torch.Tensor], list[list]]:
    """This rank's chunks as ({key: CPU tensor}, [[name, start, numel, crc x3], ...])."""
    tensors, table = {}, []
    for k, part in enumerate(view.index):
        for piece in part.pieces:
            name = view.name(part.params[piece.param_index])
            for start, n in chunks(piece.param_offset, piece.numel, chunk_numel):
                lo = piece.shard_offset + start - piece.param_offset
                row = [name, start, n]
                for kind in KINDS:
                    t = view.opt.read_shard(k, kind, lo, lo + n)
                    tensors[tensor_key(name, kind, start)] = t
                    row.append(crc32(t))
                table.append(row)
    return tensors, table


def build_metadata(view: ModelView, tag: str, written: list, files_of: dict) -> dict:
    """metadata.json from every rank's ``(files, chunk table, model tensor info or None)``."""
    opt = view.opt
    params = {}
    for pid, p in view.params.items():
        name = view.name(p)
        step = opt.state.get(p, {}).get("step") if pid in view.where else None
        params[name] = {"shape": list(view.shape(p)), "dtype": str(p.dtype).removeprefix("torch."),
                        "aliases": view.names[pid][1:], "group": view.group_of.get(name),
                        "step": None if step is None else float(step), "chunks": []}
    files, model_tensors = {}, {}
    for rank, (rank_files, table, info) in enumerate(written):
        files.update(rank_files)
        model_tensors.update(info or {})
        for name, start, n, *crcs in table:
            params[name]["chunks"].append([start, n, rank, *crcs])
    for rec in params.values():
        rec["chunks"].sort()
    cfg, ws = opt.config, opt.comm.world_size
    return {
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
    }


# -- load ---------------------------------------------------------------------------------------

def aliases(meta: dict) -> dict[str, str]:
    """Every state-dict key of a saved parameter -> its name in the checkpoint."""
    return {n: name for name, rec in meta["params"].items() for n in [name, *rec["aliases"]]}


def check_metadata(meta: dict) -> None:
    for name, rec in meta["params"].items():
        if rec["group"] is not None:
            check_tiling(name, [Chunk.parse(c) for c in rec["chunks"]], numel_of(rec["shape"]))


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
        was = meta["params"][alias[n]]["group"]
        if was != view.group_of.get(n):
            moved.append(f"{n} (checkpoint group {was}, optimizer group {view.group_of.get(n)})")
    if moved:
        raise ValueError(f"{path}: parameters sit in other param groups than when saved: {', '.join(moved)}; "
                         "build the optimizer with the same groups (None: not trained by the optimizer)")


def reshard(view: ModelView, meta: dict, read_chunk: Callable[[str, Chunk], list]) -> list[list[torch.Tensor]]:
    """New (master, exp_avg, exp_avg_sq) of every partition of this rank, from the saved chunks.

    ``read_chunk(name, chunk)`` returns the chunk's three tensors; each chunk is read once per
    parameter however many of this rank's pieces it meets. Padding stays zero.
    """
    staged = [[torch.zeros(part.shard_numel) for _ in KINDS] for part in view.index]
    wants: dict[str, list] = {}
    for k, part in enumerate(view.index):
        for piece in part.pieces:
            wants.setdefault(view.name(part.params[piece.param_index]), []).append((k, piece))
    alias = aliases(meta)
    for mine, pieces in wants.items():
        name = alias[mine]
        saved = [Chunk.parse(c) for c in meta["params"][name]["chunks"]]
        starts = [c.start for c in saved]
        cache: dict[int, list[torch.Tensor]] = {}
        for k, piece in pieces:
            lo = piece.param_offset
            for c, a, b in overlapping(saved, starts, lo, lo + piece.numel):
                if c.start not in cache:
                    cache[c.start] = read_chunk(name, c)
                at = piece.shard_offset + a - lo
                for dst, src in zip(staged[k], cache[c.start]):
                    dst[at:at + b - a] = src[a - c.start:b - c.start]
    return staged


# -- torch.optim.AdamW's format -------------------------------------------------------------------

def adamw_state_dict(meta: dict, moments: Mapping[str, Sequence[torch.Tensor]]) -> dict:
    """torch.optim.AdamW's state_dict of a checkpoint; ``moments[name]`` = (exp_avg, exp_avg_sq)."""
    index: dict[str, int] = {}
    for g in meta["param_groups"]:
        for n in g["params"]:
            index[n] = len(index)
    state = {index[n]: {"step": torch.tensor(float(meta["params"][n]["step"])), "exp_avg": moments[n][0],
                        "exp_avg_sq": moments[n][1]}
             for n in index if meta["params"][n]["step"] is not None}
    defaults = group_hyper(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).param_groups[0])
    if "decoupled_weight_decay" in defaults:  # torch >= 2.6: AdamW is Adam with this flag
        defaults["decoupled_weight_decay"] = meta["config"]["adam_w_mode"]
    groups = [{**defaults, **decode(g["hyper"]), "params": [index[n] for n in g["params"]]}
              for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def from_torch(view: ModelView, optim_sd: dict, model_sd: dict | None) -> tuple[list, dict, list]:
    """(staged shards, steps by name, hyperparameters per group) from a torch AdamW state_dict.

    Without ``model_sd`` the staged masters are None (keep the optimizer's).
    """
    opt = view.opt
    if not (isinstance(optim_sd, dict) and {"state", "param_groups"} <= optim_sd.keys()):
        raise TypeError("optim_state_dict must be a torch optimizer's state_dict(): a dict with 'state' and "
                        "'param_groups'")
    saved = optim_sd["param_groups"]
    if len(saved) != len(view.groups):
        raise ValueError(f"the state dict has {len(saved)} param groups, the optimizer has {len(view.groups)}: "
                         "build the ShardedOptimizer with the torch optimizer's param groups")
    for gi, (g, names) in enumerate(zip(saved, view.groups)):
        if len(g["params"]) != len(names):
            raise ValueError(f"param group {gi} has {len(g['params'])} parameters in the state dict and "
                             f"{len(names)} in the optimizer: build it with the torch optimizer's param groups")
        if g.get("amsgrad"):
            raise ValueError(f"param group {gi} uses amsgrad, which ShardedOptimizer does not implement")
        dwd = g.get("decoupled_weight_decay")
        if dwd is not None and bool(dwd) != opt.config.adam_w_mode:
            raise ValueError(f"param group {gi} was saved with decoupled_weight_decay={dwd}: build the "
                             f"ShardedOptimizer with adam_w_mode={bool(dwd)}")
    ids = [i for g in saved for i in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    states = {p: optim_sd["state"].get(i, optim_sd["state"].get(str(i), {})) for i, p in zip(ids, params)}
    bad = [f"{view.name(p)} ({k} {list(s[k].shape)}, parameter {list(view.shape(p))})"
           for p, s in states.items() for k in ("exp_avg", "exp_avg_sq") if k in s and tuple(s[k].shape) != view.shape(p)]
    if bad:
        raise ValueError(f"the optimizer state does not fit the parameters: {', '.join(bad)}; pass the state dict "
                         "of an optimizer over this model, with the same param groups")
    if any("max_exp_avg_sq" in s for s in states.values()):
        raise ValueError("the state dict holds amsgrad state (max_exp_avg_sq), which ShardedOptimizer does not "
                         "implement")
    if model_sd is not None:
        lines = describe_mismatch("parameters and buffers", view.expected(),
                                  {k: tuple(v.shape) for k, v in model_sd.items()})
        if lines:
            raise ValueError("model_state_dict does not fit the model: " + "; ".join(lines))
    staged = []
    for part in opt.shard_index():
        n = part.shard_numel
        new = [None if model_sd is None else torch.zeros(n), torch.zeros(n), torch.zeros(n)]
        for piece in part.pieces:
            p = part.params[piece.param_index]
            lo, at = piece.param_offset, piece.shard_offset
            sources = [None if model_sd is None else model_sd[view.name(p)], states[p].get("exp_avg"),
                       states[p].get("exp_avg_sq")]
            for dst, src in zip(new, sources):
                if dst is not None and src is not None:
                    dst[at:at + piece.numel] = src.detach().reshape(-1)[lo:lo + piece.numel].float().cpu()
        staged.append(new)
    steps = {view.name(p): float(s["step"]) if "step" in s else None for p, s in states.items()}
    hypers = [{k: v for k, v in group_hyper(g).items() if k not in TORCH_ONLY} for g in saved]
    return staged, steps, hypers

