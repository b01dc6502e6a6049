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

import collections
import math

import torch

from .host_read import to_host
from .tiers.tier import Tier

MOMENT_KINDS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
#: every kind ``optimizer.state[p]`` may hold beside "step": the moments, and "master" (a key only: ``attach``)
VIEW_KINDS = (*MOMENT_KINDS, "master")
#: what ``optimizer.state[p]`` holds of the optimizer's own; any other key there is user code's (saved as torch's)
OWN_KEYS = frozenset(("step", *VIEW_KINDS))


class StateShard(torch.Tensor):
    """This rank's elements of one parameter's optimizer state (the rest live on other ranks).

    ``pieces``: ((offset in the flattened parameter, count), ...), in order; ``full_shape``: the
    parameter's shape. Operations on it return plain tensors; ``copy.deepcopy`` gives a StateShard of its own
    memory, pickling (``torch.save``) a plain tensor.
    """

    pieces: tuple[tuple[int, int], ...]
    full_shape: torch.Size
    __torch_function__ = torch._C._disabled_torch_function_impl

    def __deepcopy__(self, memo):
        """A StateShard of its own memory, with the same pieces (``copy.deepcopy(optimizer.state)``: torch's
        default needs clone() to return the subclass, which operations here never do)."""
        copied = memo.get(id(self))
        if copied is None:
            copied = memo[id(self)] = _shard(torch.Tensor.clone(self), self.pieces, self.full_shape)
        return copied

    def __reduce_ex__(self, protocol):
        """Pickled (``torch.save(optimizer.state)``) as a plain tensor, as ``ParamState`` pickles as a dict: the file
        loads with ``torch.load``'s default ``weights_only=True`` and without fused_zero."""
        return torch.Tensor.__reduce_ex__(self.as_subclass(torch.Tensor), protocol)


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


class ParamState(dict):
    """``optimizer.state[p]``: a dict that notes when user code edits it (``state[p]["exp_avg"] = t``), so a step
    looks for replaced moments only then (one flag a partition, not three lookups a parameter a step). The
    optimizer's own writes go through ``dict``'s methods. Copies and pickles are plain dicts."""

    __slots__ = ("edited", "in_files")

    def __init__(self, items, edited: list, in_files: bool = False) -> None:
        super().__init__(items)
        self.edited = edited  # the partition's flag, [bool]
        self.in_files = in_files  # the moments live in NVMe files: ``state[p]["exp_avg"]`` says so

    def __missing__(self, key):
        if self.in_files and key in MOMENT_KINDS:
            raise KeyError(f"{key} (offload_optimizer='nvme' keeps the moments in files, not in memory: "
                           "optimizer.state[p] holds 'step' only; read them from optimizer.state_dict(), which "
                           "every rank calls, or from a fused_zero.checkpoint)")
        raise KeyError(key)

    def __setitem__(self, key, value):
        self.edited[0] = True
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self.edited[0] = True
        super().__delitem__(key)

    def __ior__(self, other):
        self.edited[0] = True
        return super().__ior__(other)

    def _edit(name):  # noqa: N805 - builds the methods below
        def method(self, *args, **kwargs):
            self.edited[0] = True
            return getattr(dict, name)(self, *args, **kwargs)
        method.__name__ = name
        return method

    pop, popitem, clear, update, setdefault = _edit("pop"), _edit("popitem"), _edit("clear"), _edit("update"), \
        _edit("setdefault")
    del _edit

    def __reduce__(self):
        return dict, (dict(self),)


class OptimizerState(collections.defaultdict):
    """``optimizer.state``: torch's ``defaultdict(dict)``, which notes a parameter's whole state put in
    (``state[p] = {...}``, ``update``, ``setdefault``, ``|=``) or taken out (``del``, ``pop``, ``popitem``,
    ``clear``) in that parameter's partition's flag, as
    ``ParamState`` notes an edit inside one: the next step then checks (before its collectives) and takes in
    the moments put there, as torch's AdamW would use them. ``flags`` (id of a parameter -> its partition's
    ``state_edited``) is the optimizer's, filled at each build. Copies and pickles are plain defaultdicts."""

    def __init__(self, flags: dict, items=()) -> None:
        super().__init__(dict, items)
        self.flags = flags

    def _note(self, key) -> None:
        flag = self.flags.get(id(key))
        if flag is not None:
            flag[0] = True

    def __setitem__(self, key, value):
        self._note(key)
        super().__setitem__(key, value)

    def update(self, *args, **kwargs):
        items = dict(*args, **kwargs)
        for key in items:
            self._note(key)
        super().update(items)

    def setdefault(self, key, default=None):
        self._note(key)
        return super().setdefault(key, default)

    def __ior__(self, other):
        self.update(other)
        return self

    def __delitem__(self, key):
        self._note(key)
        super().__delitem__(key)

    def pop(self, key, *default):
        self._note(key)
        return super().pop(key, *default)

    def popitem(self):
        key, value = super().popitem()
        self._note(key)
        return key, value

    def clear(self) -> None:
        for key in self:
            self._note(key)
        super().clear()

    def copy(self):
        return collections.defaultdict(self.default_factory, self)

    __copy__ = copy

    def __reduce__(self):
        return collections.defaultdict, (self.default_factory,), None, None, iter(self.items())


def own_state(state: dict, part, p) -> ParamState:
    """``state[p]`` as a ``ParamState`` of ``part`` (a plain dict user code or a load put there is wrapped)."""
    s = state[p]
    if type(s) is not ParamState:
        s = state[p] = ParamState(s, part.state_edited, getattr(part.store, "tier", None) is Tier.NVME)
    return s


def attach(state: dict, part, index: int) -> None:
    """``state[p]`` (which has a step) gets the moment views of ``p``, parameter ``index`` of ``part``.

    A bf16/fp16 parameter's state also gets the key "master", holding an empty tensor: ``state_dict()`` saves the
    fp32 master beside the moments, and tools that rebuild a parameter's saved state from the keys of
    ``optimizer.state[p]`` (torch.distributed.checkpoint's ``flatten_optimizer_state_dict=True``) keep only the
    keys they find there, so listed the master is loaded and a resume stays exact. Not a view of the master: code
    that resets "every tensor of the state" (``v.zero_()``) must not rewrite the weights, and a state put in as
    torch's AdamW keeps one (``{"step", "exp_avg", "exp_avg_sq"}``) keeps the master. Nothing reads or takes in
    this entry; the master is read from ``state_dict()``."""
    s = own_state(state, part, part.params[index])
    views = views_of(part, index)
    dict.update(s, views)
    if views and part.keeps_master:
        dict.__setitem__(s, "master", torch.empty(0))


def _moment_kinds(part) -> tuple:
    return tuple(k for k in MOMENT_KINDS if k in part.store.kinds)


def reset_moments(part, index: int) -> None:
    """Zero the moments of parameter ``index`` of ``part`` in its store (its state was taken away and starts
    again, as torch.optim.AdamW starts a parameter without state from zero moments)."""
    for kind in _moment_kinds(part):
        for pc in part.pieces_of(index):
            part.store.write(kind, pc.shard_offset, torch.zeros(pc.numel, dtype=torch.float32))


def take_in_moments(state: dict, part, index: int) -> None:
    """Moments user code put in ``state[p]`` in place of the views (``state[p]["exp_avg"] = t``): their values
    go into the store (this rank's elements of a tensor shaped like ``p``, or a tensor as long as this rank's
    view), and the views take their place again. A tensor over the store's own memory (the view itself) is
    left as it is."""
    s = state[part.params[index]]
    pieces = part.pieces_of(index)
    for kind, flat, view in _replaced_moments(s, part, index):
        if flat.numel() == part.shapes[index].numel():
            for pc in pieces:
                part.store.write(kind, pc.shard_offset, flat[pc.param_offset:pc.param_offset + pc.numel])
        else:  # this rank's elements
            part.store.write(kind, pieces[0].shard_offset, flat)
        if view is None:  # states not in memory (NVMe): state[p] holds no views
            dict.__delitem__(s, kind)
        else:
            dict.__setitem__(s, kind, view)


def take_in_edited_moments(state: dict, part) -> None:
    """Between steps: ``take_in_moments`` of every parameter of ``part`` whose moments the next advance takes in (a
    started parameter's, or one whose count user code put in), so that what reads the store (``state_dict()``, a
    checkpoint's save) sees them; one the step would refuse is left to it (refused there, before its collectives).
    ``part.state_edited`` stays set: the step still looks at the counts."""
    if not part.state_edited[0]:
        return
    counts = getattr(part, "step_counts", None)
    for i, p in enumerate(part.params):
        if _moments_taken_in(_entry(state, p), counts, i):
            try:
                take_in_moments(state, part, i)
            except (TypeError, ValueError, RuntimeError):
                pass


def _replaced_moments(s: dict, part, index: int) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(kind, the values flat, the store's view) of each moment user code replaced in ``s`` (``state[p]`` of
    parameter ``index`` of ``part``); raises what cannot be taken in."""
    pieces = part.pieces_of(index)
    mine = sum(pc.numel for pc in pieces)
    full = part.shapes[index].numel()
    fresh = views_of(part, index)
    out = []
    for kind in _moment_kinds(part):
        t, view = s.get(kind), fresh.get(kind)
        if t is None and view is None:  # states not in memory (NVMe): state[p] holds no views
            continue
        if view is not None and isinstance(t, torch.Tensor) and t.shape == view.shape \
                and t.data_ptr() == view.data_ptr() and t.dtype == view.dtype:
            continue  # the store's own view
        if not isinstance(t, torch.Tensor):
            raise RuntimeError(
                f"optimizer.state[p][{kind!r}] of a parameter of shape {tuple(part.shapes[index])} was "
                f"{'removed' if t is None else 'replaced by a ' + type(t).__name__}; put back a tensor (zeros to "
                "restart it), or take away the parameter's whole state (del optimizer.state[p]) to restart it")
        if not t.is_floating_point():
            raise TypeError(f"optimizer.state[p][{kind!r}] of a parameter of shape {tuple(part.shapes[index])} was "
                            f"given a {t.dtype} tensor: a moment is a floating-point tensor (fp32 here)")
        shape = tuple(t.shape)
        # shaped like the parameter, or like the view it replaced (this rank's elements, 1-D, among ranks); with the
        # states on NVMe (no views) this rank's elements as a 1-D tensor. Another shape of as many elements (a
        # transposed copy) would be read in the wrong order: torch's update refuses it in its shape checks too
        if not (shape == tuple(part.shapes[index]) or (view is not None and shape == tuple(view.shape))
                or (view is None and t.dim() == 1 and t.numel() == mine and pieces)):
            raise ValueError(
                f"optimizer.state[p][{kind!r}] was given a tensor of shape {shape}; the parameter has shape "
                f"{tuple(part.shapes[index])} and this rank holds {mine} of its {full} elements: give a tensor "
                "shaped like the parameter (or like the view it replaced)" + (
                    "; at stage 3 a parameter is an empty placeholder between steps, so a tensor made like it "
                    f"(torch.zeros_like(p)) is empty: use torch.zeros({tuple(part.shapes[index])})"
                    if t.numel() == 0 else ""))
        out.append((kind, t.detach().reshape(-1), view))
    return out


def check_step_count(step, what: str) -> float:
    """A step count user code put in (``state[p]["step"] = t``) or a loaded state dict holds, as a float: a real
    number or a 1-element real tensor, finite and >= 0, else TypeError / ValueError naming ``what``."""
    if isinstance(step, bool) or not (isinstance(step, (int, float)) or (
            isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_complex())):
        raise TypeError(f"{what} has step {step!r}: a step count must be a number or a 1-element tensor")
    value = float(step)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{what} has step {value}: a step count is a whole number >= 0")
    return value


_ABSENT = object()


def _moments_taken_in(s: dict, counts, i: int) -> bool:
    """Whether the next advance takes in the moments of ``s`` (parameter ``i``'s state, ``counts`` its partition's
    StepCounts or None): a started parameter's, or one whose count is put in now (it starts)."""
    return "step" in s and (counts is None or counts.started[i] or s["step"] is not counts.views[i])


def _entry(state: dict, p) -> dict | tuple:
    """``state[p]`` where it is a dict (torch's state of a parameter), else ``()`` (none, or what user code put in
    that check_state_edits refuses)."""
    s = state.get(p, ())
    return s if isinstance(s, dict) else ()


def check_state_edits(state: dict, part) -> None:
    """What the next step would refuse taking in user code's edits of ``part``'s ``optimizer.state[p]`` (a moment
    that is no tensor or of another size, a step count that is no whole number >= 0), raised before the step's
    collectives: the edit may be on this rank alone. Nothing unless some state[p] of ``part`` was edited."""
    if not part.state_edited[0]:
        return
    counts = getattr(part, "step_counts", None)
    for i, p in enumerate(part.params):
        s = state.get(p, _ABSENT)  # (no entry made: get() is not defaultdict's [])
        if s is not _ABSENT and not isinstance(s, dict):
            raise TypeError(f"optimizer.state[p] of a parameter of shape {tuple(part.shapes[i])} is a "
                            f"{type(s).__name__}, not a dict: a parameter's state is a dict (step, exp_avg, "
                            "exp_avg_sq). Put back a dict, or del optimizer.state[p] to restart it from zeros")
        if not s or s is _ABSENT:
            continue
        count = s.get("step")
        if count is None and any(kind in s for kind in MOMENT_KINDS):  # (torch's step: KeyError 'step')
            raise ValueError(f"optimizer.state[p] of a parameter of shape {tuple(part.shapes[i])} holds moments but "
                             "no 'step': put a step count back (state[p]['step'] = torch.tensor(n)), or take the "
                             "whole state away (del optimizer.state[p]) to restart it from zeros")
        if count is not None and (counts is None or count is not counts.views[i]):  # (advance reads it anyway)
            check_step_count(count, f"optimizer.state[p] of a parameter of shape {tuple(part.shapes[i])}")
        if _moments_taken_in(s, counts, i):
            _replaced_moments(s, part, i)


def attach_all(state: dict, partitions) -> None:
    """Every parameter that has a step gets its moment views (after a build or a load)."""
    for part in partitions:
        for i, p in enumerate(part.params):
            s = state.get(p)
            if s is not None and "step" in s:
                for kind in VIEW_KINDS:
                    s.pop(kind, None)
                attach(state, part, i)


class StepCounts:
    """The step counts of one partition's parameters: one flat fp32 tensor, on the device the update runs
    on, whose 0-dim views are ``state[p]["step"]`` (torch keeps a 0-dim fp32 tensor per parameter; its
    fused AdamW keeps it on the parameter's device), so a step advances every count in one op.

    Nothing is read back: a step skipped on the device (a GradScaler's overflow, ranks that disagree)
    advances the counts by 0 there. The host knows instead which counts are equal: ``keys`` gives
    each parameter a class, and parameters of one class have advanced together since their counts
    were last set, so each run of them in the shard is updated by one launch that reads its step
    count on the device (``runs``). Only a step that would give some parameter its first state reads
    the skip verdict first (once), so that a skipped step creates no state, as torch.optim.AdamW
    under a GradScaler.

    A count that user code replaced (``load_state_dict``, ``state[p]["step"] = t``) is taken in at
    the next advance: its value is copied into the view, which takes its place; replaced counts of
    equal value share a class. One written in place (``state[p]["step"].fill_(50)``, ``+= 1``) bumps
    the flat tensor's version counter, which the views share: the next advance then reads the counts
    (once) and classes them by value.
    """

    def __init__(self, n: int, device: torch.device) -> None:
        self.flat = torch.zeros(n, dtype=torch.float32, device=device)  # (whatever the default dtype)
        self.views = list(self.flat.unbind()) if n else []
        self.keys = [0] * n  # equal keys: equal counts
        self.started = [False] * n  # had a state once: its moments may hold values
        self._before = None
        self._runs: dict = {}  # the active positions (None: all) -> runs, for the current keys
        self._version = self.flat._version  # after this class's own last write: a later one is user code's
        self._indices: dict = {}  # positions advanced alone -> their device index (_index_of)
        # (the state dict, the flags) of the last advance that gave every flagged parameter its count view: the
        # next advance with the same ones, nothing noted in the partition's state_edited since (OptimizerState and
        # ParamState note every edit, deletions too) and no count written in place, has nothing to look at per
        # parameter (a loop of 800 lookups a step on the host bench's model)
        self._steady: tuple | None = None

    def loaded(self) -> None:
        """A load wrote the store's moments: any parameter's may hold values now (one given a new state later
        starts from zeros, as after ``state.clear()``)."""
        self.started = [True] * len(self.started)
        self._steady = None

    def take_in_loaded(self, state: dict, part) -> None:
        """After a load: the counts it put in ``state`` (host tensors) become this partition's views now, holding
        their values, as the next ``advance`` would take them in, so that ``state[p]["step"]`` read after the load
        is the tensor later steps advance in place (torch's load leaves its own there, advanced in place)."""
        new_keys = None
        for i, p in enumerate(part.params):
            count = state[p].get("step") if p in state else None
            if count is None or count is self.views[i]:
                continue
            new_keys = new_keys or list(self.keys)
            new_keys[i] = self._set_count(own_state(state, part, p), i, count)
        if new_keys is not None:
            self._renumber(new_keys)
            self._steady = None
            self._version = self.flat._version  # (this class's own write, not user code's)

    def _set_count(self, s: dict, i: int, count) -> tuple:
        """Count ``i`` takes ``count``'s value (a host tensor or number user code or a load put in ``s``, the
        parameter's state) and its view takes its place there; the class key of a count set to that value."""
        value = float(count)
        self.views[i].fill_(value)
        dict.__setitem__(s, "step", self.views[i])
        self.started[i] = True
        return ("set", value)

    def _renumber(self, new_keys: list) -> None:
        """``keys`` from ``new_keys`` (equal keys: equal counts), numbered afresh; the runs made for the old ones go."""
        numbers: dict = {}
        self.keys = [numbers.setdefault(k, len(numbers)) for k in new_keys]
        self._runs.clear()

    def advance(self, state: dict, part, flags, skip: torch.Tensor | None, edits: bool = True) -> list[int]:
        """Advance the count of every parameter of ``part`` flagged in ``flags`` (by 0 where ``skip``, a 0-d
        device tensor, is set), giving new states their moment views; returns the advanced positions.
        ``edits`` False (a step this rank refused, ``skip`` set): user code's replaced counts and moments stay
        where they are, not taken in (check_state_edits refuses them again at the next step)."""
        views = self.views
        active = [i for i, flag in enumerate(flags) if flag]
        if not active:
            return []
        steady = edits and self._steady is not None and self._steady[0] is state and self._steady[1] == flags \
            and not part.state_edited[0] and self.flat._version == self._version
        if not steady and skip is not None and any("step" not in _entry(state, part.params[i]) for i in active) \
                and to_host(skip, "verdict before new states"):
            return []  # as torch.optim.AdamW under a GradScaler: a skipped step creates no state
        new_keys = None
        if self.flat._version != self._version:  # a count written in place by user code: class them by value
            new_keys = [("set", v) for v in to_host(self.flat, "step counts written in place")]
        for i in () if steady else active:
            s = state[part.params[i]]
            if not isinstance(s, dict):  # (a refused step: check_state_edits refused it before the collectives)
                continue
            count = s.get("step")
            if count is not views[i]:
                if not edits:
                    continue
                new_keys = new_keys or list(self.keys)
                s = own_state(state, part, part.params[i])
                if count is None:  # a new state: step 0 and its moment views
                    if self.started[i]:  # taken away (state.clear(), del state[p], state[p] = {}): from zeros
                        reset_moments(part, i)
                    self.started[i] = True
                    views[i].zero_()
                    dict.__setitem__(s, "step", views[i])
                    attach(state, part, i)
                    new_keys[i] = ("new",)
                    continue
                new_keys[i] = self._set_count(s, i, count)  # (a host tensor: a load reads from the host)
        if part.state_edited[0] and edits:  # user code wrote into some state[p] since the last step: replaced moments
            for i, p in enumerate(part.params):
                if self.started[i] and p in state:
                    take_in_moments(state, part, i)
            part.state_edited[0] = False
        if len(active) != len(views):  # the others did not advance: split their classes from these
            new_keys = new_keys or list(self.keys)
            for i in active:  # (also a count set now: an equal one that did not advance must part from it)
                new_keys[i] = ("advanced", new_keys[i])
        if new_keys is not None:
            self._renumber(new_keys)
        self._steady = (state, tuple(flags)) if edits else None  # (a refused step left replaced counts in place)
        self._before = self.flat.clone()
        by = 1.0 if skip is None else 1.0 - skip.to(self.flat)
        if len(active) == len(views):
            self.flat += by
        else:
            ones = torch.ones(len(active), dtype=self.flat.dtype, device=self.flat.device)
            self.flat.index_add_(0, self._index_of(active), ones * by)
        self._version = self.flat._version
        return active

    def _index_of(self, active: list[int]) -> torch.Tensor:
        """``active`` as a device index, made once per set of positions (a step captured as a CUDA graph reads
        it where it was when captured; made inside the capture, it would be a copy from host memory)."""
        key = tuple(active)
        index = self._indices.get(key)
        if index is None:
            if len(self._indices) >= 16:
                self._indices.clear()
            index = self._indices[key] = torch.tensor(active, device=self.flat.device)
        return index

    def steady(self, state: dict, part, flags) -> tuple | None:
        """The classes of the counts (``keys``) where the next ``advance`` of the parameters ``flags`` marks decides
        nothing anew on the host (each has its state and its count view, nothing was written by user code since);
        else None. What a captured step relies on (step_graph.py)."""
        if self.flat._version != self._version or part.state_edited[0]:
            return None
        for p, view, flag in zip(part.params, self.views, flags):
            if flag:
                s = state.get(p)
                if s is None or s.get("step") is not view:
                    return None
        return tuple(self.keys)

    def rollback(self) -> None:
        """Undo the last advance (a failed update)."""
        if self._before is not None:
            self.flat.copy_(self._before)
            self._before = None
            self._version = self.flat._version

    def runs(self, part, active: list[int]) -> list[tuple[int, int, torch.Tensor]]:
        """Maximal [start, end) shard ranges of the ``active`` parameters sharing a class, with the step
        count (a 0-d view, on the device) they share. Padding between two pieces of one run is updated
        too (it stays zero)."""
        key = None if len(active) == len(self.views) else tuple(active)
        cached = self._runs.get(key)
        if cached is not None:
            return cached
        on = set(active)
        runs: list[list] = []
        current = None
        for piece in part.pieces:
            i = piece.param_index
            if i not in on:
                current = None
                continue
            if current is not None and current[2] == self.keys[i]:
                current[1] = piece.shard_offset + piece.numel
            else:
                current = [piece.shard_offset, piece.shard_offset + piece.numel, self.keys[i], i]
                runs.append(current)
        out = [(a, b, self.views[i]) for a, b, _, i in runs]
        self._runs[key] = out
        return out
