"""``optimizer.state[p]``: its moments are views of this rank's flat optimizer state, never gathered,
and its ``step`` a 0-dim view of its partition's step counts (``StepCounts``).

torch code reads ``optimizer.state[p]["exp_avg"]`` and ``["exp_avg_sq"]`` (logging, LR finders,
sanity checks; ``["max_exp_avg_sq"]`` with amsgrad). Each is a view of the flat fp32 state the
update writes, so it always holds the current values and costs no memory:

- where this rank holds all of ``p`` (world size 1, or a parameter inside one rank's shard), a view
  shaped like ``p``, as torch's AdamW has it (fp32 also for bf16/fp16 parameters);
- where it holds part of it, a ``StateShard``: a 1-D view of this rank's elements of ``p`` in
  parameter order (its pieces are adjacent in the shard), with ``.pieces`` = ((offset in the
  flattened parameter, count), ...) and ``.full_shape``; empty where this rank holds none of it.
  Reading one never gathers: for the whole value, call ``optimizer.state_dict()`` on every rank.

States kept on NVMe (``offload_optimizer="nvme"``) are not in memory: there ``state[p]`` holds
``step`` only. With ``offload_optimizer="cpu"`` the views are host tensors.
"""
from __future__ import annotations

import torch

MOMENT_KINDS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


class StateShard(torch.Tensor):
    """This rank's elements of one parameter's optimizer state (the rest live on other ranks).

    ``pieces``: ((offset in the flattened parameter, count), ...), in order; ``full_shape``: the
    parameter's shape. Operations on it return plain tensors.
    """

    pieces: tuple[tuple[int, int], ...]
    full_shape: torch.Size
    __torch_function__ = torch._C._disabled_torch_function_impl


def _shard(t: torch.Tensor, pieces, shape) -> StateShard:
    s = t.as_subclass(StateShard)
    s.pieces, s.full_shape = tuple(pieces), torch.Size(shape)
    return s


def views_of(part, index: int) -> dict[str, torch.Tensor]:
    """The moment views of parameter ``index`` of partition ``part`` ({} where the states are not in memory)."""
    tensors = getattr(part.store, "tensors", None)
    if tensors is None:
        return {}
    pieces = part.pieces_of(index)
    shape = part.shapes[index]
    numel = sum(pc.numel for pc in pieces)
    start = pieces[0].shard_offset if pieces else 0
    if any(a.shard_offset + a.numel != b.shard_offset for a, b in zip(pieces, pieces[1:])):
        return {}  # not adjacent in the shard (a layout this module does not expect): no view rather than a copy
    out = {}
    for kind in MOMENT_KINDS:
        if kind in tensors:
            flat = tensors[kind][start:start + numel]
            out[kind] = flat.view(shape) if numel == shape.numel() else \
                _shard(flat, [(pc.param_offset, pc.numel) for pc in pieces], shape)
    return out


def attach(state: dict, part, index: int) -> None:
    """``state[p]`` (which has a step) gets the moment views of ``p``, parameter ``index`` of ``part``."""
    state[part.params[index]].update(views_of(part, index))


def attach_all(state: dict, partitions) -> None:
    """Every parameter that has a step gets its moment views (after a build or a load)."""
    for part in partitions:
        for i, p in enumerate(part.params):
            s = state.get(p)
            if s is not None and "step" in s:
                for kind in MOMENT_KINDS:
                    s.pop(kind, None)
                attach(state, part, i)


class StepCounts:
    """The step counts of one partition's parameters: one flat fp32 tensor whose 0-dim views are
    ``state[p]["step"]`` (torch keeps a 0-dim fp32 tensor per parameter), so a step advances every
    count in one op and reads them back in one, not one tensor op per parameter.

    A count that user code replaced (``load_state_dict``, ``state[p]["step"] = t``) is taken in at
    the next advance: its value is copied into the view, which takes its place.
    """

    def __init__(self, n: int) -> None:
        self.flat = torch.zeros(n)
        self.views = list(self.flat.unbind()) if n else []

    def advance(self, state: dict, part, flags) -> dict[int, int]:
        """Advance the count of every parameter of ``part`` flagged in ``flags``, giving new states their
        moment views; returns {position: new step count}."""
        active = []
        views = self.views
        for i, (p, flag) in enumerate(zip(part.params, flags)):
            if flag:
                s = state[p]
                count = s.get("step")
                if count is not views[i]:
                    if count is None:  # a new state: step 0 and its moment views
                        views[i].zero_()
                        s["step"] = views[i]
                        attach(state, part, i)
                    else:
                        views[i].fill_(float(count))
                        s["step"] = views[i]
                active.append(i)
        if not active:
            return {}
        if len(active) == len(views):
            self.flat += 1
        else:
            self.flat.index_add_(0, torch.tensor(active), torch.ones(len(active)))
        values = self.flat.tolist()  # host tensor: the step counts live on the host
        return {i: int(values[i]) for i in active}
