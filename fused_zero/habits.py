"""Detect the habits of torch, DDP and FSDP users that a sharded optimizer cannot serve.

Each check returns a message naming the fix, or None; the optimizer raises it on
every rank. They run once (at the first backward or step), never per step.
"""
from __future__ import annotations

import gc
import os

import torch


def ddp_wrapping(params: list[torch.nn.Parameter]) -> str | None:
    """A message if a live DistributedDataParallel reduces any of ``params``.

    One scan of the garbage collector's objects for DDP instances (done once, and
    only where several ranks run): DDP keeps the parameters it reduces in
    ``_module_parameters``.
    """
    ddp_type = torch.nn.parallel.DistributedDataParallel
    mine = {id(p) for p in params}
    for obj in gc.get_objects():
        if isinstance(obj, ddp_type) and any(id(p) in mine for p in getattr(obj, "_module_parameters", ())):
            return ("the model is wrapped in DistributedDataParallel: do not wrap the model in "
                    "DistributedDataParallel, ShardedOptimizer averages gradients itself (DDP would reduce "
                    "them a second time and fight over .grad). Pass the bare model. HF Trainer, Lightning "
                    "and Accelerate wrap it in DDP themselves: use their fused_zero integration instead, "
                    "fused_zero.integrations.transformers.ZeroTrainer, "
                    "L.Trainer(strategy=fused_zero.integrations.lightning.ZeroStrategy(stage=...)), or the "
                    "Accelerate recipe (fused_zero.integrations.accelerate; do not pass the model to "
                    "accelerator.prepare)")
    return None


def torchrun_without_process_group() -> str | None:
    """A message if a launcher started several ranks but no process group is initialised."""
    world = os.environ.get("WORLD_SIZE", "1")
    try:
        many = int(world) > 1
    except ValueError:
        return None
    if many:
        return (f"WORLD_SIZE={world} (torchrun or another launcher started {world} ranks) but torch.distributed "
                "is not initialised, so every rank would train alone on its own data: call "
                "torch.distributed.init_process_group() before building the optimizer (or pass process_group=)")
    return None
