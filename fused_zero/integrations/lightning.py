"""Lightning: ``L.Trainer(strategy=ZeroStrategy(stage=2), accelerator=..., devices=N)``.

    import lightning.pytorch as L
    from fused_zero.integrations.lightning import ZeroStrategy

    trainer = L.Trainer(strategy=ZeroStrategy(stage=2), devices=2, gradient_clip_val=1.0,
                        accumulate_grad_batches=4)
    trainer.fit(model)          # configure_optimizers still returns torch.optim.AdamW (or Adam)

The LightningModule does not change: ``configure_optimizers`` keeps returning one
``torch.optim.AdamW`` or ``torch.optim.Adam`` (alone, in a list, or in a dict with an LR
scheduler). ZeroStrategy replaces it with a ``ShardedOptimizer`` over the same param groups and
hyperparameters (Adam keeps its L2 decay: ``decoupled_weight_decay=False``) and points the
schedulers at it. What DDPStrategy does by wrapping the model, the optimizer does here:

- no DistributedDataParallel: the model is wrapped in a module that only forwards, so that
  ``training_step``/``validation_step``/``predict_step`` run through the LightningModule's own
  ``__call__`` and stage 3 gathers its root parameters around them (Lightning never calls
  ``forward``);
- ``Trainer(gradient_clip_val=m)`` clips the global norm with ``optimizer.clip_grad_norm_(m)``, and
  ``gradient_clip_algorithm="value"`` each element of the averaged gradients with
  ``optimizer.clip_grad_value_(m)``;
- ``accumulate_grad_batches`` accumulates inside ``optimizer.no_sync()``;
- checkpoints (``ModelCheckpoint``, ``trainer.save_checkpoint``) hold the full model state dict
  (gathered on every rank at stage 3) and ``optimizer.state_dict()``, torch AdamW's format, so a
  checkpoint resumes with ``trainer.fit(model, ckpt_path=...)`` at any world size and stage, and
  loads into plain Lightning + ``torch.optim.AdamW``.

Process-group set-up, launchers (``devices=N`` starts the other ranks as DDP does), barriers,
``reduce`` and samplers are DDPStrategy's. Importing this module imports lightning; importing
fused_zero never does.
"""
from __future__ import annotations

import contextlib
from collections.abc import Generator, Mapping
from datetime import timedelta
from typing import Any, Literal, Optional

from torch import nn

from . import require

require("lightning.pytorch", "lightning")

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout  # noqa: E402
from lightning.pytorch.core.optimizer import LightningOptimizer  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402

from ..config import STAGE_TRAITS, ZeroConfig  # noqa: E402
from ._torch_optim import CONVERTIBLE, repoint_scheduler, sharded_from_torch  # noqa: E402
from ..optimizer import ShardedOptimizer  # noqa: E402
from ..sharding.units import check_units_form  # noqa: E402
from ..tiers.tier import Tier  # noqa: E402

__all__ = ["ZeroStrategy"]

#: ShardedOptimizer options ZeroStrategy passes through (the rest have a Lightning spelling, or
#: come from the torch optimizer).
_REFUSED_OPTIONS = {
    "stage": "pass it as ZeroStrategy(stage=...)",
    "max_grad_norm": "clip with L.Trainer(gradient_clip_val=...)",
    "adam_w_mode": "return torch.optim.AdamW (decoupled decay) or torch.optim.Adam (L2) from configure_optimizers",
    "process_group": "ZeroStrategy shards over the default process group, as DDPStrategy",
    "module": "ZeroStrategy passes the LightningModule itself",
}


def _unwrap(optimizer):
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class _ZeroModule(nn.Module):
    """Wraps the LightningModule as DDP would, but only forwards.

    Lightning reroutes ``training_step`` (and the other steps) through the wrapper's forward,
    which calls the LightningModule itself: its forward pre-hooks run, so stage 3 gathers the
    root unit around every step. The checkpoints use the LightningModule's own names.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class _ZeroClipping:
    """Mixed into the strategy's precision plugin: clipping goes through the ShardedOptimizer."""

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None) -> None:
        opt = _unwrap(optimizer)
        if not isinstance(opt, ShardedOptimizer):
            return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
        if clip_val is None or clip_val <= 0:
            return None
        if _is_value_clipping(gradient_clip_algorithm):  # the unscaled gradients, as the norm below
            opt.clip_grad_value_(float(clip_val), grad_scaler=getattr(self, "scaler", None))
            return None
        # the precision plugin's GradScaler (16-mixed): the shards stay scaled, the norm is unscaled with it
        opt.clip_grad_norm_(float(clip_val), grad_scaler=getattr(self, "scaler", None))
        return None


def _is_value_clipping(algorithm) -> bool:
    return str(getattr(algorithm, "value", algorithm)).lower() == "value"


def _averages_weights(callback) -> bool:
    """Lightning's weight-averaging callbacks (EMAWeightAveraging, StochasticWeightAveraging, and subclasses)."""
    from lightning.pytorch import callbacks
    kinds = tuple(getattr(callbacks, name) for name in ("WeightAveraging", "StochasticWeightAveraging")
                  if hasattr(callbacks, name))
    return isinstance(callback, kinds)


_PLUGIN_CLASSES: dict[type, type] = {}


def _with_zero_clipping(plugin):
    """The same precision plugin object, its class extended by _ZeroClipping (qualname kept, so the
    plugin's checkpoint key is what plain Lightning writes)."""
    cls = type(plugin)
    if issubclass(cls, _ZeroClipping):
        return plugin
    if cls not in _PLUGIN_CLASSES:
        sub = type(cls.__name__, (_ZeroClipping, cls), {"__module__": __name__})
        sub.__qualname__ = cls.__qualname__
        _PLUGIN_CLASSES[cls] = sub
    plugin.__class__ = _PLUGIN_CLASSES[cls]
    return plugin


class ZeroStrategy(DDPStrategy):
    """ZeRO stage 1, 2 or 3 with fused_zero's ShardedOptimizer, in place of DDPStrategy.

    Args:
        stage: 1 shards the optimizer states, 2 also the gradients, 3 also the parameters.
        **zero_options: ShardedOptimizer options (``bucket_numel``, ``reduce_dtype``, ``overlap``,
            ``units``, ``max_live_units``, ``min_unit_numel``, ``reshard_after_forward``, ``offload_optimizer``,
            ``offload_params``, ``nvme_path``, ``offload_chunk_numel``, ``nvme_direct``); the clip norm is
            ``Trainer(gradient_clip_val=)``.

    The remaining arguments are DDPStrategy's (``start_method``, ``timeout``, ...); DDP's own
    arguments (``find_unused_parameters``, communication hooks) have no meaning here.
    """

    strategy_name = "fused_zero"

    def __init__(self, stage: int = 2, *, accelerator=None, parallel_devices=None, cluster_environment=None,
                 checkpoint_io=None, precision_plugin=None, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout,
                 start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
                 **zero_options: Any) -> None:
        for key, why in _REFUSED_OPTIONS.items():
            if key in zero_options:
                raise ValueError(f"ZeroStrategy does not take {key}=: {why}")
        self._units = zero_options.pop("units", None)
        try:
            self._config = ZeroConfig(stage=stage, **zero_options)
        except TypeError as e:
            known = sorted(set(ZeroConfig.__dataclass_fields__) - set(_REFUSED_OPTIONS)) + ["units"]
            raise TypeError(f"ZeroStrategy got an unknown option ({e}); it takes stage= and the ShardedOptimizer "
                            f"options {', '.join(known)}") from None
        if self._units is not None and not self._config.needs_module:
            raise ValueError("units= only applies to stage 3")
        check_units_form(self._units)  # (the modules themselves are checked against the model at setup)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)

    @property
    def stage(self) -> int:
        return self._config.stage

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        # DDPStrategy's would register "ddp" & co. to this class; ZeroStrategy is passed as an instance.
        pass

    # -- set-up -----------------------------------------------------------
    def setup(self, trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_trainer(trainer)  # every rank, before any collective
        self.precision_plugin = _with_zero_clipping(self.precision_plugin)
        super().setup(trainer)

    def _check_trainer(self, trainer) -> None:
        averaging = [type(cb).__name__ for cb in trainer.callbacks if _averages_weights(cb)]
        if averaging and STAGE_TRAITS[self.stage].shards_params:
            raise RuntimeError(
                f"ZeroStrategy(stage=3) cannot serve Lightning's {', '.join(averaging)} callback: it copies the model "
                "and averages its parameters into the copy after every step, and stage 3 holds only a shard of each "
                "parameter between steps (the copy would be made of, or averaged with, empty placeholders). Use "
                "ZeroStrategy(stage=2), which keeps every parameter whole on every rank, or keep the average "
                "yourself inside `with trainer.strategy.zero_optimizer.full_parameters():` (every rank enters it; "
                "fused_zero's README, 'Habits that differ')")

    def configure_ddp(self) -> None:
        """No DistributedDataParallel: the ShardedOptimizer reduces the gradients itself."""
        self.model = _ZeroModule(self.lightning_module)

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)  # runs configure_optimizers
        optimizers = [_unwrap(o) for o in self.optimizers]
        if len(optimizers) != 1:
            raise ValueError(f"ZeroStrategy trains with exactly one optimizer, but configure_optimizers returned "
                             f"{len(optimizers)}: return one torch.optim.AdamW (or Adam) over all the parameters, "
                             "with param groups for different hyperparameters")
        old = optimizers[0]
        if isinstance(old, ShardedOptimizer):
            raise TypeError("configure_optimizers returned a ShardedOptimizer: with ZeroStrategy return the plain "
                            "torch.optim.AdamW (or Adam) and pass the ZeRO options to ZeroStrategy(stage=..., ...); "
                            "the strategy builds the ShardedOptimizer")
        if type(old) not in CONVERTIBLE:
            raise TypeError(f"ZeroStrategy replaces torch.optim.AdamW or torch.optim.Adam, but configure_optimizers "
                            f"returned {type(old).__module__}.{type(old).__qualname__}: return one of those (or use "
                            "another strategy for other optimizers)")
        if old.state:
            raise ValueError("the optimizer from configure_optimizers already has state (it was stepped): "
                             "return a fresh optimizer; to resume, use trainer.fit(model, ckpt_path=...)")
        new = sharded_from_torch(old, self._config, self.lightning_module, units=self._units)
        for config in self.lr_scheduler_configs:
            repoint_scheduler(config.scheduler, old, new)
        self.optimizers = [new]

    @property
    def zero_optimizer(self) -> Optional[ShardedOptimizer]:
        """The ShardedOptimizer this strategy built (None before fit's set-up)."""
        for opt in self.optimizers:
            opt = _unwrap(opt)
            if isinstance(opt, ShardedOptimizer):
                return opt
        return None

    # -- accumulation -----------------------------------------------------
    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator:
        """Lightning's accumulation (and ``toggle_model(sync_grad=False)``): the optimizer's no_sync."""
        opt = self.zero_optimizer
        if opt is None:
            yield None
            return
        with opt.no_sync():
            yield None

    # -- checkpoints --------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full state dict on every rank (at stage 3 gathered: a collective, as dump_checkpoint runs on all)."""
        opt = self.zero_optimizer
        module = self.lightning_module
        if opt is None or not opt.config.needs_module or opt.closed:  # closed after fit: full parameters again
            return module.state_dict()
        with opt.full_parameters():  # the parameters' entries are copies (they outlive the block)
            return module.state_dict()

    def optimizer_state(self, optimizer) -> dict:
        """``optimizer.state_dict()``: torch AdamW's format, whole, on every rank (collective)."""
        opt = _unwrap(optimizer)
        if opt.closed and opt.state_tier is Tier.NVME:
            raise RuntimeError("the fit ended and the ShardedOptimizer removed its NVMe scratch files: save "
                               "checkpoints during fit (ModelCheckpoint, or trainer.save_checkpoint in a callback)")
        return opt.state_dict()  # after fit too: the closed optimizer still holds its shards

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Every rank loads the whole dict (any world size or stage wrote it; plain AdamW's too)."""
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ValueError(f"the checkpoint holds {len(states)} optimizer states; ZeroStrategy has "
                             f"{len(self.optimizers)} optimizer")
        for optimizer, state in zip(self.optimizers, states):
            _unwrap(optimizer).load_state_dict(state)

    # -- the end ------------------------------------------------------------
    #: the run ended by an exception (Lightning calls on_exception before teardown); not ``sys.exc_info()``, which a
    #: fit called inside the user's own ``except`` block (a retry) sets too
    _interrupted = False

    def on_exception(self, exception: BaseException) -> None:
        self._interrupted = True
        super().on_exception(exception)

    def teardown(self) -> None:
        """Close the optimizer: at stage 3 every parameter gets its full value back (collective), so
        after fit the LightningModule is a plain model (test, predict, state_dict, a new fit) and
        ``trainer.save_checkpoint`` still saves the optimizer's state.

        After an exception the stage-3 model keeps its shards (a collective could hang on a rank
        that failed): load a checkpoint instead.
        """
        opt = self.zero_optimizer
        failed, self._interrupted = self._interrupted, False
        if opt is not None and (not opt.config.needs_module or not failed):
            opt.close()
        if isinstance(self.model, _ZeroModule):
            self.model = self.lightning_module
        super().teardown()
