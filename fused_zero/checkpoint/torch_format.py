"""torch.optim.AdamW's state_dict format <-> shards: consolidation of a checkpoint into it, the
checks of one against a ShardedOptimizer (torch's wording), slicing full tensors into this rank's
shard pieces, and load_torch_state."""
from __future__ import annotations


from collections.abc import Callable, Mapping

import torch
from torch import nn

from . import files
from .codec import decode
from .metadata import check_kinds, describe_mismatch, read_metadata
from .save_load import agree, comm_of, commit
from .shards import full_tensors, unblob
from .view import BASE_KINDS, OPTION_OF_KIND, ModelView, group_hyper
from ..state_views import check_step_count

# torch.optim.AdamW group keys that say how torch runs, not what the hyperparameters are
TORCH_ONLY = ("amsgrad", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay")
REQUIRED = ("lr", "betas", "eps", "weight_decay")  # hyperparameters every saved group must carry
# what torch.optim.Adam's __setstate__ gives a loaded group that lacks the key (an older torch's state dict: torch's
# test_can_load_older_state_dict): the loaded group replaces the optimizer's, so the optimizer's value is not kept
SETSTATE_DEFAULTS = {"amsgrad": False, "maximize": False, "foreach": None, "differentiable": False, "fused": None}


def torch_param_groups(hypers, members, adam_w_mode: bool) -> list[dict]:
    """param_groups as torch.optim.AdamW(groups).state_dict() has them: each group's own keys in its order (as
    torch packs a group), then torch's defaults it lacks, then "params"."""
    defaults = group_hyper(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).param_groups[0])
    if "decoupled_weight_decay" in defaults:  # torch >= 2.6: AdamW is Adam with this flag
        defaults["decoupled_weight_decay"] = adam_w_mode
    return [{**hyper, **{k: v for k, v in defaults.items() if k not in hyper}, "params": list(ids)}
            for hyper, ids in zip(hypers, members)]


def adamw_state_dict(meta: dict, moments: Mapping[str, Mapping[str, torch.Tensor]], extra: dict | None = None) -> dict:
    """torch.optim.AdamW's state_dict of a checkpoint; ``moments[name]``: its saved kinds but master. ``extra``:
    what ``optimizer.state`` held beyond steps and moments (``save_load.state_extras``), kept as torch's
    ``state_dict()`` keeps it: a parameter's own keys in its entry, other keys after the parameters'."""
    index: dict[str, int] = {}
    for g in meta["param_groups"]:
        for n in g["params"]:
            index[n] = len(index)
    state = {index[n]: {"step": torch.tensor(float(meta["params"][n]["step"]), dtype=torch.float32), **moments[n]}
             for n in index if meta["params"][n]["step"] is not None}
    if extra:
        for n, own in extra.get("params", {}).items():
            if n in index:
                state.setdefault(index[n], {}).update(own)
        state = {i: state[i] for i in sorted(state)}  # (param_groups order, as torch's)
        for key, value in extra.get("state", []):
            state[key] = value
    groups = torch_param_groups([decode(g["hyper"]) for g in meta["param_groups"]],
                                [[index[n] for n in g["params"]] for g in meta["param_groups"]],
                                meta["config"]["adam_w_mode"])
    return {"state": state, "param_groups": groups}


def shapes_of(index) -> dict[int, tuple]:
    """id(param) -> its shape, for every parameter the shards hold (stage 3 ones released too)."""
    return {id(p): tuple(s) for part in index for p, s in zip(part.params, part.shapes)}


def check_torch_state(opt, sd, name_of: Callable = None) -> tuple[dict, list[dict]]:
    """({param: its saved state}, hyperparameters per group) of torch optimizer state_dict ``sd``.

    Raises what torch.optim.Optimizer.load_state_dict raises, in its words where it has them,
    and names every state that does not fit its parameter's shape or this optimizer's options.
    """
    if isinstance(sd, Mapping) and "fused_zero" in sd:
        raise ValueError("this state dict is the per-rank shard format of earlier fused_zero versions (a "
                         "'fused_zero' entry), which is no longer loaded: save with optimizer.state_dict() called on "
                         "every rank (torch.optim.AdamW's format), or use fused_zero.checkpoint.save/load")
    if not (isinstance(sd, Mapping) and isinstance(sd.get("state"), Mapping)
            and isinstance(sd.get("param_groups"), (list, tuple))):
        raise TypeError("the state dict must be a torch optimizer's state_dict(): a dict with 'state' (a dict) and "
                        "'param_groups' (a list)")
    index = opt.shard_index()
    shapes = shapes_of(index)  # (stage 3's released parameters are 0-element placeholders: never p.shape)
    names = getattr(opt, "_names", {})
    name_of = name_of or (lambda p: repr(names[p]) if p in names else f"of shape {shapes.get(id(p), tuple(p.shape))}")
    saved, groups = sd["param_groups"], opt.param_groups
    if len(saved) != len(groups):
        raise ValueError("loaded state dict has a different number of parameter groups "
                         f"({len(saved)}, the optimizer has {len(groups)})")
    for gi, (g, mine) in enumerate(zip(saved, groups)):
        if not isinstance(g, Mapping) or not isinstance(g.get("params"), (list, tuple)):
            raise TypeError(f"param group {gi} of the state dict is not a dict with a 'params' list")
        if len(g["params"]) != len(mine["params"]):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                             f"optimizer's group (group {gi}: {len(g['params'])} parameters, the optimizer's has "
                             f"{len(mine['params'])})")
        missing = [k for k in REQUIRED if k not in g]
        if missing:
            raise ValueError(f"param group {gi} of the state dict lacks the hyperparameters {missing}: pass an "
                             "AdamW state_dict()")
    kinds = {id(p): part.kinds for part in index for p in part.params}
    states, bad = {}, []
    for gi, g in enumerate(saved):
        if g.get("amsgrad") and not all("max_exp_avg_sq" in kinds.get(id(p), ("max_exp_avg_sq",))
                                      for p in groups[gi]["params"]):
            check_kinds(["max_exp_avg_sq"], (), f"param group {gi} of the state dict", gi, flagged=True)
    for gi, (g, mine) in enumerate(zip(saved, groups)):
        for i, p in zip(g["params"], mine["params"]):
            s = saved_state(sd, i)
            if not isinstance(s, Mapping):
                raise TypeError(f"state {i} of the state dict is a {type(s).__name__}, not a dict")
            if id(p) not in kinds:  # frozen when this optimizer was built (frozen.py): kept whole (optim_state.py)
                continue
            states[p] = s
            what = f"state {i} (parameter {name_of(p)})"
            check_kinds([k for k in s if k in OPTION_OF_KIND], kinds[id(p)], what, gi)
            held = [k for k in s if k in (*BASE_KINDS, *OPTION_OF_KIND)]
            if held and "step" not in s:  # torch fails at the next step (KeyError: 'step')
                raise ValueError(f"{what} holds {held} but no 'step': a moment means nothing without the step count "
                                 "it was built over (Adam's bias correction); pass a state dict whose states each "
                                 "carry 'step', or leave the parameter's state out to start it fresh")
            moments = [k for k in ("exp_avg", "exp_avg_sq") if k in s]
            if len(moments) == 1:  # torch fails at the next step (KeyError)
                raise ValueError(f"{what} holds {moments[0]!r} without its other moment: pass a state dict whose "
                                 "states carry both exp_avg and exp_avg_sq (or leave the parameter's state out to "
                                 "start it fresh)")
            if not moments and "step" in s:  # torch fails at the next step (KeyError: 'exp_avg')
                raise ValueError(
                    f"{what} holds 'step' but no moments (exp_avg, exp_avg_sq). torch.distributed.checkpoint's "
                    "flatten_optimizer_state_dict=True writes such states when the optimizer it loads into keeps "
                    "its states in files (offload_optimizer='nvme': optimizer.state[p] holds 'step' only, and DCP "
                    "rebuilds each state from those keys): load with flatten_optimizer_state_dict=False, or with "
                    "fused_zero.checkpoint. Otherwise pass states carrying both moments, or leave the parameter's "
                    "state out to start it fresh")
            check_step_count(s.get("step", 0.0), what)  # (a state dict's step: a host tensor)
            for k, t in s.items():
                if k in (*BASE_KINDS, *OPTION_OF_KIND) and (not isinstance(t, torch.Tensor)
                                                            or tuple(t.shape) != shapes[id(p)]):
                    bad.append(f"state {i} {k} {list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__} "
                               f"(parameter {name_of(p)}, shape {list(shapes[id(p)])})")
    if bad:
        raise ValueError(f"the optimizer state does not fit the parameters: {', '.join(bad)}; pass the state dict "
                         "of an optimizer over this model, with the same param groups in the same order")
    hypers = [{**{k: v for k, v in SETSTATE_DEFAULTS.items() if k not in g and k in mine},
               **{k: v for k, v in group_hyper(g).items() if _takes(k, mine)}} for g, mine in zip(saved, groups)]
    return states, hypers


def saved_state(sd, i) -> object:
    """State ``i`` of torch state dict ``sd`` ({} where it has none; its key may be a string: through JSON)."""
    return sd["state"].get(i, sd["state"].get(str(i), {}))


def _takes(key: str, group: Mapping) -> bool:
    """Whether loading a saved group's ``key`` replaces the optimizer's group's value, as torch's load does.

    torch.optim.AdamW keeps decoupled_weight_decay=True whatever it loads (its ``__setstate__`` forces it): an
    AdamW group stays AdamW, also when a torch.optim.Adam state dict is loaded; an Adam group (built with
    decoupled_weight_decay=False) takes the saved value, as torch.optim.Adam does. The other flags of how torch
    runs are taken where the group holds them (torch takes every saved key), except ``capturable``: whether the
    step replays as a CUDA graph is the optimizer's own setting (step_graph.py)."""
    if key == "decoupled_weight_decay":
        return group.get(key) is False
    if key == "capturable":  # how this optimizer runs (a CUDA graph or not), set when it was built: kept
        return False
    return key not in TORCH_ONLY or key in group


def slice_into_shards(index, kinds: Callable[[object], tuple], source: Callable) -> list[dict]:
    """One {kind: new shard tensor} per partition; ``kinds(part)`` are written, the rest kept (None).

    ``source(k, piece, param, kind)`` gives the 1-D fp32 values of the piece's elements, or None
    for zeros.
    """
    staged = []
    for k, part in enumerate(index):
        written = kinds(part)
        new = {kind: torch.zeros(part.shard_numel, dtype=torch.float32) if kind in written else None
               for kind in part.kinds}
        for piece in part.pieces:
            p, at = part.params[piece.param_index], piece.shard_offset
            for kind in written:
                src = source(k, piece, p, kind)
                if src is not None:
                    new[kind][at:at + piece.numel] = src
        staged.append(new)
    return staged


def piece_of(full: torch.Tensor, piece) -> torch.Tensor:
    """The elements of ``piece`` in full tensor ``full``, fp32 on the CPU."""
    lo = piece.param_offset
    return full.detach().reshape(-1)[lo:lo + piece.numel].to("cpu", torch.float32)


def consolidate(directory, tag: str | None = None) -> tuple[dict, dict]:
    """(the model's state_dict with fp32 parameters, a torch.optim.AdamW state_dict), in one process.

    Parameters come from the fp32 masters (whatever the model's dtype), buffers as saved, keys in
    model.state_dict() order; the optimizer state numbers parameters in param_groups order, as
    ``torch.optim.AdamW(groups).state_dict()`` does. Checks every chunk's crc32 and file's sha256.
    """
    path = files.resolve(directory, tag)
    meta, _ = read_metadata(path)
    model_sd, full = full_tensors(path, meta, kinds=None)
    moments = {n: {k: v for k, v in t.items() if k != "master"} for n, t in full.items()}
    return model_sd, adamw_state_dict(meta, moments, unblob(path, meta, meta.get("optim_extra")))


def load_torch_state(model: nn.Module, optimizer, optim_state_dict: dict, model_state_dict: dict | None = None) -> None:
    """Load a ``torch.optim.AdamW`` state_dict (and optionally the model's) into a ShardedOptimizer.

    The optimizer must have the torch optimizer's param groups, in the same order. Without
    ``model_state_dict`` the weights stay those the optimizer holds (the model's when it was built,
    or after its last step); with it, the fp32 masters, buffers and untrained parameters come from
    it at full precision. Every rank calls it with the same state dicts.
    """
    comm = comm_of(optimizer)

    def prepare():
        view = ModelView(model, optimizer)
        states, hypers = check_torch_state(optimizer, optim_state_dict, view.name)
        if model_state_dict is not None:
            lines = describe_mismatch("parameters and buffers", view.expected(),
                                      {k: tuple(v.shape) for k, v in model_state_dict.items()})
            if lines:
                raise ValueError("model_state_dict does not fit the model: " + "; ".join(lines))

        def source(k, piece, p, kind):
            full = model_state_dict[view.name(p)] if kind == "master" else states[p].get(kind)
            return None if full is None else piece_of(full, piece)

        written = (lambda part: part.kinds) if model_state_dict is not None else \
            (lambda part: tuple(k for k in part.kinds if k != "master"))
        staged = slice_into_shards(view.index, written, source)
        steps = {view.name(p): float(s["step"]) if "step" in s else None for p, s in states.items()}
        names = [*view.buffers, *view.unmanaged()]
        if model_state_dict is None:
            tensors = {**view.buffers, **{n: p.detach() for n, p in view.unmanaged().items()}}
        else:
            tensors = {k: model_state_dict[k] for k in names}
        return view, staged, steps, hypers, tensors

    (view, staged, steps, hypers, tensors), _ = agree(comm, prepare)
    commit(view, staged, steps, hypers, tensors)
