"""Code around ``step()`` that reads ``.grad``: an optimizer wrapping this one (timm's ``Lookahead``, SAM) or a
subclass's ``step()`` override (gradient centralization). At stages 2-3 ``.grad`` is None after backward (the
averaged gradients live in the shards), so such code finds no gradient for any parameter and, silently, does
nothing: Lookahead never averages (``if p.grad is None: continue``), SAM never puts the weights back before the
update, a gradient edit changes nothing. ``step()`` refuses it instead (``grad_reader_around_step``).

What counts: the methods on the call stack above ``step()`` whose ``self`` is a ``torch.optim.Optimizer`` (the
wrapper, or this optimizer through a subclass), outside torch and fused_zero, and what they call by
``self.name`` or by a module-level name, read from their bytecode once per code object (not run): an
attribute load of ``grad`` (``p.grad``; not ``torch.autograd.grad``).
"""
from __future__ import annotations

import dis
import sys
import types

import torch

from .user_frames import library_module

_DEPTH = 16  # frames looked at above step()
_READS: dict = {}  # code object -> whether it (or what it calls) loads .grad


def _callees(code, cls: type | None, g: dict):
    """The Python functions ``code`` names as ``self.name`` (a method of ``cls``) or as a global of its module."""
    before = None
    for ins in dis.get_instructions(code):
        fn = None
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and cls is not None and before is not None \
                and before.opname in ("LOAD_FAST", "LOAD_FAST_CHECK") and before.argval == "self":
            fn = getattr(cls, ins.argval, None)
        elif ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            fn = g.get(ins.argval)
        if isinstance(fn, (staticmethod, classmethod)):
            fn = fn.__func__
        fn = getattr(fn, "__wrapped__", fn)  # @torch.no_grad() and functools.wraps decorators
        if isinstance(fn, types.FunctionType) and not library_module(getattr(fn, "__module__", "") or ""):
            yield fn.__code__, fn.__globals__
        before = ins


def _loads_grad(code) -> bool:
    """``code`` itself, its nested code (comprehensions, lambdas) included, loads an attribute ``grad``."""
    before = None
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and ins.argval == "grad" \
                and not (before is not None and before.argval == "autograd"):
            return True
        before = ins
    return any(_loads_grad(c) for c in code.co_consts if isinstance(c, types.CodeType))


def _reads_grad(code, cls: type | None, g: dict) -> bool:
    found = _READS.get(code)
    if found is None:
        _READS[code] = False  # (recursion)
        found = _loads_grad(code) or any(_reads_grad(c, cls, cg) for c, cg in _callees(code, cls, g))
        _READS[code] = found
    return found


def grad_reader_around_step() -> str | None:
    """The refusal if a method on the stack above ``step()`` (see the module's doc) reads ``.grad``."""
    frame = sys._getframe(1)
    for _ in range(_DEPTH):
        frame = frame.f_back
        if frame is None:
            return None
        code = frame.f_code
        if not code.co_argcount or code.co_varnames[0] != "self" or library_module(frame.f_globals.get("__name__", "")):
            continue
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.optim.Optimizer) and _reads_grad(code, type(owner), frame.f_globals):
            where = f"{type(owner).__name__}.{code.co_name}"
            return (f"{where} (around ShardedOptimizer.step()) reads .grad, but at ZeRO stages 2-3 .grad is None "
                    "after backward (the averaged gradients live in the optimizer's shards): it would find no "
                    "gradient for any parameter and do nothing, silently (timm's Lookahead would never average, "
                    "SAM would step from the perturbed weights, a gradient edit in a step() override would change "
                    "nothing). Use stage=1, whose .grad is each rank's local gradient after backward (averaged at "
                    "step()); or do without the wrapper. For SAM at stages 2-3: run the first backward under "
                    "optimizer.no_sync() and average its .grad yourself (torch.distributed.all_reduce), perturb and "
                    "restore the weights under torch.no_grad() (at stage 3 inside "
                    "optimizer.full_parameters(writeback=True)), then backward and step() as usual")
    return None
