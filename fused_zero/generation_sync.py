"""Stage 3 among ranks: transformers' ``generate()`` keeps the ranks in step, as it does under FSDP.

Each generated token is a forward, and every stage-3 forward gathers: ranks whose sequences end at different
lengths (one reaches EOS first) would stop making the gathers the others wait in. transformers keeps the ranks in
step (``synced_gpus``: a rank that is done runs dummy forwards until every rank is) where the model is sharded by
DeepSpeed ZeRO-3 or FSDP, which it recognises by ``is_fsdp_managed_module(model)``: the model's
``_is_fsdp_managed_module`` attribute, set by its own FSDP2 path. A stage-3 optimizer over several ranks gives each
module of the model that generates that attribute, with a value that is true only

- when transformers' generation code asks (``is_fsdp_managed_module`` called from ``transformers.generation``,
  ``trainer_seq2seq`` or a model's own code): torch.compile's Dynamo, which reads the same attribute to treat a
  module as FSDP's, and Trainer's FSDP-only paths see false;
- while the model's forwards gather: not inside ``full_parameters()`` (a generate() there, on one rank alone to
  log samples, gathers nothing and must not wait for the others), not after ``close()``;
- on the model itself: a deep copy (an EMA teacher, TRL's reference model) or a pickled one gets ``False``.

So a ``generate()`` that passes no ``synced_gpus`` (TRL's GRPO, a callback, the user's own loop) syncs where it
must; ``close()`` removes the attribute.
"""
from __future__ import annotations

import sys
import weakref

from torch import nn

MARK = "_is_fsdp_managed_module"
_ASKERS = ("transformers.generation", "transformers.trainer_seq2seq", "transformers.models")


class _GatheringForGeneration:
    """The attribute's value: true while the gatherer gathers and transformers' generation code asks."""

    __slots__ = ("_gatherer", "__weakref__")

    def __init__(self, gatherer) -> None:
        self._gatherer = weakref.ref(gatherer)

    def __bool__(self) -> bool:
        gatherer = self._gatherer()
        if gatherer is None or gatherer._closed or gatherer._holding:
            return False
        return _asked_by_generation(sys._getframe(1))

    def __deepcopy__(self, memo) -> bool:
        return False  # a copy of the model is a plain model: its forwards gather nothing

    def __reduce__(self):
        return bool, ()  # (pickled: False)

    def __repr__(self) -> str:
        return "<fused_zero stage 3: transformers' generate() syncs the ranks>"


def _asked_by_generation(frame) -> bool:
    """Whether ``frame`` is transformers' ``is_fsdp_managed_module`` called from its generation code."""
    if frame is None or frame.f_code.co_name != "is_fsdp_managed_module" or \
            not str(frame.f_globals.get("__name__", "")).startswith("transformers"):
        return False
    caller = frame.f_back
    return caller is not None and str(caller.f_globals.get("__name__", "")).startswith(_ASKERS)


def _generates(module: nn.Module) -> bool:
    return any(c.__name__ == "GenerationMixin" and c.__module__.startswith("transformers")
               for c in type(module).__mro__)


def mark_generation_synced(root: nn.Module, gatherer) -> list[nn.Module]:
    """Give every module of ``root`` that generates (transformers' ``GenerationMixin``) and has no such attribute
    yet the gatherer's value; returns those marked here."""
    marked = []
    for module in root.modules():
        if _generates(module) and MARK not in module.__dict__:
            module.__dict__[MARK] = _GatheringForGeneration(gatherer)
            marked.append(module)
    return marked


def unmark_generation_synced(marked: list[nn.Module]) -> None:
    for module in marked:
        if isinstance(module.__dict__.get(MARK), _GatheringForGeneration):
            del module.__dict__[MARK]
