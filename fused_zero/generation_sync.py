"""Stage 3 among ranks: transformers' ``generate()`` keeps the ranks in step, as it does under FSDP.

Each generated token is a forward, and every stage-3 forward gathers: ranks whose sequences end at different
lengths (one reaches EOS first) would stop making the gathers the others wait in. transformers keeps the ranks in
step (``synced_gpus``: a rank that is done runs dummy forwards until every rank is) where the model is sharded by
DeepSpeed ZeRO-3 or FSDP, which it recognises by ``is_fsdp_managed_module(model)``: the model's
``_is_fsdp_managed_module`` attribute (set by its own FSDP2 path), read only to decide ``synced_gpus`` (in
``generate()`` and in the audio models' layer drop). A stage-3 optimizer over several ranks sets it on each module
of the model that generates, so a ``generate()`` called anywhere (TRL's GRPO and online DPO, a callback, the user's
own loop) syncs, unless the call passes ``synced_gpus`` itself; ``close()`` takes it off again.
"""
from __future__ import annotations

from torch import nn

MARK = "_is_fsdp_managed_module"


def _generates(module: nn.Module) -> bool:
    return any(c.__name__ == "GenerationMixin" and c.__module__.startswith("transformers")
               for c in type(module).__mro__)


def mark_generation_synced(root: nn.Module) -> list[nn.Module]:
    """Mark every module of ``root`` that generates (transformers' ``GenerationMixin``) and is not marked yet;
    returns those marked here."""
    marked = []
    for module in root.modules():
        if _generates(module) and not module.__dict__.get(MARK, False):
            module.__dict__[MARK] = True
            marked.append(module)
    return marked


def unmark_generation_synced(marked: list[nn.Module]) -> None:
    for module in marked:
        module.__dict__.pop(MARK, None)
