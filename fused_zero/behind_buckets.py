"""BucketsBehind: stages 1-2's host update (offloaded optimizer states) overlapped with the next forward
(``update_behind=True``, the optimizer given the model).

Stage 3 runs the host update behind ``step()`` unit by unit (``behind.py``); stages 1-2 do it bucket by bucket.
Once ``step()`` has its verdicts and has planned the update, each partition's job is cut at its buckets (the
chunks never cross a bucket edge: ``OwnSlices.edges``) and the worker updates the buckets in the order the next
forward uses them (the model's parameter order, ``module.parameters()``), then, once every rank updated a bucket,
all-gathers it into the full parameters over a group of its own (``land``). The gathers never wait for the main
thread: a read between steps on one rank only (rank 0 saving ``model.state_dict()``) needs no collective.

Until its buckets are in, a parameter is an empty placeholder, as stage 3's are between uses: the update
writes the flat buffer the parameters view, and a read of a half-updated value must never pass silently.
A trained parameter that no module of the model owns (no forward hook would wait for it) never is: its
buckets go first and ``start()`` waits for them. Nor is one whose owners' forwards ran on no rank between the
build and the first step (a parent reads it directly: MobileBERT, DeBERTa-v2), learned by pre-hooks that
live until then and agreed by every rank once (the keys' order must be theirs). A direct read that begins
later fails in torch on the placeholder's shape; the root's forward hook adds a note naming update_behind.
Each module with parameters of its own gets a forward pre-hook that waits for its parameters' buckets and
points them back at the flat buffer; ``settle()`` (the next ``step()``, backward, ``clip_grad_norm_``,
``state_dict()``, checkpoints, ``optimizer.state``, ``full_parameters()``, ``model.state_dict()`` and
``model.load_state_dict`` through their pre-hooks, ``close()``) waits for the whole update and points them
all back. A parameter changed in place while it was a placeholder (the change went nowhere) raises there,
naming it. What cannot be seen is a read of ``p`` outside any of these (``p.norm()`` in a log line, an EMA
that reads the parameters right after ``step()``): it sees an empty tensor. Such code waits with
``with optimizer.full_parameters():`` first, or builds the optimizer over ``model.parameters()`` (no module:
the update stays inside ``step()``).

The forward hooks exist only while an update is pending, so between updates the model runs without them.
Under ``torch.compile`` the placeholders and hooks would make every compiled forward recompile: the first hook
called from compiled code marks the model ``compiled``, and from then on the update stays inside ``step()``
(bitwise the same; one recompile, then none).

A failure (a full disk on one rank) stops every rank's worker at the same bucket; the worker rolls the step
back and gathers the buckets it had gathered again (``restore``), and the next wait raises on every rank. A
forward that already ran on some updated buckets raises before it returns (its root's forward hook).
"""
from __future__ import annotations

import bisect
import sys
import weakref

import torch
from torch import nn

from .behind import UpdateBehind
from .sharding.units import compiled_regions
from .eager_hooks import _eager_only
from .gathers_behind import GathersBehind
from .hooks import HookSet, ModelHook, ReleasedCopyCheck, forward_raised
from .host_read import to_host
from .comm.collectives import Comm
from .comm.param_sync import ParamSync
from .sharding.partition import Partition, Placeholders
from .update import UpdatePlan


class BucketsBehind:
    """The buckets of stages 1-2's partitions, updated behind ``step()`` and gathered as they are ready."""

    def __init__(self, module: nn.Module, partitions: list[Partition], sync: ParamSync, device: torch.device,
                 agree: Comm | None, names: dict, gathers_only: bool = False) -> None:
        """``sync``: gathers over a group of the worker's own; ``agree``: the worker's gloo group (None: one rank);
        ``gathers_only``: the states are in the parameters' memory and the update stays inside step(): only the
        all-gathers run behind it (gathers_behind.py)."""
        self.partitions = partitions
        self.sync = sync
        self.names = names
        self.behind = GathersBehind(self) if gathers_only else UpdateBehind(device, agree, landing=self)
        self._agree = agree
        self._keys_of: dict[nn.Parameter, list] = {}  # a parameter -> the buckets (keys) it spans
        self._members: dict[tuple[int, int], list] = {}  # a key -> its parameters
        for pi, part in enumerate(partitions):
            for k, members in enumerate(part.bucket_params):
                key = (pi, k)
                ps = [part.params[j] for j in members]
                self._members[key] = ps
                for p in ps:
                    self._keys_of.setdefault(p, []).append(key)
        self._starts = [[b.shard_offset for b in part.layout.buckets] for part in partitions]
        self._index = {id(part): pi for pi, part in enumerate(partitions)}
        self._view = {p: v for part in partitions for p, v in part.views()}
        self._released: dict[nn.Parameter, int] = {}  # placeholders: a parameter -> its version counter then
        self._placeholder = Placeholders()
        self._bytes = 0  # all-gather bytes started, not yet reported (traffic)
        self._handles = []  # the state-dict hooks, for the optimizer's life
        self._forward_handles = []  # the forward hooks, only while an update is pending (see start)
        #: a forward ran under torch.compile (a hook saw it traced): updates then stay inside step()
        self.compiled = False
        me = weakref.ref(self)  # the model's hooks must not keep a dropped optimizer's buckets alive
        self._module = weakref.ref(module)
        # (module, its forward pre-hook): made once per model shape (each wrapping costs ~5 us), registered per
        # pending update. Until the first step a second pre-hook learns which modules' forwards run (on any rank):
        # a trained parameter whose owners never ran is read by another module's forward (DeBERTa's
        # rel_embeddings.weight, MobileBERT's dense.weight), where no hook would wait for it.
        self._pre_hooks = []
        self._seen: set = set()
        self._learning = []
        self._never_ran: set = set()  # learned at the first step (``_learned``)
        # every hook on the model is a ModelHook: a copy or pickle of the model (deepcopy, AveragedModel,
        # torch.save(model)) gets an inert hook, or where parameters may be placeholders a check that refuses
        self._after_hook = ModelHook(_hook(_AfterForward(me)))
        self._hook_modules(module)
        # collected without close() (its optimizer dropped): the state-dict hooks it left on the model go with it
        weakref.finalize(self, HookSet._remove_all, self._handles, self._learning)

    def _hook_modules(self, module: nn.Module) -> None:
        """Each module's hooks over the trained parameters it holds now, and the launch order."""
        me = weakref.ref(self)
        self._order = {p: i for i, p in enumerate(module.parameters())}  # registration order: the forward's, mostly
        self._pre_hooks = []
        hooked = set()
        # a module inside a block compiled in place (torch.compile(block) in the model, torchtitan's) waits at the
        # block's wrapper, whose call runs eagerly: a hook inside would be traced into the block's graph (a graph
        # break, an error under fullgraph=True)
        regions, waits = compiled_regions(module), {}
        for m in module.modules():
            named = [(n, p) for n, p in m.named_parameters(recurse=False) if p in self._keys_of]
            own = [p for _, p in named]
            if own:
                hooked.update(own)
                # a copy made while the update is pending holds placeholders: its forward and state_dict() refuse
                check = ReleasedCopyCheck(tuple((n, p.numel()) for n, p in named), ReleasedCopyCheck.BEHIND)
                self._handles += [m.register_state_dict_pre_hook(ModelHook(_Settle(me), copied=check)),
                                  m.register_load_state_dict_pre_hook(ModelHook(_Settle(me)))]
                target = regions.get(id(m), m)
                waits.setdefault(id(target), (target, {}))[1].update((id(p), p) for p in own)
        for target, held in waits.values():
            own, mine = list(held.values()), set(held)
            named = [(n, p) for n, p in target.named_parameters() if id(p) in mine]
            check = ReleasedCopyCheck(tuple((n, p.numel()) for n, p in named), ReleasedCopyCheck.BEHIND)
            self._pre_hooks.append((weakref.ref(target), ModelHook(_hook(_PreForward(me, own)), copied=check)))
            if self._learning is not None:
                self._learning.append(target.register_forward_pre_hook(ModelHook(_eager_only(_Ran(self._seen, own)))))
        # trained parameters kept whole, never placeholders: those no module of the model owns (a learnable loss
        # temperature, another model's), where no forward pre-hook would wait, and (from the first step) those
        # whose owners' forwards never ran; their buckets go first and step() waits for them
        self._unhooked = (set(self._keys_of) - hooked) | self._never_ran
        self._rerank()

    def model_changed(self) -> None:
        """The model holds its trained parameters elsewhere now (a weight tied to a module that runs earlier, a
        parametrization removed: ``ModelGuard`` served the change): each module's hooks wait for the parameters
        it holds now. Called by ``step()`` before it starts an update (the last one is whole), on every rank
        alike (the same change on each, as torch's training would need)."""
        module = self._module()
        if module is None or self._released:
            return
        self._unhook_forward()
        HookSet._remove_all(self._handles, self._learning or [])  # (empties the lists the finalizer holds)
        self._hook_modules(module)

    def _rerank(self) -> None:
        """Each key's place in the launch order (``_rank``): the buckets of parameters kept whole first (``_whole``:
        step() waits for them), then by the model's parameter order (the forward's, mostly)."""
        order, whole = self._order, self._unhooked
        self._whole = {key for key, ps in self._members.items() if any(p in whole for p in ps)}
        rank = {key: (key not in self._whole, min((order.get(p, len(order)) for p in ps), default=len(order)), key)
                for key, ps in self._members.items()}
        self._rank = {key: r for r, key in enumerate(sorted(rank, key=rank.get))}

    def _learned(self) -> None:
        """The first step: the parameters whose owners' forwards ran on no rank so far are kept whole from now on.
        Every rank takes the same set (one all-reduce, once): the keys' launch order must be every rank's."""
        if self._learning is None:
            return
        HookSet._remove_all(self._learning)
        self._learning = None
        params = list(self._keys_of)
        never = [p not in self._seen for p in params]
        comm = self._agree if self._agree is not None else self.sync.comm  # the worker's gloo group, or the gathers'
        if comm.world_size > 1 and params:
            device = torch.device("cpu") if self._agree is not None else self.partitions[0].flat.device
            flags = torch.tensor(never, dtype=torch.int32, device=device)
            comm.all_reduce(flags, op="max")
            never = [v > 0 for v in to_host(flags, "update_behind: the modules whose forwards ran")]
        kept = {p for p, n in zip(params, never) if n} - self._unhooked
        self._seen.clear()
        if kept:
            self._never_ran = kept
            self._unhooked |= kept
            self._rerank()

    # -- the step ----------------------------------------------------------------
    def start(self, plan: UpdatePlan | None, updated: tuple[tuple[bool, ...], ...]) -> None:
        """Cut the planned jobs at their buckets, release those buckets' parameters, start the worker (``plan``
        None: the update ran inside step(), the gathers alone go behind it).

        The keys are the same on every rank (each worker agrees and gathers once per key): the buckets holding a
        parameter ``updated`` on some rank, of the partitions the plan updates (none where a step is skipped;
        without a plan, every partition, as step()'s own gather does). Which of a bucket's elements this rank
        updates is its own (its shard): a key may have nothing to run here."""
        self._learned()
        by_key: dict = {}
        if plan is None:
            for pi, (part, flags) in enumerate(zip(self.partitions, updated)):
                for k, members in enumerate(part.bucket_params):
                    if any(flags[j] for j in members):
                        by_key[(pi, k)] = (None, [])
        for job in plan.jobs if plan is not None else ():
            pi = self._index[id(job.part)]
            flags = updated[pi]
            for k, members in enumerate(job.part.bucket_params):
                if any(flags[j] for j in members):
                    by_key[(pi, k)] = (job, [])
            for a, z in job.ranges:  # each range lies inside one bucket (OwnSlices.edges)
                by_key[(pi, bisect.bisect_right(self._starts[pi], a) - 1)][1].append((a, z))
        order = [(key, [job._replace(ranges=ranges)] if ranges else []) for key, (job, ranges) in
                 sorted(by_key.items(), key=lambda item: self._rank[item[0]])]
        for part in self.partitions:  # what adopt_outside_changes compares with at the next step
            part.mark_synced()
        if self.sync.comm.world_size > 1:  # an all-gather counts its output (Comm._count): each bucket, whole
            self._bytes += sum(self.partitions[pi].layout.buckets[k].numel * self.partitions[pi].flat.element_size()
                               for (pi, k), _ in order)
        if self.compiled:  # placeholders would make every compiled forward recompile: the update stays inside
            self.behind.start(self.partitions, plan, order)
            self.settle()
            return
        for key, _ in order:
            for p in self._members[key]:
                if p not in self._released and p not in self._unhooked:
                    p.data = self._placeholder(p)
                    self._released[p] = p._version
        self._hook_forward()
        self.behind.start(self.partitions, plan, order)
        try:  # the buckets of the parameters kept whole (ranked first): whole when step() returns
            for key, _ in order:
                if key in self._whole:
                    self.behind.wait(key)
        except BaseException:
            self._point_all()
            raise

    def traffic(self) -> dict[str, int]:
        """The all-gather bytes of the updates started since the last call (counted when started, so a step's
        ``comm_bytes()`` holds them although they run behind it; the worker's group's own count is dropped)."""
        self.sync.comm.reset_traffic()
        out, self._bytes = {"all_gather": self._bytes}, 0
        return out

    def _hook_forward(self) -> None:
        """The forward hooks, registered while the update is pending only: between updates (and with a compiled
        model, always) the model runs without them, so they break no compiled graph."""
        for ref, hook in self._pre_hooks:
            m = ref()
            if m is not None:
                self._forward_handles.append(m.register_forward_pre_hook(hook, prepend=True))
        module = self._module()
        if module is not None:
            self._forward_handles.append(module.register_forward_hook(self._after_hook, always_call=True))
            # while parameters are placeholders the model holds these buckets (the other hooks hold them weakly): an
            # optimizer dropped after step() (`del opt`, a training function returning the model) leaves a model
            # whose next forward or state_dict() still waits and makes them whole, then lets go of them
            self._forward_handles.append(module.register_forward_pre_hook(ModelHook(_Holding(self))))

    def _unhook_forward(self) -> None:
        for h in self._forward_handles:
            h.remove()
        self._forward_handles.clear()

    # -- on the worker ---------------------------------------------------------------
    def launch(self, key) -> list:
        """Start ``key``'s all-gather (its bucket, whole, into the full parameters); returns its handles."""
        pi, k = key
        return self.sync.gather(self.partitions[pi], [k])

    def land(self, key) -> None:
        for h in self.launch(key):
            h.wait()

    def restore(self, keys: list) -> None:
        for key in keys:
            self.land(key)

    # -- the waiting thread ------------------------------------------------------------
    def before_forward(self, params: list) -> None:
        """A module's forward: wait for its parameters' buckets, then point them back."""
        if not self._released:
            return
        waiting = [p for p in params if p in self._released]
        if not waiting:
            return
        try:
            for key in sorted({key for p in waiting for key in self._keys_of[p]}, key=self._rank.get):
                self.behind.wait(key)
        except BaseException:
            self._point_all()
            raise
        self._point(waiting)
        if not self._released:  # the last placeholder is whole: every bucket is in, the forward hooks go (and with
            self.settle()       # them the model's hold on these buckets: _Holding)

    def settle(self) -> None:
        """Wait for the whole update (raising if it failed, undone), and point every parameter back."""
        try:
            self.behind.wait()
        finally:
            self._point_all()

    def explain(self, error: BaseException) -> None:
        """The root's forward raised while parameters were placeholders: say so beside torch's own message (a
        parameter read outside its module's forward fails on its shape there)."""
        names = [self.names.get(p, f"of shape {tuple(self._view[p].shape)}") for p in self._released]
        if hasattr(error, "add_note"):
            error.add_note(
                f"fused_zero: update_behind=True: {len(names)} parameters were still empty placeholders when this "
                f"forward raised, e.g. {names[:5]}; each is made whole by its own module's forward. If the error "
                "comes from reading one outside its module's forward, read it inside `with optimizer."
                "full_parameters():`, or build the optimizer without update_behind")

    def after_forward(self) -> None:
        """The root's forward ended: if the update failed meanwhile, it raises now (the output may hold both)."""
        if self.behind.failed:
            self.settle()

    def _point_all(self) -> None:
        self._unhook_forward()
        if self._released:
            self._point(list(self._released))

    def _point(self, params: list) -> None:
        changed = []
        for p in params:
            version = self._released.pop(p)
            if p.numel() == 0 and self._view[p].numel() != 0:  # still the placeholder (else user code set p.data)
                if p._version != version:
                    changed.append(self.names.get(p, f"of shape {tuple(self._view[p].shape)}"))
                p.data = self._view[p]
        if changed:
            raise RuntimeError(
                f"parameters {changed[:5]} were changed in place between step() and their module's next forward "
                "while their update or all-gather still ran behind step() (stages 1-2 with update_behind=True): "
                "they were empty placeholders then, and the change went nowhere. Make such changes inside `with "
                "optimizer.full_parameters(writeback=True):` (it waits for the update), or before step()")

    def close(self) -> None:
        try:
            self.behind.close()
        finally:
            self._point_all()
            HookSet._remove_all(self._handles, self._learning or [])
            self._learning = None


def _hook(hook):
    """``hook`` kept out of torch.compile's graph (it waits and re-points p.data); a call from a compiled forward
    marks its owner ``compiled`` first, so later updates stay inside step() (placeholders would make each
    compiled forward recompile)."""
    from .eager_hooks import _eager_only

    def mark() -> None:
        owner = hook.owner()
        if owner is not None:
            owner.compiled = True
    return _eager_only(hook, mark)


class _PreForward:
    """A module's forward pre-hook: its own parameters' buckets (weakly held)."""

    __slots__ = ("owner", "params")

    def __init__(self, owner, params) -> None:
        self.owner, self.params = owner, params

    def __call__(self, module, args):
        owner = self.owner()
        if owner is not None and owner._released:
            owner.before_forward(self.params)


class _AfterForward:
    __slots__ = ("owner",)

    def __init__(self, owner) -> None:
        self.owner = owner

    def __call__(self, module, args, output):
        owner = self.owner()
        if owner is None:
            return
        if owner._released and forward_raised():  # torch calls this hook inside its except clause
            owner.explain(sys.exc_info()[1])
        if owner.behind.pending:
            owner.after_forward()


class _Holding:
    """A forward pre-hook that does nothing: registered while an update is pending, it keeps its owner alive."""

    __slots__ = ("owner",)

    def __init__(self, owner) -> None:
        self.owner = owner

    def __call__(self, module, args):
        return None


class _Ran:
    """A forward pre-hook while BucketsBehind learns which modules run: its module's own parameters ran."""

    __slots__ = ("seen", "params")

    def __init__(self, seen: set, params: list) -> None:
        self.seen, self.params = seen, params

    def __call__(self, module, args):
        self.seen.update(self.params)


class _Settle:
    """A state-dict pre-hook (saving or loading the model): the whole update first."""

    __slots__ = ("owner",)

    def __init__(self, owner) -> None:
        self.owner = owner

    def __call__(self, *args, **kwargs):
        owner = self.owner()
        if owner is not None and (owner._released or owner.behind.pending):
            owner.settle()
