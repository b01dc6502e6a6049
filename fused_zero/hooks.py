"""The optimizer's autograd hooks: one per parameter, held by weak reference.

torch keeps a parameter's post-accumulate-grad hooks (and the module hooks of
stage 3) for as long as the parameter or module lives. A closure over the
optimizer would keep a dropped optimizer alive and firing into the next one
(a sweep, a notebook, a rebuild after loading). The hooks here reach their
owner's bound methods weakly (a weak reference to the owner beside the
method's function, as ``weakref.WeakMethod`` holds them, without making a bound
method per call; a renamed method fails where the hook is made, not silently),
do nothing once the owner is gone, and are removed when the owner closes, is
rebuilt or is garbage-collected.
"""
from __future__ import annotations

import functools
import operator
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch


def forward_raised() -> bool:
    """Whether the module forward hook calling this runs because its module's call raised.

    torch calls a hook registered with ``always_call=True`` from inside the ``except`` clause of
    ``Module._call_impl`` when the call raised, so ``sys.exc_info()`` is set there; but it is set too after a
    forward that returned normally inside user code's own ``except`` block (a step retried there), which is no
    failure of this call. The exception raised by this call is the one caught in this call's own ``_call_impl``
    frame: the head of its traceback. Nothing walks the stack unless an exception is being handled."""
    tb = sys.exc_info()[2]
    if tb is None:
        return False
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not _CALL_IMPL:
        frame = frame.f_back
    return frame is None or frame is tb.tb_frame  # (no call frame seen: trusted as a failure, as before)


_CALL_IMPL = torch.nn.Module._call_impl.__code__


class Relay:
    """Calls the bound method ``method`` while its object lives, with ``bound`` after the call's own
    arguments (what a hook needs about its tensor, found when the hook is made, not at every call);
    a no-op after."""

    __slots__ = ("owner", "func", "bound")

    def __init__(self, method: Callable, *bound) -> None:
        self.owner = weakref.ref(method.__self__)
        self.func = method.__func__
        self.bound = bound

    def __call__(self, *args):
        owner = self.owner()
        if owner is not None:
            return self.func(owner, *args, *self.bound)
        return None


class EagerRelay(Relay):
    """A ``Relay`` for hooks autograd calls (a parameter's gradient hook): when a backward runs inside a
    ``torch.compile``d function, Dynamo would compile the hook's frame (the optimizer's bookkeeping, its
    collectives); it runs eagerly instead (``torch.compiler.disable``). Eager, the check costs ~0.1 us a call."""

    __slots__ = ()

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return _eagerly(Relay.__call__, self, *args)
        owner = self.owner()
        if owner is not None:
            return self.func(owner, *args, *self.bound)
        return None


class GradRelay(EagerRelay):
    """The ``EagerRelay`` of a parameter's gradient hook, which runs once per parameter per backward: its one bound
    argument kept in a slot, so a call builds no argument tuples (about 0.4 of its 1.2 us went there)."""

    __slots__ = ("entry",)

    def __init__(self, method: Callable, entry) -> None:
        super().__init__(method, entry)
        self.entry = entry

    def __call__(self, p):
        if _is_compiling():
            return _eagerly(Relay.__call__, self, p)
        owner = self.owner()
        if owner is not None:
            return self.func(owner, p, self.entry)
        return None


_is_compiling = torch.compiler.is_compiling


def _eagerly(fn: Callable, *args):
    """``fn(*args)`` out of Dynamo's reach (made on first use: torch.compiler.disable imports Dynamo, which is
    imported already whenever something is being compiled)."""
    global _EAGER
    if _EAGER is None:
        _EAGER = torch.compiler.disable(lambda fn, *args: fn(*args))
    return _EAGER(fn, *args)


_EAGER = None


def eager_under_compile(fn: Callable) -> Callable:
    """``fn`` (an optimizer method) runs eagerly when called from code torch.compile traces (a compiled training
    step calling ``clip_grad_norm_``, ``step``, ``zero_grad``): a graph break, as torch.optim's own host-side
    work is, rather than Dynamo tracing into the bucket bookkeeping and collectives, which it cannot."""
    @functools.wraps(fn)
    def eager(*args, **kwargs):
        if torch.compiler.is_compiling():
            return _eagerly(functools.partial(fn, *args, **kwargs))
        return fn(*args, **kwargs)
    return eager


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """``callback`` runs when the backward in progress ends (autograd's ``queue_callback``). The optimizer's hooks
    run eagerly under compiled autograd (``EagerRelay``, ``_eager_only``), where queue_callback is taken; should a
    compiled-autograd setting still refuse it (torch's AssertionError), the refusal names the switch."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)
    except AssertionError as e:
        if "Compiled Autograd" not in str(e):
            raise
        raise RuntimeError(
            "compiled autograd refused ShardedOptimizer's end-of-backward callback (torch: "
            f"{str(e).splitlines()[0]}): the optimizer's hooks reduce, gather and release during backward and "
            "must run eagerly. Use compiled autograd without fullgraph=True, or turn it off; torch.compile of the "
            "model (and of the training step) works") from None


class EndOfBackward:
    """What an owner queues for the end of a backward (``queue_callback``): ``fn`` when the backward ends.

    Autograd drops a queued callback unrun when the backward raises (an out-of-memory error, a
    KeyboardInterrupt, a failing hook), and a loop that catches it goes on (torch.optim does not care). The
    callback then calls ``dropped`` as it is freed, wherever autograd frees it: ``dropped`` only takes note,
    and the owner finishes the backward's bookkeeping at its next call (``ShardedOptimizer._recover_if_dropped``).
    So does a callback that raised before it ended (a KeyboardInterrupt landing inside it): ``fn`` must be safe
    to run again from where it stopped.
    """

    __slots__ = ("_fn", "_dropped", "_ran")

    def __init__(self, fn: Callable[[], None], dropped: Callable[[], None]) -> None:
        self._fn, self._dropped, self._ran = fn, dropped, False

    def __call__(self) -> None:
        if torch.compiler.is_compiling():  # a backward inside a compiled function: the callback runs eagerly
            return _eagerly(EndOfBackward.__call__, self)
        try:
            self._fn()
        except BaseException:  # cut short (a KeyboardInterrupt inside it): the owner's next call ends it; noted now,
            self._ran = True   # since a loop's except clause may call the owner while this frame keeps us alive
            self._dropped()
            raise
        self._ran = True

    def __del__(self) -> None:
        if not getattr(self, "_ran", True):  # (Dynamo tracing the owner's code builds one without __init__)
            self._dropped()


_CDATA = operator.attrgetter("_cdata")  # the TensorImpl a Python tensor wraps (swap_tensors changes it)


class HookSet:
    """Hooks registered on behalf of ``owner``; ``remove()`` takes them all off."""

    def __init__(self, owner: Any) -> None:
        self._handles: list = []
        self._params: list[torch.nn.Parameter] = []  # those with a gradient hook, and the tensor each was
        self._cdatas: list[int] = []  # registered on (``_cdata``: swap_tensors changes it)
        # Also removed when the owner is collected without close().
        self._finalizer = weakref.finalize(owner, HookSet._remove_all, self._handles)

    def relay(self, method: Callable) -> Callable:
        """A callable that forwards to the owner's bound ``method`` without keeping the owner alive."""
        return Relay(method)

    def grad(self, p: torch.nn.Parameter, method: Callable, entry) -> None:
        """``method(p, entry)`` (a bound method of the owner) after ``p``'s gradient is accumulated."""
        self._handles.append(p.register_post_accumulate_grad_hook(GradRelay(method, entry)))
        self._params.append(p)
        self._cdatas.append(p._cdata)

    def rehook_swapped(self) -> list[torch.nn.Parameter]:
        """The parameters whose tensor was swapped for another since their gradient hook was registered
        (``torch.utils.swap_tensors``: ``load_state_dict`` under torch.__future__'s
        ``set_swap_module_params_on_conversion(True)``, ``module._apply`` on tensor subclasses): their hooks stayed
        with the old tensor, so backward no longer calls them. Each one's hook dict (the user's hooks with ours,
        their handles still valid) is attached to the tensor it holds now; returned so that the caller takes in
        what its gradient got unseen. (``p.data = t`` keeps the tensor, and its hooks.)"""
        now = list(map(_CDATA, self._params))
        if now == self._cdatas:  # (one C call a parameter: 50 us for 800 on a 2-core CPU)
            return []
        swapped = [p for p, was, cdata in zip(self._params, self._cdatas, now) if cdata != was]
        self.reattach(swapped)
        self._cdatas = now
        return swapped

    def reattach(self, params) -> None:
        """Attach each of ``params``' hook dicts to the tensor it holds now, whatever ``rehook_swapped`` saw: two
        swaps between its checks can give a parameter a tensor at the address its first one had (freed between),
        and the comparison misses it. Idempotent (setting the dict replaces, never adds, the tensor's hook)."""
        for p in params:
            hooks = p._post_accumulate_grad_hooks
            if hooks is not None:
                p._post_accumulate_grad_hooks = hooks  # (setting it attaches the dict to the current tensor)

    def add(self, handle) -> None:
        """Own a handle registered elsewhere (a module or tensor hook built with ``relay``)."""
        self._handles.append(handle)

    def remove(self) -> None:
        HookSet._remove_all(self._handles)
        self._cdatas, self._params = [], []

    @staticmethod
    def _remove_all(*lists: list) -> None:
        """Remove every hook handle in ``lists`` (a finalizer's: it holds the lists, never their owner)."""
        for handles in lists:
            for h in handles:
                h.remove()
            handles.clear()


# -- hooks on the user's model, and what a copy of the model gets instead ------------------------------
def inert_hook(*args, **kwargs) -> None:
    """What a copy of the model has where fused_zero's hooks were: nothing happens."""
    return None


def _same(value):
    return value


class ModelHook(functools.partial):
    """A hook fused_zero registers on the user's model (``ModelHook(fn, *args)`` calls ``fn(*args, *hook's arguments)``;
    a ``functools.partial``, so the call adds no Python frame).

    ``copy.deepcopy(model)`` (an EMA copy, ``swa_utils.AveragedModel``) and pickling it (``torch.save(model)``)
    copy a module's hooks with it; a copy of this one is ``copied`` instead (by default ``inert_hook``), so the
    copy is a plain model that reaches nothing of the optimizer's (no gather, no collective on a copy's forward).
    """

    def __new__(cls, fn: Callable, *args, copied: Callable = inert_hook):
        self = super().__new__(cls, fn, *args)
        self.copied = copied
        return self

    def __deepcopy__(self, memo):
        return self.copied

    def __reduce__(self):
        return _same, (self.copied,)


class ReleasedCopyCheck:
    """In a copy of the model (stage 3's, or stages 1-2's with ``update_behind=True``: ``made`` says which), a
    module whose parameters were copied while released (empty placeholders in place of ``numels``, ((name below
    the module, numel), ...)) refuses to run, naming the fix,
    instead of failing in torch's shape checks or computing with nothing. At the copy's root it is also the
    state-dict hook: ``best = copy.deepcopy(model); torch.save(best.state_dict(), ...)`` would save 0-element
    tensors (a forward pre-hook takes ``(module, args)``, a state-dict post-hook four arguments)."""

    __slots__ = ("numels", "made")

    #: what the copy was made of (stage 3's released units; stages 1-2's update running behind step())
    STAGE3 = "a ZeRO stage-3 model made while its parameters were released"
    BEHIND = ("a model trained with update_behind=True, made while the all-gather of the updated parameters ran "
              "behind step() (until each module's next forward)")

    def __init__(self, numels: tuple, made: str = STAGE3) -> None:
        self.numels = numels
        self.made = made

    def __call__(self, module, *args) -> None:
        numels = dict(self.numels)
        for name, p in module.named_parameters():
            if p.numel() == 0 and numels.get(name, 0) > 0:
                raise RuntimeError(
                    f"this module is a copy (copy.deepcopy, swa_utils.AveragedModel, torch.save(model)) of "
                    f"{self.made}: parameter {name!r} is an empty placeholder. Make the copy inside "
                    "`with optimizer.full_parameters():` (every rank enters it)")
        return None

    def __reduce__(self):
        return ReleasedCopyCheck, (self.numels, self.made)


def call_only(fn: Callable, *hook_args) -> None:
    """``ModelHook(call_only, fn)``: a module hook that calls ``fn()`` whatever the hook is given."""
    fn()
