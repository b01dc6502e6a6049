"""Detect the habits of torch, DDP and FSDP users that a sharded optimizer cannot serve.

Each check returns a message naming the fix, or None; the optimizer raises it on
every rank. They run once (at the first backward or step), never per step.
"""
from __future__ import annotations

import gc
import os
import sys

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
                    "L.Trainer(strategy=fused_zero.integrations.lightning.ZeroStrategy(stage=...)), or "
                    "fused_zero.integrations.accelerate.ZeroAccelerator in place of accelerate.Accelerator")
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


def lightning_without_strategy(params: list[torch.nn.Parameter], module=None) -> str | None:
    """A message if ``params`` belong to a LightningModule that a Lightning Trainer runs with a
    strategy other than ``fused_zero.integrations.lightning.ZeroStrategy``.

    Lightning's own strategies clip ``.grad`` (None at stages 2-3), accumulate with DDP's
    ``no_sync``, never call the module's forward (stage 3 gathers around it) and save
    ``optimizer.state_dict()`` on one rank (it is collective): each would train silently wrong
    or hang. Costs nothing unless lightning is imported; then one scan of the garbage
    collector's objects, once, when the optimizer is built.
    """
    classes = tuple(getattr(sys.modules[name], "LightningModule", None) for name in ("lightning.pytorch",
                    "pytorch_lightning") if name in sys.modules)
    classes = tuple(c for c in classes if isinstance(c, type))
    if not classes:
        return None
    mine = {id(p) for p in params}
    found = [module] if isinstance(module, classes) else \
        [obj for obj in gc.get_objects() if isinstance(obj, classes)
         and any(id(p) in mine for p in obj.parameters())]
    for lm in found:
        trainer = lm.__dict__.get("_trainer")
        strategy = getattr(trainer, "strategy", None)
        if trainer is not None and not getattr(strategy, "_fused_zero_strategy", False):
            return (f"a Lightning Trainer with {type(strategy).__name__} fits this LightningModule: Lightning's own "
                    "strategies clip and accumulate through .grad and DDP, never call forward (stage 3 gathers "
                    "there) and save the optimizer's (collective) state_dict on one rank, so a ShardedOptimizer "
                    "would train wrong. Use L.Trainer(strategy=fused_zero.integrations.lightning.ZeroStrategy("
                    "stage=...)) and return torch.optim.AdamW (or Adam) from configure_optimizers: the strategy "
                    "builds the ShardedOptimizer")
    return None


def framework_without_integration(optimizer) -> str | None:
    """A message if a plain HF Trainer or accelerate.Accelerator drives ``optimizer``.

    Trainer clips through ``accelerator.clip_grad_norm_(model.parameters())``, i.e. over ``.grad``
    (each rank's local gradient at stage 1, None at stages 2-3: nothing is clipped), and Accelerate's
    ``clip_grad_norm_`` does the same: both would train silently wrong. ZeroTrainer and
    ZeroAccelerator route them through the optimizer. Costs nothing unless transformers or
    accelerate is imported; then one scan of the garbage collector's objects, once.
    """
    trainer_mod, acc_mod = sys.modules.get("transformers"), sys.modules.get("accelerate")
    trainer_cls = getattr(sys.modules.get("transformers.trainer"), "Trainer", None) if trainer_mod else None
    acc_cls = getattr(acc_mod, "Accelerator", None) if acc_mod else None
    if trainer_cls is None and acc_cls is None:
        return None
    classes = tuple(c for c in (trainer_cls, acc_cls) if isinstance(c, type))

    def drives(obj) -> bool:
        opts = [getattr(obj, "optimizer", None)] + list(getattr(obj, "_optimizers", ()) or ())
        for opt in opts:
            for _ in range(4):  # through AcceleratedOptimizer and similar wrappers
                if opt is optimizer:
                    return True
                opt = getattr(opt, "optimizer", None)
        return False

    for obj in gc.get_objects():
        if isinstance(obj, classes) and not getattr(type(obj), "_fused_zero_integration", False) and drives(obj):
            if trainer_cls is not None and isinstance(obj, trainer_cls):
                return ("a plain transformers.Trainer drives this ShardedOptimizer: Trainer clips .grad "
                        "(None at stages 2-3, each rank's own at stage 1) and accumulates with DDP, so it would "
                        "train silently wrong. Use fused_zero.integrations.transformers.ZeroTrainer(..., "
                        "zero=fused_zero.ZeroConfig(stage=...)) (it builds the optimizer from TrainingArguments)")
            return ("a plain accelerate.Accelerator prepared this ShardedOptimizer: its clip_grad_norm_ clips .grad "
                    "(None at stages 2-3) and its no_sync does not reach the optimizer. Use "
                    "fused_zero.integrations.accelerate.ZeroAccelerator(zero=fused_zero.ZeroConfig(stage=...)) "
                    "in place of Accelerator, and pass it the model with a torch.optim.AdamW")
    return None
