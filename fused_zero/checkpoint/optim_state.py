"""ShardedOptimizer.state_dict() and load_state_dict() in torch.optim.AdamW's own format.

state_dict() is collective (every rank calls it, as FSDP's optim_state_dict): each partition's
shards are all-gathered chunk by chunk into full-shape CPU tensors, identical on every rank.
load_state_dict(sd) is collective too: every rank checks the same dict (one Comm.agree, so a bad
one raises on every rank before any other collective), slices its own shard pieces out of the full
tensors, and leaves the parameters as they are (masters come from them, or from a saved fp32
"master" that rounds to them).
"""
from __future__ import annotations

import bisect

import torch

from ..host_read import host_copy
from ..state_views import OWN_KEYS
from .errors import CheckpointError
from .reshard import numel_of
from .torch_format import check_torch_state, piece_of, saved_state, shapes_of, slice_into_shards, torch_param_groups

GATHER_NUMEL = 1 << 20  # shard elements per all-gather: world_size x 4 MiB of fp32 in flight
#: optimizer.state keys the shards hold (gathered, or sliced back in); any other key is user state


def _saves_master(p) -> bool:
    """The fp32 master says more than the parameter itself (bf16, fp16)."""
    return p.dtype != torch.float32


def _device(opt) -> torch.device:
    """Where the collectives want their tensors: the parameters' device on NCCL, else the CPU."""
    if opt.comm.backend == "nccl":
        return opt.param_groups[0]["params"][0].device
    return torch.device("cpu")


def gather_state_dict(opt, comm, keep: bool = True) -> dict | None:
    """The full optimizer state as ``torch.optim.AdamW(same groups).state_dict()`` has it, gathered on ``comm``.

    ``keep=False`` takes part in the collectives only (a rank serving a peer's lone call, from
    inside a wait for reductions in flight): nothing is kept, and nothing waits for those reductions.
    """
    index = opt.shard_index()
    params = [p for g in opt.param_groups for p in g["params"]]
    number: dict[int, int] = {}  # a parameter listed twice keeps its first number, as torch's state_dict
    for i, p in enumerate(params):  # (param_groups extended by hand: torch's test_state_dict_deterministic)
        number.setdefault(id(p), i)
    shapes = shapes_of(index)
    mine = [(part.shard_numel, [tuple(pc) for pc in part.pieces]) for part in index]
    tables = comm.all_gather_object(mine)
    if any(len(t) != len(mine) or [n for n, _ in t] != [n for n, _ in mine] for t in tables):
        raise RuntimeError("ranks hold different partitions: build the optimizer identically on every rank")
    full: dict[int, dict[str, torch.Tensor]] = {}
    device = _device(opt)
    for k, part in enumerate(index):
        n, pieces = part.shard_numel, [t[k][1] for t in tables]
        for kind in part.kinds:
            targets = {}
            for j, p in enumerate(part.params):
                if "step" in opt.state.get(p, {}) and (kind != "master" or _saves_master(p)):
                    targets[j] = torch.zeros(numel_of(shapes[id(p)]), dtype=torch.float32) if keep else None
                    if keep:
                        full.setdefault(number[id(p)], {})[kind] = targets[j]
            if not targets:
                continue
            for s in range(0, n, GATHER_NUMEL):
                e = min(n, s + GATHER_NUMEL)
                out = torch.empty(comm.world_size * (e - s), dtype=torch.float32, device=device)
                comm.all_gather(out, opt.read_shard(k, kind, s, e, settle=keep).to(device))
                if not keep:
                    continue
                out = host_copy(out, "checkpoint")
                for r, rank_pieces in enumerate(pieces):
                    for j, p_off, sh_off, cnt in _meeting(rank_pieces, s, e):
                        if j in targets:
                            a, b = max(s, sh_off), min(e, sh_off + cnt)
                            src = out[r * (e - s) + a - s:r * (e - s) + b - s]
                            targets[j][p_off + a - sh_off:p_off + b - sh_off] = src
    if not keep:
        return None
    state = {}
    for p in params:
        i = number[id(p)]
        mine = opt.state.get(p, {})
        if "step" in mine and i not in full:  # a frozen parameter's state, loaded as torch keeps it (whole)
            state[i] = _whole_copy(mine)
            continue
        if "step" in mine:
            kinds = {kind: t.view(shapes[id(p)]) for kind, t in full[i].items()}
            state[i] = {"step": mine["step"].detach().to("cpu", torch.float32, copy=True),
                        **{kind: kinds[kind] for kind in sorted(kinds, key=_kind_order)}}
        extra = {k: v for k, v in mine.items() if k not in OWN_KEYS}
        if extra:  # what user code or a state-dict pre-hook put there: kept as torch keeps it
            state.setdefault(i, {}).update(extra)
    members = [[number[id(p)] for p in g["params"]] for g in opt.param_groups]
    for k, v in opt.state.items():  # state kept under a key that is no parameter: packed as it is, as torch does
        if not isinstance(k, torch.Tensor):
            state.setdefault(k, v)
    # torch's named param groups keep their names ("param_names") in the state dict, where the group has them
    groups = torch_param_groups([{k: list(v) if k == "param_names" else v for k, v in g.items() if k != "params"}
                                 for g in opt.param_groups], members, opt.config.adam_w_mode)
    return {"state": state, "param_groups": groups}


def _frozen_states(sd, opt, index) -> list[tuple]:
    """(parameter, its saved state copied whole, or None) for the parameters frozen when ``opt`` was built: kept
    whole, as torch's AdamW keeps them (they train nothing here; state_dict() gives them back, and a rebuild after
    unfreezing loads them). Each is a dict (``check_torch_state`` checked it)."""
    owned = {id(p) for part in index for p in part.params}
    out = []
    for saved, group in zip(sd["param_groups"], opt.param_groups):
        for i, p in zip(saved["params"], group["params"]):
            if id(p) not in owned:
                s = saved_state(sd, i)
                out.append((p, _whole_copy(s) if s else None))
    return out


def _param_names(sd) -> list:
    """Each saved group's "param_names" as a list (None where it has none)."""
    out = []
    for gi, saved in enumerate(sd["param_groups"]):
        names = saved.get("param_names")
        if names is not None and (isinstance(names, (str, bytes)) or not isinstance(names, (list, tuple))
                                  or len(names) != len(saved["params"])):
            raise TypeError(f"param group {gi} of the state dict has param_names {names!r}: a list with one name "
                            "per parameter, as torch's state_dict() of named parameters writes it")
        out.append(None if names is None else list(names))
    return out


def _whole_copy(state: dict) -> dict:
    """A frozen parameter's state as torch keeps it: its tensors copied whole, the rest as it is."""
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def unowned_state(sd) -> dict:
    """The entries of torch state dict ``sd``'s "state" under keys that are no parameter's index (torch keeps
    them through state_dict() and load_state_dict(), as they are)."""
    ids = {i for g in sd["param_groups"] for i in g["params"]}
    ids |= {str(i) for i in ids}  # indices as strings: a state dict that went through JSON
    return {k: v for k, v in sd["state"].items() if k not in ids}


def _kind_order(kind: str) -> tuple:
    order = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")
    return (order.index(kind) if kind in order else len(order), kind)


def _meeting(pieces, s: int, e: int):
    """The pieces (param_index, param_offset, shard_offset, numel), sorted by shard_offset, meeting [s, e)."""
    k = max(bisect.bisect_right([pc[2] for pc in pieces], s) - 1, 0)
    while k < len(pieces) and pieces[k][2] < e:
        if pieces[k][2] + pieces[k][3] > s:
            yield pieces[k]
        k += 1


def load_state_dict(opt, sd) -> None:
    """Load a torch.optim.AdamW state_dict (or one of state_dict()) at any world size and stage."""
    comm = opt.comm

    def prepare():
        states, hypers = check_torch_state(opt, sd)
        index = opt.shard_index()

        def current(k, piece, p):
            if p.numel() == numel_of(index[k].shapes[piece.param_index]):  # a full parameter, not released
                return piece_of(p, piece)
            return opt.read_shard(k, "master", piece.shard_offset, piece.shard_offset + piece.numel)

        pending: dict = {}  # partition -> {(param index, offset): saved master}: what the parameters do not hold yet

        def source(k, piece, p, kind):
            if kind != "master":
                full = states[p].get(kind)
                return None if full is None else piece_of(full, piece)
            cur = current(k, piece, p)
            saved = states[p].get("master")
            if saved is None:
                return cur
            saved = piece_of(saved, piece)
            holds = saved.to(p.dtype) == cur.to(p.dtype)
            if not bool(holds.all()):  # loaded before the model's weights: kept until they arrive (or the step)
                pending.setdefault(k, {})[(piece.param_index, piece.param_offset)] = saved.float().clone()
            return torch.where(holds, saved, cur)

        staged = slice_into_shards(index, lambda part: part.kinds, source)
        steps = {p: float(s["step"]) for p, s in states.items() if "step" in s}
        extras = {p: {k: v for k, v in s.items() if k not in OWN_KEYS} for p, s in states.items()}
        # everything else the load takes from sd is read here too, so nothing after the ranks agreed can fail on
        # one rank alone (and leave it half-loaded, or the others waiting in the load's collectives)
        return index, staged, steps, hypers, extras, pending, unowned_state(sd), _frozen_states(sd, opt, index), \
            _param_names(sd)

    (index, staged, steps, hypers, extras, pending, unowned, frozen, param_names), _ = comm.agree(
        prepare, errors=(CheckpointError,))
    for part in index:
        for p in part.params:
            opt.state.pop(p, None)
            if p in steps:
                opt.state[p]["step"] = torch.tensor(steps[p], dtype=torch.float32)
            if extras.get(p):  # what a state-dict hook added, as torch's load keeps it
                opt.state[p].update(extras[p])
    # state under keys that are no parameter's index: replaced by the loaded ones, copied as they are (torch)
    for k in [k for k in opt.state if not isinstance(k, torch.Tensor)]:
        del opt.state[k]
    opt.state.update(unowned)
    for p, s in frozen:
        opt.state.pop(p, None)
        if s is not None:
            opt.state[p] = s
    for group, hyper, names in zip(opt.param_groups, hypers, param_names):
        group.update(hyper)
        if names is not None:  # the loaded names replace the group's, as torch's load_state_dict does
            group["param_names"] = names
    opt.load_shards(staged, pending)

