"""Accelerate with fused_zero: ``ZeroAccelerator`` in place of ``Accelerator``, the loop unchanged.

    from fused_zero.integrations.accelerate import ZeroAccelerator

    accelerator = ZeroAccelerator(zero=fused_zero.ZeroConfig(stage=2), gradient_accumulation_steps=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)         # as usual
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model(batch)))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
    accelerator.save_state("ckpt")  /  accelerator.load_state("ckpt")

What it changes, against a plain Accelerator (which wraps the model in DDP: fused_zero refuses
that at the first backward, since the optimizer averages gradients itself):
- ``prepare(model)`` places the model (skipped when it is already on the device, so parameters
  are never copied) and applies mixed precision and compilation, but never wraps it in DDP.
- ``prepare(optimizer)`` turns a torch.optim.AdamW or Adam into a fused_zero.ShardedOptimizer
  over the same param groups and hyperparameters (stage 3 gets the model prepared with it),
  and re-points the schedulers prepared with it; other optimizer classes are refused.
- ``accumulate(model)`` / ``no_sync(model)`` keep gradients local through the optimizer's
  ``no_sync()`` until the last micro-batch; ``clip_grad_norm_`` clips the global norm of the
  averaged gradients through the optimizer, and ``clip_grad_value_`` clamps their elements there.
- ``save_state`` / ``load_state`` write and read the models and optimizers as a
  fused_zero.checkpoint (``<dir>/fused_zero``: sharded, loadable at any world size and stage);
  schedulers, samplers, RNG states, the scaler and registered objects are Accelerate's as usual.
  ``get_state_dict`` / ``save_model`` gather the full model at stage 3 (every rank calls them).
  Hooks registered with ``register_save_state_pre_hook`` / ``register_load_state_pre_hook``
  run as in Accelerate, over the models Accelerate itself saves (not the sharded ones).

DeepSpeed, FSDP, Megatron-LM and XLA plugins are refused: fused_zero takes their place.
"""
from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from ..checkpoint.files import FRAMEWORK_DIR
from ..comm.collectives import default_world_size
from ..config import ZeroConfig
from ..joint_clip import clip_grad_norm_ as joint_clip_grad_norm_
from ..lifecycle import setting
from ..optimizer import ShardedOptimizer
from . import require
from ._torch_optim import check_convertible, repoint_scheduler, sharded_from_torch, unwrap_optimizer

_accelerate = require("accelerate", "hf")
Accelerator = _accelerate.Accelerator
DistributedType = _accelerate.utils.DistributedType


_REFUSED = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")


def _same_device(model: nn.Module, device: torch.device) -> bool:
    """Whether every parameter already lives on ``device`` (cpu and cpu:0 are the same memory)."""
    def norm(d: torch.device):
        return (d.type, d.index if d.index is not None else (0 if d.type == "cpu" else None))

    want = norm(torch.device(device))
    devices = {norm(t.device) for t in list(model.parameters()) + list(model.buffers())}
    if want[0] != "cpu" and want[1] is None and torch.cuda.is_available():
        want = (want[0], torch.cuda.current_device())
    return not devices or devices == {want}


def checkpoint_dir(output_dir: str, index: int) -> str:
    return os.path.join(output_dir, FRAMEWORK_DIR if index == 0 else f"{FRAMEWORK_DIR}_{index}")


class _ZeroAcceleratedOptimizer(_accelerate.optimizer.AcceleratedOptimizer):
    """Accelerate's optimizer wrapper, told by the ShardedOptimizer whether a GradScaler's step was skipped.

    Accelerate takes a step as skipped when ``scaler.step`` did not call ``optimizer.step``; a ShardedOptimizer
    (as torch's fused AdamW) takes the scale and the overflow verdict on the device, so the scaler always calls
    it and the skip happens inside: HF Trainer, which steps its scheduler only after a step that was not
    skipped, moved the schedule on through every overflow."""

    @property
    def step_was_skipped(self):
        if self.scaler is not None and isinstance(self.optimizer, ShardedOptimizer):
            return self.optimizer.last_step_overflowed()
        return self._is_overflow


def _told_of_skips(prepared):
    """``prepared`` (Accelerate's wrapper of a ShardedOptimizer) as a ``_ZeroAcceleratedOptimizer``."""
    if type(prepared) is _accelerate.optimizer.AcceleratedOptimizer:
        prepared.__class__ = _ZeroAcceleratedOptimizer
    return prepared


class ZeroAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` whose optimizer is a fused_zero.ShardedOptimizer (no DDP).

    Takes Accelerator's arguments plus ``zero=fused_zero.ZeroConfig(...)`` (stage, bucket size,
    offload, ...; ``max_grad_norm`` is left to ``clip_grad_norm_``).
    """

    def __init__(self, *args, zero: ZeroConfig | None = None, **kwargs) -> None:
        if zero is None:
            zero = ZeroConfig()
        if not isinstance(zero, ZeroConfig):
            raise TypeError(f"zero= must be a fused_zero.ZeroConfig, got {type(zero).__name__}")
        super().__init__(*args, **kwargs)
        kind = str(self.distributed_type).split(".")[-1]
        if kind in _REFUSED:
            raise ValueError(f"ZeroAccelerator runs fused_zero's ZeRO instead of Accelerate's {kind} plugin: remove "
                             f"the {kind.lower()} settings from the accelerate config (or use a plain Accelerator)")
        ranks = default_world_size()
        if ranks > 1 and self.num_processes == 1:  # the same on every rank: refused on all, before any collective
            raise ValueError(
                f"Accelerate sees one process (distributed_type {kind}) while torch.distributed runs {ranks} ranks: "
                "each rank would load all the data and act as the main process (both saving), while fused_zero "
                f"averages over {ranks}. On CPU pass cpu=True (ZeroAccelerator(..., cpu=True): Accelerate takes its "
                "multi-process CPU path only with it), or launch with `accelerate launch` and its config")
        if getattr(self, "parallelism_config", None) is not None and getattr(self.parallelism_config,
                                                                             "tp_enabled", False):
            raise ValueError("ZeroAccelerator shards over the data-parallel ranks only: tensor parallelism "
                             "(parallelism_config with tp_size > 1) is not supported")
        self.zero = zero
        self._zero_pairs: list[tuple[nn.Module, ShardedOptimizer]] = []
        self._replaced: list[tuple[torch.optim.Optimizer, ShardedOptimizer]] = []  # (torch optimizer, its successor)
        self._preparing: list[nn.Module] = []

    # -- prepare ------------------------------------------------------------
    def prepare(self, *args, device_placement=None):
        # models first: a stage-3 optimizer shards the model where it will live
        self._preparing = [a for a in args if isinstance(a, nn.Module)]
        for a in args:
            if isinstance(a, torch.optim.Optimizer):
                check_convertible(unwrap_optimizer(a), "ZeroAccelerator.prepare")
        try:
            return super().prepare(*args, device_placement=device_placement)
        finally:
            self._preparing = []

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError("ZeroAccelerator got a model wrapped in DistributedDataParallel: pass the bare model "
                             "(fused_zero's optimizer averages the gradients itself)")
        if getattr(model, "_is_accelerate_prepared", False):
            return super().prepare_model(model, device_placement, evaluation_mode=True)
        if device_placement is None:
            device_placement = self.device_placement and not _same_device(model, self.device)
        if device_placement and any(self._owner(p) is not None for p in model.parameters()):
            raise RuntimeError("this model's parameters already belong to a ShardedOptimizer, so moving them to "
                               f"{self.device} would detach them: move the model to accelerator.device before "
                               "building the optimizer, or pass it to prepare() together with a torch optimizer")
        # evaluation_mode=True: device placement, mixed precision and compilation, but no DDP
        prepared = super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        self._pair_late(prepared)
        return prepared

    def _pair_late(self, model: nn.Module) -> None:
        """An optimizer prepared in a call before its model's (``opt = acc.prepare(opt); model = acc.prepare(model)``,
        stages 1-2) is paired with the model now: ``save_state``/``load_state`` need it (stage 3 refuses that order
        at the optimizer's prepare, where the model is needed to shard)."""
        inner = self.unwrap_model(model, keep_torch_compile=False)
        held = None
        for i, (m, opt) in enumerate(self._zero_pairs):
            if m is None and not opt.closed:
                held = set(inner.parameters()) if held is None else held
                if all(p in held for g in opt.param_groups for p in g["params"]):
                    self._zero_pairs[i] = (inner, opt)

    def _owner(self, p) -> ShardedOptimizer | None:
        return next((opt for _, opt in self._zero_pairs if opt.owns(p)), None)

    def _module_for(self, optimizer) -> nn.Module | None:
        """The model (prepared, or being prepared with it) that holds ``optimizer``'s parameters."""
        params = {p for g in optimizer.param_groups for p in g["params"]}
        for m in list(self._models) + self._preparing:
            inner = self.unwrap_model(m, keep_torch_compile=False)
            if params <= set(inner.parameters()):
                if m in self._preparing and not getattr(m, "_is_accelerate_prepared", False):
                    self.prepare_model(m)  # placed before its parameters are laid out
                return inner
        return None

    def prepare_optimizer(self, optimizer, device_placement=None):
        if getattr(optimizer, "_is_accelerate_prepared", False):
            # prepared before (HF Trainer's second train() prepares its optimizer again after free_memory()): its
            # ShardedOptimizer is this accelerator's again, or clipping, no_sync and saves would pass it by
            inner = unwrap_optimizer(optimizer)
            if isinstance(inner, ShardedOptimizer) and not any(o is inner for _, o in self._zero_pairs):
                self._adopt(inner, self._module_for(inner))
            return _told_of_skips(super().prepare_optimizer(optimizer, device_placement))
        inner = unwrap_optimizer(optimizer)
        check_convertible(inner, "ZeroAccelerator.prepare")
        module = self._module_for(inner)
        if isinstance(inner, ShardedOptimizer):
            sharded = inner
        else:
            if module is None and self.zero.needs_module:
                raise ValueError("stage 3 shards the model's parameters: pass the model to the same "
                                 "accelerator.prepare() call as its optimizer, or prepare the model first")
            sharded = sharded_from_torch(inner, self.zero, module)
            self._replaced.append((inner, sharded))
        self._adopt(sharded, module)
        # device_placement=False: the state is already where the parameters are (and is empty)
        return _told_of_skips(super().prepare_optimizer(sharded, device_placement=False))

    def _adopt(self, sharded: ShardedOptimizer, module: nn.Module | None) -> None:
        """``sharded`` is this accelerator's: stepped through the integration (fused_zero.habits), paired with
        the model that holds its parameters."""
        sharded.mark_integrated()
        self._zero_pairs.append((module if module is not None else sharded.module, sharded))

    def prepare_scheduler(self, scheduler):
        for old, new in self._replaced:
            repoint_scheduler(scheduler, old, new)
        return super().prepare_scheduler(scheduler)

    # -- the training loop ------------------------------------------------------
    def _sharded(self, model=None) -> list[ShardedOptimizer]:
        """The open ShardedOptimizers prepared here (of ``model``); one a newer optimizer over the same model took
        over is closed, and steps aside."""
        if model is None:
            return [opt for _, opt in self._zero_pairs if not opt.closed]
        inner = self.unwrap_model(model, keep_torch_compile=False)
        return [opt for m, opt in self._zero_pairs if (m is inner or m is None) and not opt.closed]

    def free_memory(self, *objects):
        """Accelerate's, and fused_zero's own references to what was prepared: the next ``prepare`` starts afresh
        (its ``save_state`` numbered the new model's checkpoint after the old one's, and ``load_state`` loaded the
        old one into it)."""
        self._zero_pairs.clear()
        self._replaced.clear()
        return super().free_memory(*objects)

    @contextlib.contextmanager
    def no_sync(self, model):
        with contextlib.ExitStack() as stack:
            for opt in self._sharded(model):
                stack.enter_context(opt.no_sync())
            yield

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model):
        """Inside ``no_sync(model)``: the backward run in this block reduces the gradients accumulated so far with
        its own, as Accelerate's does for DDP (Accelerate's own passes over a model that is not DDP)."""
        with contextlib.ExitStack() as stack:
            for opt in self._sharded(model):
                stack.enter_context(setting(opt.grad_sync, "sync", True))
            yield

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The global norm of the averaged gradients, clipped in the next step (every rank calls it); over the
        parameters of several ShardedOptimizers (two models prepared together), one norm over all of them, as
        torch's clip over their parameters."""
        params = [p for p in parameters] if not isinstance(parameters, torch.Tensor) else [parameters]
        opts = self._clipping_owners(params, "clip_grad_norm_", "clips the global norm of all of them together")
        if not opts:
            return super().clip_grad_norm_(params, max_norm, norm_type)
        self.unscale_gradients()
        return opts[0].clip_grad_norm_(max_norm, norm_type) if len(opts) == 1 else \
            joint_clip_grad_norm_(opts, max_norm, norm_type)

    def clip_grad_value_(self, parameters, clip_value):
        """Each element of the averaged gradients clamped in the next step (every rank calls it)."""
        params = [p for p in parameters] if not isinstance(parameters, torch.Tensor) else [parameters]
        opts = self._clipping_owners(params, "clip_grad_value_", "clamps every gradient it holds")
        if not opts:
            return super().clip_grad_value_(params, clip_value)
        self.unscale_gradients()
        for opt in opts:
            opt.clip_grad_value_(clip_value)

    def _clipping_owners(self, params: list, name: str, what: str) -> list:
        """The ShardedOptimizers holding ``params`` (none: []), given all of each one's parameters and none with a
        gradient that none of them holds; ValueError naming the fix otherwise."""
        owners = list({id(o): o for o in (self._owner(p) for p in params) if o is not None}.values())
        given = {p for p in params if p.requires_grad}
        for opt in owners:
            if not {p for g in opt.param_groups for p in g["params"] if p.requires_grad} <= given:
                raise ValueError(f"{name} got only part of a ShardedOptimizer's parameters: it {what} (the "
                                 "gradients live as shards inside the optimizer); pass model.parameters()")
        stray = [p for p in params if p.grad is not None and self._owner(p) is None]
        if owners and stray:  # torch would clip their gradients too; the optimizer's clip cannot
            raise ValueError(f"{name} got {len(stray)} parameters with a gradient that the ShardedOptimizer "
                             "does not hold (shapes " + ", ".join(str(tuple(p.shape)) for p in stray[:4]) + "): its "
                             "clip covers the optimizer's gradients only, and no DDP averages theirs across ranks. "
                             "Pass the optimizer's parameters only, or freeze the others (requires_grad_(False)) "
                             "before backward")
        return owners

    # -- the model's weights and checkpoints ----------------------------------------
    def get_state_dict(self, model, unwrap: bool = True):
        """The model's full state dict; at stage 3 gathered, so every rank calls it (as with DeepSpeed
        ZeRO-3). ``save_model`` goes through here too."""
        sharded = self._sharded(model)
        if not sharded:
            return super().get_state_dict(model, unwrap)
        stage3 = [opt for opt in sharded if opt.config.needs_module]
        with stage3[0].full_parameters() if stage3 else contextlib.nullcontext(), \
                stage3[0]._state_dict_views() if stage3 else contextlib.nullcontext():
            return _apart(super().get_state_dict(model, unwrap))  # (copies made once, by _apart)

    # -- checkpoints ------------------------------------------------------------
    def _without_sharded(self):
        """Accelerate's own save/load, minus the models and optimizers fused_zero checkpoints."""
        sharded_models = {id(m) for m, _ in self._zero_pairs if m is not None}
        sharded_opts = {id(o) for _, o in self._zero_pairs}
        models, opts = self._models, self._optimizers

        @contextlib.contextmanager
        def swap():
            self._models = [m for m in models
                            if id(self.unwrap_model(m, keep_torch_compile=False)) not in sharded_models]
            self._optimizers = [o for o in opts if id(unwrap_optimizer(o)) not in sharded_opts]
            try:
                yield
            finally:
                self._models, self._optimizers = models, opts

        return swap()

    def end_training(self):
        """Accelerate's, after closing this accelerator's ShardedOptimizers: ``end_training()`` destroys the process
        group, after which a stage-3 model's shards could never be gathered again (its parameters stayed
        0-element placeholders); closed first, the model holds its full weights, as a DDP model does, for the
        ``unwrap_model(model).save_pretrained(...)`` that scripts run after it (HF Trainer's ``end()`` calls this
        too). Collective at stage 3: every rank calls it, as it does Accelerate's."""
        for opt in self._sharded():
            opt.close()
        return super().end_training()

    def _checkpoint_pairs(self):
        pairs = []
        for model, opt in self._zero_pairs:
            if opt.closed:  # a newer optimizer over the same model took over
                continue
            if model is None:
                raise RuntimeError("save_state/load_state need the model of each ShardedOptimizer: pass the model "
                                   "to accelerator.prepare() together with its optimizer")
            pairs.append((model, opt))
        return pairs

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs):
        from .. import checkpoint

        pairs = self._checkpoint_pairs()
        with self._without_sharded():
            location = super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        for i, (model, opt) in enumerate(pairs):
            checkpoint.save(checkpoint_dir(location, i), model, opt, tag="state")
        self.wait_for_everyone()
        return location

    def load_state(self, input_dir: str | None = None, **kwargs):
        from .. import checkpoint

        pairs = self._checkpoint_pairs()
        with self._without_sharded():
            super().load_state(input_dir, **kwargs)
        if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
            input_dir = self._latest_checkpoint_dir()
        for i, (model, opt) in enumerate(pairs):
            folder = checkpoint_dir(input_dir, i)
            if not os.path.isdir(folder):
                raise FileNotFoundError(f"{folder} holds no fused_zero checkpoint: was {input_dir} saved by "
                                        "ZeroAccelerator.save_state with the same models?")
            checkpoint.load(folder, model, opt, tag="state")

    def _latest_checkpoint_dir(self) -> str:
        folder = os.path.join(self.project_dir, "checkpoints")
        names = sorted((n for n in os.listdir(folder) if n.startswith("checkpoint_")),
                       key=lambda n: int(n.split("_")[-1]))
        return os.path.join(folder, names[-1])


def _apart(state_dict: dict) -> dict:
    """Each tensor copied into storage of its own, tied names sharing one copy (as the model ties them). The
    parameters of stages 1-2 are views of one flat buffer, and stage 3's are gathered and released: Accelerate's
    ``save_model`` takes tensors sharing storage for tied weights and saved one of them only."""
    copies: dict = {}
    out = {}
    for k, v in state_dict.items():
        key = (v.data_ptr(), v.dtype, tuple(v.shape), tuple(v.stride()), v.device)
        if key not in copies:
            copies[key] = v.detach().clone()
        out[k] = copies[key]
    return out
