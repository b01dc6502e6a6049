"""Which watched models had a parameter, buffer or submodule registered anew since their optimizer last looked.

An optimizer given the model refuses a model whose parameters were replaced by new ``nn.Parameter`` objects
(``model_guard.ModelGuard``): it would train the old tensors while backward reaches the new
ones. Looking at every parameter each step costs a dict lookup per hop per parameter; instead torch's global
registration hooks (``register_module_parameter_registration_hook``, and the module and buffer ones, which
``Module.__setattr__``, ``register_parameter``, ``remove_parametrizations`` and ``load_state_dict(assign=True)``
call: a parametrization removed under ``torch.no_grad()`` leaves a buffer where the parameter was) mark the
optimizers watching the module registered on, and only a marked optimizer compares every parameter at its next
check. A hook costs one weak-dictionary lookup per registration anywhere in the process.
What bypasses registration (``module._parameters[k] = p``, as ``Module._apply`` does in ``to_empty()``) is seen
only where it replaced a param group's first or last parameter (the optimizer looks at those every step).

Registrations may come from any thread (a model built in a data-loading thread): one lock guards the table.
"""
from __future__ import annotations

import threading
import weakref

from torch import nn
from torch.nn.modules import module as _module

# each watched module -> the Watchers of the optimizers watching it (both weakly: the watch keeps neither alive)
_owners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.RLock()  # (re-entrant: a finalizer run by the collector inside it may register a module)
_installed = False


class Watcher:
    """An owner's flag: ``changed`` is set True by a registration on one of the modules it watches (the owner
    holds it, and clears it when it has looked)."""

    __slots__ = ("changed", "__weakref__")

    def __init__(self) -> None:
        self.changed = False


def watch(model: nn.Module, watcher: Watcher) -> None:
    """From now on a parameter or submodule registered on any module of ``model`` (as it is now) sets
    ``watcher.changed``. Call again after the model gained modules, to watch them too."""
    global _installed
    modules = list(model.modules())
    with _lock:
        if not _installed:
            _module.register_module_parameter_registration_hook(_registered)
            _module.register_module_module_registration_hook(_registered)
            _module.register_module_buffer_registration_hook(_registered)
            _installed = True
        for m in modules:
            owners = _owners.get(m)
            if owners is None:
                owners = _owners[m] = weakref.WeakSet()
            owners.add(watcher)


def unwatch(model: nn.Module, watcher: Watcher) -> None:
    """``watcher`` no longer hears of ``model``'s registrations (its owner closed)."""
    modules = list(model.modules())
    with _lock:
        for m in modules:
            owners = _owners.get(m)
            if owners is not None:
                owners.discard(watcher)


def _registered(module: nn.Module, name: str, value) -> None:
    # torch calls this before it registers ``value`` as ``module.<name>``; it must never raise
    try:
        with _lock:
            owners = _owners.get(module)
            watchers = list(owners) if owners else ()
    except Exception:  # an unhashable module (a subclass defining __eq__ without __hash__), or worse: tell everyone
        try:
            with _lock:
                watchers = [w for owners in list(_owners.values()) for w in list(owners)]
        except Exception:
            watchers = ()
    for watcher in watchers:
        watcher.changed = True
    return None
