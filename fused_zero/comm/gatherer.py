"""Stage 3: gather each unit's parameters just before use, prefetch, release after.

Each unit (see sharding/units.py) owns partitions whose full flat buffer exists only
while the unit is gathered. Released, the buffer's storage is resized to zero
bytes and every parameter of the unit points at an empty placeholder (so a
stray read sees a 0-element tensor, never freed memory). Gathering resizes the
same storage back and all-gathers the shards into it; autograd's saved views of
the parameters (a transposed weight) reference that storage, so they read the
re-gathered values in backward. How a unit is gathered and released, and the walk
of the schedule, are comm/gather_cycle.py's; the hooks here say when.

Every rank issues the same gathers in the same order whatever its data does:
a forward walks a fixed schedule of units (recorded on the first training
forward, then agreed by all ranks); a unit's pre-forward hook issues the
schedule up to that unit and prefetches the next while fewer than
``max_live_units`` units are gathered; the end of the forward issues (and
releases) whatever the schedule has left, such as a branch this rank skipped.
A unit merged from several small modules (sharding/units.py) is gathered when
the first of them runs and released after its ``last`` (model order until the
first forward recorded which ran last, agreed by all ranks with the schedule).
Backward walks the reversed schedule the same way, triggered by hooks on the
units' outputs (a pre-hook on the autograd node that made each output); a unit is
released as soon as all of its trainable parameters got their gradient, and the
end of backward releases the rest. The root unit stays gathered from the start of
a training forward to the end of backward, and so does the last unit of the
schedule (backward needs it first: releasing it after the forward would only
gather it again at once, as FSDP2 keeps its root).

The gathers run on their own process group (``Comm.duplicate``), so their
order never interleaves with the gradient reduce-scatters of GradSync. With
hpZ (``secondary``, comm/secondary.py) a training forward's release keeps a
node-local copy of the unit, and backward gathers from those copies inside a node.

The optimizer owns the rest of the wiring: its one gradient hook per parameter
calls ``on_grad`` after GradSync's, and its one end-of-backward callback calls
``end_backward`` before GradSync closes the round (so every gather this rank
owes is issued before it may wait on a reduction). The module and tensor hooks
here reach the gatherer by weak reference and are removed by ``close``.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import warnings
from collections.abc import Callable, Mapping
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ..eager_hooks import _eager_only
from ..generation_sync import unmark_generation_synced
from ..hooks import ModelHook, ReleasedCopyCheck, forward_raised, inert_hook, queue_end_of_backward
from ..ownership import claim, release
from .gather_cycle import GatherCycle, TrainingState, UnitState, _Unit
from .param_sync import ParamSync
from .secondary import SecondaryCopies
from .model_state import ModelStateHooks
from ..sharding.partition import Partition, Placeholders, read_params_first
from ..sharding.units import compiled_regions


class ParamGatherer(GatherCycle, ModelStateHooks):
    """The hooks that gather, prefetch and release the units of one model."""

    def __init__(self, root: nn.Module, modules: tuple[tuple[nn.Module, ...], ...], parts: list[list[Partition]],
                 sync: ParamSync, max_live_units: int, reshard_after_forward: bool,
                 begin_backward: Callable[[], None], names: dict,
                 first_forward: Callable[[], None] | None = None, secondary: SecondaryCopies | None = None) -> None:
        self.sync = sync
        self.secondary = secondary  # hpZ: node-local copies of the units released after forward, for backward
        self.names = names
        self._holding = False  # inside full_parameters(): nothing is released
        self._views_ok = False  # model.state_dict() gives views of the gathered parameters (model_state.py)
        self.comm = sync.comm
        self.units = [_Unit(i, m, ps) for i, (m, ps) in enumerate(zip(modules, parts))]
        self.max_live_units = max_live_units
        self.reshard_after_forward = reshard_after_forward
        self.schedule = list(range(1, len(self.units)))  # registration order until one is recorded
        self._record: list[int] | None = []  # forward order being recorded (None: done)
        self.state = TrainingState.IDLE
        self._grad_forward = False
        self._graph_backward = False  # the backward running builds a graph (create_graph=True)
        self._graph_kept = False  # units stay gathered for a graph a create_graph backward built
        self._order: list[int] = []
        self._cursor = 0
        self._place: dict[int, int] = {}  # unit index -> its position in _order (no slice searched per unit)
        self._forwards = 0  # forwards started: a merged unit knows which of its modules runs first in each
        self.peak_bytes = 0  # the most gathered bytes seen since the last step
        # running totals of the units not RELEASED (kept by _issue and _release, so no gather walks every unit)
        self.live_bytes = 0  # their full buffers' bytes (gathered_bytes() counts the storages themselves)
        self._live_units = 0  # how many of them are not the root (max_live_units bounds it)
        self._placeholder = Placeholders()  # what released parameters point at
        #: the optimizer's check that the model still holds the parameters laid out, at each forward's start
        self.check_model = None
        #: whether no other rank trains the model (set by the stage): a change a gather cannot take in raises at once
        self.alone = True
        #: among ranks, the first change a gather could not take in (``p.data = t`` of another shape or dtype on
        #: this rank alone), put back and raised by the step after its collectives (``Stage3.before_update``)
        self.refused: RuntimeError | OSError | None = None
        self._begin_backward = begin_backward
        self._first_forward = first_forward  # the optimizer's checks at the first training forward (once)
        # The model's hooks hold the gatherer (not the optimizer): the model stays usable, with its
        # parameters gathered on use, for as long as it lives; close() gives them back for good.
        self._handles = []
        self.generation_marks: list[nn.Module] = []  # among ranks: transformers' generate() syncs (generation_sync.py)
        # The hooks resize storages and re-point p.data: torch.compile must never trace them. (Wrapped
        # here, not at import: torch.compiler.disable imports Dynamo, which imports triton on CUDA builds.)
        # A copy of the model (deepcopy, AveragedModel, torch.save) gets inert hooks in their place (ModelHook), and
        # at each unit's module a check that no parameter below it was copied released (ReleasedCopyCheck).
        numel_of = {id(p): s.numel() for u in self.units for part in u.parts for p, s in zip(part.params, part.shapes)}

        def copy_check(m: nn.Module):
            numels = tuple((n, numel_of[id(p)]) for n, p in m.named_parameters() if id(p) in numel_of)
            return ReleasedCopyCheck(numels) if numels else inert_hook

        pre, post = _eager_only(self._pre_forward), _eager_only(self._post_forward)
        post = ModelHook(post)
        in_units = {id(m) for u in self.units for m in u.modules}
        for u in self.units:
            for m in u.modules:
                self._handles.append(m.register_forward_pre_hook(ModelHook(pre, copied=copy_check(m)), prepend=True))
                self._handles.append(m.register_forward_hook(post, always_call=True))
        # Modules that hold parameters without being a unit's own (a Linear inside a unit's block, a small model
        # folded into the root, an embedding beside the units), called directly outside the model's forward,
        # gather the units holding their parameters (_direct_call). Their pre-hooks are in their modules' hook
        # dicts only while the model is idle: inside a forward none of them runs (torch's slow hook path cost
        # ~1.5 us a module call, 5% of a step of 200 small blocks); taking them out and putting them back is one
        # dict operation each.
        unit_of_param = {id(p): u for u in self.units for part in u.parts for p in part.params}
        direct = _eager_only(self._direct_call)
        self._direct_hooks = []  # (the module's pre-hook dict, the hook's key, the hook)
        self._module_names = {id(m): n for n, m in root.named_modules()}  # for messages
        # A module inside a block compiled in place (``torch.compile(block)`` in the model) is hooked at the block's
        # wrapper, whose call runs eagerly: a hook inside would be traced into the block's graph (a graph break, an
        # error under fullgraph=True). Calling such an inner module directly between steps is not served.
        regions, hooked = compiled_regions(root), {}
        for m in root.modules():
            owners = {id(unit_of_param[id(p)]): unit_of_param[id(p)] for p in m._parameters.values()
                      if p is not None and id(p) in unit_of_param}
            target = regions.get(id(m), m)
            if owners and id(target) not in in_units:
                hooked.setdefault(id(target), (target, {}))[1].update(owners)
        for m, owners in hooked.values():
            owners = tuple(sorted(owners.values(), key=lambda u: u.index))
            hook = ModelHook(direct, owners, copied=copy_check(m))
            handle = m.register_forward_pre_hook(hook)
            self._handles.append(handle)
            self._direct_hooks.append((m._forward_pre_hooks, handle.id, hook))
        self._direct_armed = True
        # The first training forward keeps those hooks in to check that every module holding a unit's parameters
        # runs inside that unit's forward (``_check_inside``); ``running``: how many of a unit's modules are inside
        # their forward now (kept during that forward only)
        self._checking = False
        # (torch marks public state-dict hooks with an attribute: a partial takes it, a bound method not)
        self._handles.append(root.register_state_dict_post_hook(ModelHook(self._check_state_dict,
                                                                          copied=copy_check(root))))
        self._handles.append(root.register_state_dict_pre_hook(ModelHook(self._root_state_dict_begins)))
        self._in_root_state_dict = False  # the root's state_dict() is running (its submodules' hooks leave it be)
        self._keep_vars = False  # the running state_dict() was asked for the parameters themselves
        self._handles.append(root.register_load_state_dict_pre_hook(ModelHook(self._before_load)))
        self._handles.append(root.register_load_state_dict_post_hook(ModelHook(self._after_load)))
        # a submodule's own state_dict() / load_state_dict() (``model.head.state_dict()``): its parameters alone
        for m in root.modules():
            if m is not root and any(id(p) in numel_of for p in m.parameters()):
                self._handles.append(m.register_state_dict_post_hook(ModelHook(self._check_sub_state_dict,
                                                                               copied=copy_check(m))))
                self._handles.append(m.register_state_dict_pre_hook(ModelHook(self._sub_state_dict_begins)))
                self._handles.append(m.register_load_state_dict_pre_hook(ModelHook(self._before_sub_load)))
                self._handles.append(m.register_load_state_dict_post_hook(ModelHook(self._after_sub_load)))
        self._load_scope = self._load_module = None
        self._sd_copies: list = []  # state-dict copies made inside full_parameters() (model_state.take_in_copies)
        self._unit_of = {id(m): u for u in self.units for m in u.modules}
        self._unit_of_param = {id(p): u for u in self.units for p in u.trainable}  # by id: no Tensor.__hash__ call
        self._params = [p for u in self.units for part in u.parts for p in part.params]
        self._param_ids = {id(p) for p in self._params}
        self._closed = False
        self.behind = None  # the host update running behind the last step (behind.py), set by Stage3
        # a forward without gradients first meets every rank through the store (the optimizer's collective_call):
        # a rank evaluating alone raises, naming the fix, instead of waiting in a gather no peer makes
        self.meet_eval: Callable[[], None] | None = None
        # the optimizer's: ends a backward that raised (its end-of-backward callback dropped) before a forward
        self.recover_backward: Callable[[], None] | None = None
        self._eval_met = False  # met since the last training forward or step: the next evaluation forwards do not
        # The model (through these hooks) outlives a dropped optimizer: a new optimizer over the
        # model finds this gatherer here and closes it, giving the parameters back first.
        claim(self, self._params)
        for u in self.units:
            # (autograd calls it: under compiled autograd, or a backward inside a compiled function, it runs eagerly)
            u.pre_backward = _eager_only(functools.partial(self._pre_backward, u.index))
            self._release(u, force=True)  # the parameters still hold their full values: placeholders now
        self._arm_direct_calls()

    def owns(self, p: nn.Parameter) -> bool:
        return not self._closed and id(p) in self._param_ids

    @torch.no_grad()
    def close(self) -> None:
        """Give every parameter its full value in memory of its own and remove every hook.

        Collective (every rank calls it): the units are gathered one last time. The
        model is then a plain model again, ready for another optimizer.
        """
        if self._closed:
            return
        if self.state is not TrainingState.IDLE:
            raise RuntimeError("the stage-3 optimizer cannot be closed inside the model's forward or backward")
        if self.behind is not None:
            self.behind.wait()
        self._read_shards_agreed(self.units)
        for u in self.units:
            self._issue_exact(u)
            self._wait(u)
            for part in u.parts:
                for p, view in part.views():
                    p.data = view.clone()
                part.release(lambda p: p.data)
            self._mark_released(u)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        unmark_generation_synced(self.generation_marks)
        self.generation_marks = []
        self._disarm_direct_calls()
        self._closed = True
        release(self, self._params)
        # the files the shards lived in go now (the optimizer closes them too; one dropped without close() lives on
        # in the model's hooks until a new optimizer steps it aside here, and nothing else would close them)
        for u in self.units:
            for part in u.parts:
                part.close()

    # -- accounting -------------------------------------------------------
    def gathered_bytes(self) -> int:
        """Bytes the units' full buffers hold right now (their storages' actual sizes; ``live_bytes`` is
        the running total the gathers keep, equal to it between gathers)."""
        return sum(part.flat.untyped_storage().nbytes() for u in self.units for part in u.parts)

    def pool_bytes(self) -> int:
        """The bound on gathered bytes: the root plus ``max_live_units`` of the largest unit."""
        others = sorted((u.nbytes for u in self.units[1:]), reverse=True)
        live = len(others) if not self.reshard_after_forward else self.max_live_units
        return self.units[0].nbytes + sum(others[:live])

    # -- forward ----------------------------------------------------------
    def _arm_direct_calls(self) -> None:
        """The model is idle: its modules called directly gather what they need (``_direct_call``)."""
        if not self._direct_armed and not self._closed:
            for hooks, key, hook in self._direct_hooks:
                hooks[key] = hook
            self._direct_armed = True

    def _disarm_direct_calls(self) -> None:
        if self._direct_armed:
            for hooks, key, _ in self._direct_hooks:
                hooks.pop(key, None)
            self._direct_armed = False

    def _direct_call(self, owners: tuple, module: nn.Module, args) -> None:
        """A module that is not a unit's own, called outside the model's forward (``model.head(x)``,
        ``block.attn(x)`` between steps; every rank calls it, as a unit's module): the ``owners`` of its
        parameters are gathered for it, as a unit's module gathers its unit. Without gradients they are
        released after the call; with them they stay gathered for their backward, and the call's outputs start
        the owners' backward as a unit's outputs do, so each backward through the graph (``retain_graph``, a
        second loss) gathers them again after an earlier one's end released them."""
        if self.state is not TrainingState.IDLE or self._holding or self._closed:
            if self._checking and self.state is TrainingState.FORWARD:
                self._check_inside(owners, module)
            elif self.state is TrainingState.BACKWARD and not self._holding and not self._closed:
                # a recomputation (activation checkpointing inside a unit's forward: the checkpointed function calls
                # the unit's inner modules, not its own) after the unit's gradients were all in and it was released
                # (a unit called twice: one call's gradients complete it before the other call's recomputation):
                # gathered again, as a unit whose own forward is recomputed (every rank recomputes alike)
                for u in owners:
                    if u.state is not UnitState.GATHERED:
                        self._require(u)
            return
        todo = [u for u in owners if u.state is not UnitState.GATHERED]
        for u in todo:
            self._issue(u)
        for u in todo:
            self._wait(u)
        grad = torch.is_grad_enabled()
        if not grad and not todo:
            return
        handle = None

        def after_call(module, args, output):
            handle.remove()
            if self.state is not TrainingState.IDLE:
                return
            if grad:
                if not forward_raised():
                    tensors = _output_tensors(output)
                    for u in owners:
                        self._hook_outputs(u, tensors)
            elif not self._holding:
                for u in todo:
                    self._release(u)
        handle = module.register_forward_hook(after_call, always_call=True)

    def _check_inside(self, owners: tuple, module: nn.Module) -> None:
        """The first training forward: ``module``, which holds parameters of the units ``owners`` without being
        a unit's own module, runs inside the forward. Each owner's parameters are gathered only around that
        unit's own forward, so one not running now means its parameters are (or may be, as prefetch goes)
        empty placeholders here: refused, naming the units that would serve (every rank runs the same model)."""
        idle = [u for u in owners if u.index and not u.running]
        if not idle:
            return
        name = self._module_names.get(id(module), type(module).__name__)
        units = ", ".join(repr(self._module_names.get(id(m), type(m).__name__)) for u in idle for m in u.modules)
        raise RuntimeError(
            f"stage 3: module {name!r} ({type(module).__name__}) ran inside the model's forward while the unit "
            f"holding its parameters ({units}) was not running: a unit's parameters are gathered only around its "
            "own forward, so here they are empty placeholders. That unit's forward never wrapped this call (a loop "
            "over a module's layers, or a call into a submodule from outside it). Choose units whose forward runs "
            f"around every use of their parameters: pass units=[...] with the modules that are called (here "
            f"{name!r} or its callers; units=[{type(module).__name__}] takes every {type(module).__name__}), or call "
            "the unit's module itself")

    def _pre_forward(self, module: nn.Module, args) -> None:
        u = self._unit_of.get(id(module))
        if u is None:  # a shallow copy of one of the model's modules (copy.copy): a plain module
            return
        if u.index == 0 and self.state is TrainingState.FORWARD and not _inside_forward_of(module):
            # the last forward was cut short by a KeyboardInterrupt (a loop caught it and goes on): torch runs no
            # always_call hook for a BaseException, so the root's post-forward never released what it gathered
            self._abort()
        if u.index == 0 and self.state is not TrainingState.IDLE and self.recover_backward is not None:
            self.recover_backward()  # a no-op unless the last backward raised
        if self._checking:
            u.running += 1
        if u.entered == self._forwards and u.state is UnitState.GATHERED and self.state is TrainingState.FORWARD \
                and self._record is None:
            return  # a later module of a merged unit in this forward: its first gathered it and prefetched
        if u.index == 0 and self.state is TrainingState.IDLE:
            # the model still holds the parameters laid out (before any gather); among ranks the forward goes on (a
            # replaced module is a plain one, its unit skipped as data may skip one) and the step raises it
            if self.check_model is not None:
                self._kept_refusal(self.check_model)
            self._grad_forward = torch.is_grad_enabled()
            if self._grad_forward and module.training:
                self._eval_met = False
            elif not self._eval_met and not self._holding and self.meet_eval is not None:
                # an evaluation: without gradients, or in eval mode (a validation loss with no_grad forgotten; its
                # gathers would pair with a peer's next training forward and hang both in the backward after)
                self.meet_eval()  # every rank runs it (before any gather): DDP's rank-0-only eval is refused
                # the forwards without gradients that follow, until the next training forward, need not meet again;
                # after one in eval mode with gradients (a model trained in eval mode) they still do
                self._eval_met = not self._grad_forward
            if self._grad_forward and self._first_forward is not None:  # before any gather, on every rank
                check, self._first_forward = self._first_forward, None
                check()
            self._checking = self._grad_forward and self._record is not None  # the recording forward
            if self._checking:
                u.running = 1  # the root: its pre-hook counted before this forward began
            else:
                self._disarm_direct_calls()
            self._start(TrainingState.FORWARD, list(self.schedule))
        elif self.state is TrainingState.FORWARD and self._grad_forward and self._record is not None and u.index:
            if u.index not in self._record:
                self._record.append(u.index)
            u.ran_last = next(k for k, m in enumerate(u.modules) if m is module)
        self._require(u)
        if self.state is TrainingState.FORWARD:
            first, u.entered = u.entered != self._forwards, self._forwards
            if first and u.frozen and self._grad_forward:  # the unit's inputs: those of its first module to run
                self._hook_inputs(u, args)
            self._prefetch()

    def _hook_inputs(self, u: _Unit, args) -> None:
        u.inputs_done = False
        inputs = [t for t in _tensors_in(args) if t.requires_grad]
        if inputs:
            torch.autograd.graph.register_multi_grad_hook(inputs,
                                                          _eager_only(functools.partial(self._inputs_done, u.index)))

    def _inputs_done(self, index: int, grads) -> None:
        u = self.units[index]
        u.inputs_done = True
        if self.state is TrainingState.BACKWARD and u.index and len(u.grads_seen) == len(u.trainable) \
                and not self._graph_kept:
            self._release_in_backward(u)

    def _post_forward(self, module: nn.Module, args, output):
        u = self._unit_of.get(id(module))
        if u is None:
            return
        if self._checking:
            u.running -= 1
        if self.state is TrainingState.BACKWARD:
            # recomputation (activation checkpointing): keep. Also when it ends by an exception: non-reentrant
            # checkpointing stops recomputing once it has what backward needs by raising through the modules
            # (checkpointing the root's whole forward ends in the root's hook); backward still reads the unit
            return
        if forward_raised():
            if u.index == 0:
                self._note_refused(sys.exc_info()[1])
                self._abort()
            return
        tensors = _output_tensors(output)
        copied = _unaliased(output, tensors, self.units if u.index == 0 else (u,))
        if copied is not None:
            output, tensors = copied, _output_tensors(copied)
        grad = torch.is_grad_enabled()
        if grad and (module is u.last or not self._gathered_into_backward(u)):
            self._hook_outputs(u, tensors)
        if u.index == 0:
            self._end_forward()
        elif self.state is TrainingState.IDLE or (module is u.last and (
                not self._grad_forward or (self.reshard_after_forward and not self._kept(u)))):
            # a merged unit: after its last module (one skipped: the end of the forward releases). Whether a training
            # forward keeps a unit never depends on the grad mode inside it: reentrant activation checkpointing runs
            # the unit under no_grad on the ranks that call it, and every rank must agree on what is gathered when
            # backward starts (a rank that skipped the unit keeps it, as the schedule's last)
            self._release(u)
        return copied

    def _note_refused(self, error: BaseException) -> None:
        """The forward raised after a gather kept a refusal for the step (among ranks, ``_kept_refusal``): the
        parameter it put back is an empty placeholder, so torch's own error (a shape check) comes first; say why."""
        if self.refused is not None and error is not self.refused and hasattr(error, "add_note"):
            error.add_note(f"fused_zero: this forward went on after it found what the next step refuses (its "
                           f"parameters were put back as empty placeholders): {self.refused}")

    def _gathered_into_backward(self, u: _Unit) -> bool:
        """Whether ``u`` stays gathered from its forward into backward (kept, or nothing is resharded): its
        backward needs no gather, so of a merged unit's modules only ``last``'s outputs are hooked, to start
        backward's schedule and prefetch (any unit's hook does that; one output not reached costs nothing)."""
        return not self.reshard_after_forward or self._kept(u)

    def _kept(self, u: _Unit) -> bool:
        """Whether a training forward keeps ``u`` gathered for backward: the schedule's last unit."""
        return bool(self.schedule) and u.index == self.schedule[-1]

    def _hook_outputs(self, u: _Unit, tensors) -> None:
        """Hook the unit's backward on ``tensors``, its output's (``_output_tensors``)."""
        u.backward_started = False
        u.grads_seen.clear()
        for t in tensors:
            if t.requires_grad:
                node = t.grad_fn
                if node is not None:  # before the node that made the output runs (cheaper than a tensor hook)
                    node.register_prehook(u.pre_backward)
                else:
                    t.register_hook(u.pre_backward)

    def _end_forward(self) -> None:
        self._drain()
        # Units this rank skipped were gathered only to pair with the ranks that ran them.
        # Release them all (reshard) or keep them all (no reshard), so that whether a
        # unit is gathered when backward starts never depends on this rank's data.
        if not self._grad_forward:
            for u in self.units:
                self._release(u)
        elif self.reshard_after_forward:
            for u in self.units[1:]:
                if not self._kept(u):
                    self._release(u)
        if self._grad_forward and self._record is not None:
            self._agree_on_schedule()
        self._stop_checking()
        self.state = TrainingState.IDLE
        self._arm_direct_calls()

    def _agree_on_schedule(self) -> None:
        record, self._record = self._record, None
        lasts = [u.ran_last for u in self.units]  # a merged unit is released after the module that ran last
        orders = self.comm.all_gather_object((record, lasts))
        if any(o != orders[0] for o in orders):
            warnings.warn("the units ran in a different order on different ranks in the first forward; "
                          "keeping the model's registration order for gathers and prefetch", stacklevel=3)
            return
        self.schedule = record + [i for i in self.schedule if i not in record]
        for u, k in zip(self.units, lasts):
            if k is not None:
                u.last = u.modules[k]

    def _abort(self) -> None:
        """An exception escaped the forward: release everything this forward gathered."""
        for u in self.units:
            self._release(u)
        self._drop_copies()
        self._stop_checking()
        self.state = TrainingState.IDLE
        self._arm_direct_calls()

    def _stop_checking(self) -> None:
        self._checking = False
        for u in self.units:
            u.running = 0

    def _drop_copies(self) -> None:
        if self.secondary is not None:
            self.secondary.drop_all()

    # -- backward ---------------------------------------------------------
    def _pre_backward(self, index: int, grad) -> None:  # grad: the output's gradient (or the node's, a tuple)
        u = self.units[index]
        if self.state is not TrainingState.BACKWARD:
            order = list(reversed(self.schedule)) if self.reshard_after_forward else []
            self._start(TrainingState.BACKWARD, order)
            # create_graph=True (a gradient penalty's autograd.grad): the graph it builds reads the parameters
            # in a later backward, so every unit stays gathered until a backward without it (or the step)
            self._graph_backward = torch.is_grad_enabled()
            self._graph_kept = self._graph_kept or self._graph_backward
            queue_end_of_backward(self.end_backward)
            self._begin_backward()  # the optimizer's end-of-backward callback (it calls end_backward first)
        if not u.backward_started:
            u.backward_started = True
            self._require(u)
            self._prefetch()

    def on_grad(self, p: nn.Parameter) -> None:
        """``p``'s gradient was accumulated: release its unit once all of the unit's are in."""
        u = self._unit_of_param.get(id(p))
        if self.state is not TrainingState.BACKWARD or u is None or u.index == 0:
            return
        u.grads_seen.add(id(p))
        if len(u.grads_seen) == len(u.trainable) and (not u.frozen or u.inputs_done) and not self._graph_kept:
            self._release_in_backward(u)

    def _release_in_backward(self, u: _Unit) -> None:
        """Every gradient of ``u`` is in: release it, and count anew. Reentrant activation checkpointing that calls
        the unit in several checkpointed segments recomputes each segment in a backward of its own, which gathers
        the unit again and accumulates its gradients again; the unit is released after each."""
        self._release(u)
        u.grads_seen.clear()
        u.inputs_done = False

    def end_backward(self) -> None:
        """The end of a backward (the optimizer's callback): release every unit."""
        if self.state is not TrainingState.BACKWARD:
            return
        self._drain()
        keep = self._graph_backward  # its graph reads the parameters in the next backward
        self._graph_kept = keep
        for u in self.units:
            if not keep:
                self._release(u)
            u.backward_started = False
            u.grads_seen.clear()
        self._drop_copies()  # (each was dropped as its gather landed; none outlives the backward)
        self.state = TrainingState.IDLE
        self._arm_direct_calls()

    # -- outside forward and backward ---------------------------------------
    def release_all(self) -> None:
        """The shards changed (a step, a load): drop every gathered copy."""
        self._graph_kept = False
        self._eval_met = False
        for u in self.units:
            self._drop_writes(u)  # the shards are newer than anything written to a unit still gathered
            self._release(u)
            for part in u.parts:
                part.drop_fetched()  # read ahead before the shards changed
        self._drop_copies()
        self.peak_bytes = self.live_bytes

    def regather_held(self) -> None:
        """Inside ``full_parameters()``, the shards changed (a load inside the block, every rank in it): every unit is
        gathered again from them, so the block, and a writeback at its end, hold the loaded values (the writeback
        took the block's pre-load copies back into the masters). What user code wrote inside before is dropped: the
        shards are newer. Outside the block nothing is held: the next gather reads the new shards anyway."""
        if not self._holding:
            return
        self._holding = False
        try:
            self.release_all()
            self._gather_all()
        finally:
            self._holding = True

    def _gather_all(self) -> None:
        """Every unit gathered exactly (the root first, then the forward's order), all issued before any wait."""
        order = [self.units[0]] + [self.units[i] for i in self.schedule]
        self._read_shards_agreed(order)
        for u in order:
            self._issue_exact(u)
        for u in order:
            self._wait(u)

    def _read_shards_agreed(self, order: list[_Unit]) -> None:
        """The file-held param shards that ``order``'s gathers will read, read first (``read_params_first``): a
        whole-model gather (``full_parameters()``, a state_dict(), ``close()``) serves what user code keeps."""
        read_params_first([part for u in order if u.released or self.sync.codec is not None for part in u.parts],
                          self.sync.comm)

    @contextmanager
    def full_parameters(self):
        if self.state is not TrainingState.IDLE:
            raise RuntimeError("full_parameters() cannot be entered inside the model's forward or backward")
        if self.behind is not None:
            self.behind.wait()
        self._gather_all()
        self._holding = True  # an eval forward or a state_dict() inside keeps everything gathered
        try:
            yield
        finally:
            self._holding = False
            self._sd_copies = []  # (the writeback took in what it keeps: take_in_copies)
            for u in self.units:
                self._drop_writes(u)  # writes inside are the writeback's to take (the optimizer's), else dropped
                self._release(u)



_PLAIN = (str, bytes, int, float, complex, bool, type(None), type, nn.Module)


_CALL_IMPL = nn.Module._call_impl.__code__


def _inside_forward_of(module: nn.Module) -> bool:
    """Whether ``module``'s forward is already running below the call now entering it (a module calling itself);
    read from the stack only where the gatherer was left in a forward."""
    frame, calls = sys._getframe(1), 0
    while frame is not None:
        if frame.f_code is _CALL_IMPL and frame.f_locals.get("self") is module:
            calls += 1
            if calls > 1:
                return True
        frame = frame.f_back
    return False


def _output_tensors(output) -> list | tuple:
    """The tensors in a module's output: a tensor, or a tuple or list of tensors (and None), without pytree's
    flattening (µs a call); else ``_tensors_in``."""
    if isinstance(output, torch.Tensor):
        return (output,)
    if type(output) in (tuple, list) and all(isinstance(t, torch.Tensor) or t is None for t in output):
        return [t for t in output if t is not None]
    return _tensors_in(output)


def _unaliased(output, tensors, units) -> object | None:
    """``output`` with a copy in place of every tensor that views the gathered memory of ``units`` (a unit returning
    a slice or a transpose of its own parameter: a position embedding's ``self.pos[:n]``, ``self.weight.t()``), or
    None where none does. Released, that memory is freed (its storage resized to nothing): the view would read
    freed memory (a crash, or torch's "data is not allocated yet"). The copy is the same values with the same
    gradient path (``clone``), and costs memory only where a unit's output aliases its parameters (an in-place
    write to such an output changes the copy, where torch refuses an in-place write to a view of a leaf).
    ``tensors``: the output's (``_output_tensors``)."""
    if not tensors:
        return None
    gathered = {part.flat.untyped_storage().data_ptr() for u in units if u.gathered for part in u.parts}
    gathered.discard(0)
    aliased = set()
    for t in tensors:
        try:
            if t.untyped_storage().data_ptr() in gathered:
                aliased.add(id(t))
        except (RuntimeError, NotImplementedError, TypeError):  # a tensor with no storage of its own (a subclass)
            continue
    if not aliased:
        return None
    if isinstance(output, torch.Tensor):
        return output.clone()

    def copy(x):
        if isinstance(x, torch.Tensor):
            return x.clone() if id(x) in aliased else x
        if dataclasses.is_dataclass(x) and not isinstance(x, type) and any(
                id(t) in aliased for t in _tensors_in(x)):
            return dataclasses.replace(x, **{f.name: tree_map(copy, getattr(x, f.name))
                                             for f in dataclasses.fields(x) if f.init})
        if isinstance(x, Mapping) and any(id(t) in aliased for t in _tensors_in(list(x.values()))):
            try:  # a dict subclass pytree keeps whole: rebuilt as its type, else refused below
                return type(x)((k, tree_map(copy, v)) for k, v in x.items())
            except Exception:  # noqa: BLE001 (its constructor takes something else)
                return x
        return x
    copied = tree_map(copy, output)
    if any(id(t) in aliased for t in _tensors_in(copied)):
        raise RuntimeError(
            "a stage-3 unit's forward returned a view of its own parameters inside an object that is not a pytree "
            f"node ({type(output).__name__}): once the unit is released that view reads freed memory. Return a copy "
            "(tensor.clone()) from the module, or return the tensors in a tuple, list, dict or dataclass")
    return copied


def _tensors_in(value, seen: set | None = None) -> list:
    """The tensors in a module's output or inputs: pytree's leaves, and inside the leaves pytree keeps whole, the
    fields of dataclasses and the attributes of plain objects (a block returning ``Out(h)``), at any depth (each
    object once: no cycle is followed; modules are not looked into)."""
    out = []
    seen = set() if seen is None else seen
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif isinstance(leaf, _PLAIN) or callable(leaf) or id(leaf) in seen:
            continue
        elif dataclasses.is_dataclass(leaf):
            seen.add(id(leaf))
            out += _tensors_in([getattr(leaf, f.name) for f in dataclasses.fields(leaf)], seen)
        elif isinstance(leaf, Mapping):  # a dict subclass pytree keeps whole (its items are not in its __dict__)
            seen.add(id(leaf))
            out += _tensors_in(list(leaf.values()), seen)
        elif hasattr(leaf, "__dict__"):
            seen.add(id(leaf))
            out += _tensors_in(list(vars(leaf).values()), seen)
    return out
