"""Frozen parameters: weights only, no optimizer state, no gradient, no reduction.

A parameter with ``requires_grad=False`` when the optimizer is built is frozen for that
optimizer (a LoRA base, a frozen embedding): torch's AdamW never creates state for it, as it
never receives a gradient, and DDP never reduces it. So here:

- stages 1-2: it stays the user's tensor (replicated, as DDP keeps it; every rank takes rank
  0's values at build, as DDP's constructor broadcasts them), in no partition;
- stage 3: it is sharded and gathered with its unit like any other parameter, in a
  weights-only partition of its unit (``tiers.store.WeightsOnly``, chosen by ``tiers.Tiers``: no master, no moments, no
  gradient shard; its ``ParamShard`` holds the weights in the parameter's own dtype), whether
  or not a param group lists it: stage 3 takes the module, whose parameters are its to shard.

A frozen parameter that later requires a gradient (``requires_grad_()`` for progressive
unfreezing) or holds one is refused at the next ``step()`` on every rank, naming it and the
rebuild that takes it in (``refuse_unfrozen``); a parameter frozen after the build simply gets
no gradient, and torch's AdamW skips it too. One trained before a rebuild (``add_param_group``) and frozen
when it ran keeps its place and state (``split_frozen``'s ``trained``), as torch's AdamW keeps its state; it
gets its gradient hook once it requires a gradient again (``ShardedOptimizer._take_unfrozen``).
"""
from __future__ import annotations

import torch

from .sharding.partition import read_params_first


def split_frozen(params, trained=frozenset()) -> tuple[list, list]:
    """(trainable, frozen) parameters of ``params``, each in the given order; one in ``trained`` (laid out for
    training by an earlier build) stays trainable whatever its requires_grad says now."""
    params = list(params)
    return [p for p in params if p.requires_grad or p in trained], \
        [p for p in params if not p.requires_grad and p not in trained]


def refuse_unfrozen(frozen, names: dict, param_groups=()) -> None:
    """Raise if a parameter frozen at build now requires (or holds) a gradient. Cost: one read per frozen
    parameter; every rank runs it before step()'s first collective. ``names``: the model's names (given the model);
    else each is named by its place in ``param_groups``."""
    late = [p for p in frozen if p.requires_grad or p.grad is not None]
    if late:
        places = {id(q): f"param_groups[{i}]['params'][{k}]" for i, g in enumerate(param_groups)
                  for k, q in enumerate(g["params"])}
        shown = [repr(names[p]) if p in names else f"{places.get(id(p), 'a parameter')} of shape {tuple(p.shape)}"
                 for p in late[:3]]
        many = len(late) > 1
        what = (f"now {'require' if many else 'requires'} a gradient" if any(p.requires_grad for p in late) else
                f"now {'hold' if many else 'holds'} a .grad (assigned by hand; torch.optim steps a tensor "
                "that holds one, but here a tensor that required no gradient when the optimizer was built is frozen)")
        them = "them" if many else "it"
        raise RuntimeError(
            f"{'parameters' if many else 'parameter'} {'; '.join(shown)}"
            f"{' and more' if len(late) > 3 else ''} {'were' if many else 'was'} frozen "
            f"(requires_grad=False) when ShardedOptimizer laid {them} out (at construction, or "
            f"the add_param_group that added {them}) and {what}: the optimizer "
            f"keeps no state, gradient buffer or reduction for {them} and would not train {them}. Set requires_grad "
            "before building, or rebuild to take it in: sd = opt.state_dict(); opt = ShardedOptimizer(<the same "
            "groups or model>, ...); opt.load_state_dict(sd) (its state starts at its first step, as torch's "
            "AdamW's does); with a framework, build its optimizer again after unfreezing")


def frozen_bytes(frozen) -> int:
    """Bytes of the frozen parameters kept whole (stages 1-2: the user's tensors)."""
    return sum(p.numel() * p.element_size() for p in frozen)


@torch.no_grad()
def gather_frozen(parts, sync, keep: bool) -> dict:
    """Stage 3: {frozen parameter: a full CPU copy} (``keep``; else {}), one partition gathered at a time on
    ``sync`` (every rank joins); each goes back to its shard after, unless its unit was gathered already."""
    out = {}
    for part in parts:
        released = part.flat.untyped_storage().nbytes() == 0 and part.flat.numel() > 0
        if released:
            part.fetch_params()
            read_params_first([part], sync.comm)  # a failed read raises on every rank, before the gather
            part.materialize()
            with sync.exact():  # for a checkpoint: not quantized (param_comm)
                for h in sync.gather(part):
                    h.wait()
            part.drop_fetched()
        if keep:
            out.update((p, view.detach().to("cpu", copy=True)) for p, view in part.views())
        if released:
            placeholders = [p.data for p in part.params]
            part.release(lambda p, it=iter(placeholders): next(it))
    return out


@torch.no_grad()
def load_frozen(parts, values: dict, names: dict, placeholder) -> None:
    """Stage 3: each rank's shard of the full ``values`` ({frozen parameter: tensor}) into the param shards."""
    for part in parts:
        mine = [p for p in part.params if p in values]
        if not mine:
            continue
        if part.flat.untyped_storage().nbytes() > 0:  # gathered (full_parameters): load in place, then adopt
            for p in mine:
                p.copy_(values[p])
            part.load_master_from_params()
            continue
        for p in mine:
            p.data = values[p].to(device=part.device, dtype=part.dtype)
        part.adopt_assigned(names, placeholder)
