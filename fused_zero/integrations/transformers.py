"""HF Trainer with fused_zero: ``ZeroTrainer(..., zero=fused_zero.ZeroConfig(stage=...))``.

    from fused_zero.integrations.transformers import ZeroTrainer

    trainer = ZeroTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                          zero=fused_zero.ZeroConfig(stage=2))
    trainer.train()                                   # torchrun --nproc_per_node=N script.py
    trainer.train(resume_from_checkpoint=True)        # at any world size and stage

A ``transformers.Trainer`` whose optimizer is a fused_zero.ShardedOptimizer, built from the
TrainingArguments (learning_rate; weight_decay with Trainer's own no-decay groups for biases
and norms; adam_beta1/2, adam_epsilon) and scheduled by Trainer's scheduler as usual:
- the model is never wrapped in DDP (the optimizer averages the gradients itself);
- ``max_grad_norm`` clips the global norm of the averaged gradients through the optimizer,
  and the logged ``grad_norm`` is that norm;
- ``gradient_accumulation_steps`` keeps gradients local (``optimizer.no_sync()``) until the
  last micro-batch, so gradients are reduced once per optimizer step;
- ``checkpoint-N`` folders hold the usual model weights (full, also at stage 3), scheduler,
  RNG and trainer state, plus ``fused_zero/``: a fused_zero.checkpoint of the fp32 masters and
  Adam moments written by every rank, from which ``train(resume_from_checkpoint=...)`` resumes
  at any world size and stage (a plain Trainer's ``optimizer.pt`` loads too);
- ``save_model()`` (every rank calls it, as in any distributed script) writes the full model at
  stage 3.
``ZeroSeq2SeqTrainer`` is the same over ``transformers.Seq2SeqTrainer``: with ``predict_with_generate``
at stage 3 across ranks, ``generate`` runs with ``synced_gpus=True`` unless the call sets it (as
Seq2SeqTrainer does for DeepSpeed ZeRO-3 and FSDP): a rank whose sequences end first keeps running
forwards until every rank's have, so the parameters' gathers meet on every rank.
At stage 3 TRL's ``SyncRefModelCallback`` (DPO's ``sync_ref_model=True``) reads the trained weights gathered
(``full_parameters()``), as TRL gathers them under DeepSpeed ZeRO-3.
Refused with a clear error: ``optimizers=`` / ``optimizer_cls_and_kwargs=`` other than a
ShardedOptimizer, an ``optim`` other than AdamW, DeepSpeed or FSDP settings, several GPUs in
one process (DataParallel), and ``zero.max_grad_norm`` (use ``max_grad_norm``).
"""
from __future__ import annotations

import functools
import math
import os

import torch

from ..checkpoint.files import FRAMEWORK_DIR
from ..config import ZeroConfig
from ..optimizer import ShardedOptimizer
from . import require
from ._torch_optim import unwrap_optimizer

_transformers = require("transformers", "hf")
from .accelerate import ZeroAccelerator  # noqa: E402  (needs accelerate, which the hf extra installs)

Trainer = _transformers.Trainer

_TAG = "trainer"
#: the AdamW choices of TrainingArguments(optim=); "adamw_hf" only in transformers before 5 (accepted if given)
_ADAMW = ("adamw_torch_fused", "adamw_torch", "adamw_hf")


class ZeroTrainer(Trainer):
    """``transformers.Trainer`` with a fused_zero.ShardedOptimizer; ``zero=`` picks the stage and options."""

    def __init__(self, *args, zero: ZeroConfig | None = None, **kwargs) -> None:
        if zero is None:
            zero = ZeroConfig()
        if not isinstance(zero, ZeroConfig):
            raise TypeError(f"zero= must be a fused_zero.ZeroConfig, got {type(zero).__name__}")
        if zero.max_grad_norm is not None:
            raise ValueError("ZeroTrainer clips with TrainingArguments(max_grad_norm=...): leave "
                             "ZeroConfig.max_grad_norm unset")
        optimizer = (kwargs.get("optimizers") or (None, None))[0]
        if optimizer is not None and not isinstance(unwrap_optimizer(optimizer), ShardedOptimizer):
            raise ValueError(f"ZeroTrainer builds its fused_zero.ShardedOptimizer from TrainingArguments; got "
                             f"optimizers=({type(optimizer).__name__}, ...): drop it and set learning_rate, "
                             "weight_decay, adam_beta1/2 and adam_epsilon instead (or pass a ShardedOptimizer)")
        if kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise ValueError("ZeroTrainer builds a fused_zero.ShardedOptimizer (AdamW): drop "
                             "optimizer_cls_and_kwargs and set the AdamW hyperparameters in TrainingArguments")
        self.zero = zero
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("ZeroTrainer runs fused_zero's ZeRO in place of DeepSpeed or FSDP: remove the "
                             "deepspeed / fsdp settings from TrainingArguments (or the accelerate config)")
        if self.args.n_gpu > 1:
            raise ValueError(f"this process sees {self.args.n_gpu} GPUs and Trainer would use DataParallel: launch "
                             "one process per GPU with torchrun (or set CUDA_VISIBLE_DEVICES)")
        full_eval = [name for name in ("bf16_full_eval", "fp16_full_eval") if getattr(self.args, name, False)]
        if full_eval and zero.needs_module:
            raise ValueError(f"TrainingArguments({full_eval[0]}=True) casts the model to that dtype before each "
                             "evaluation; at ZeroConfig(stage=3) its parameters are shards the optimizer keeps and "
                             "gathers in the dtype it was built over, so the cast would reach empty placeholders "
                             f"and the evaluation would run in the old dtype: drop {full_eval[0]} (as Trainer does "
                             "under DeepSpeed ZeRO-3 and FSDP) or use stage 1 or 2")
        optim = str(getattr(self.args.optim, "value", self.args.optim))
        if self.optimizer is None and optim not in _ADAMW:
            raise ValueError(f"ZeroTrainer trains with AdamW; TrainingArguments(optim={optim!r}) asks for another "
                             "optimizer: leave optim at its default (adamw_torch_fused) or pass adamw_torch")

    def floating_point_ops(self, inputs) -> int:
        """Trainer's count behind ``total_flos`` (6 x tokens x the model's non-embedding parameters). At stage 3 the
        parameters are empty placeholders between steps (``num_parameters()`` counts none): counted from the shapes
        the optimizer laid out, as transformers counts DeepSpeed ZeRO-3's ``ds_numel``."""
        opt = unwrap_optimizer(self.optimizer) if self.optimizer is not None else None
        main = getattr(self.model, "main_input_name", "input_ids")
        if not (self.zero.needs_module and isinstance(opt, ShardedOptimizer) and main in inputs
                and hasattr(self.model, "num_parameters")):
            return super().floating_point_ops(inputs)
        cached = getattr(self, "_fused_zero_numel", None)
        if cached is None or cached[0] is not opt:
            full = {id(p): math.prod(shape) for part in (*opt.shard_index(), *opt.frozen_index())
                    for p, shape in zip(part.params, part.shapes)}
            embeddings = {f"{n}.weight" for n, m in self.model.named_modules() if isinstance(m, torch.nn.Embedding)}
            count = sum(full.get(id(p), p.numel()) for n, p in self.model.named_parameters() if n not in embeddings)
            cached = self._fused_zero_numel = (opt, count)
        return 6 * inputs[main].numel() * cached[1]

    # -- what Trainer builds ---------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's own set-up, with a ZeroAccelerator (no DDP; accumulation and clipping through the optimizer)."""
        import transformers.trainer as trainer_module

        original = trainer_module.Accelerator
        trainer_module.Accelerator = functools.partial(ZeroAccelerator, zero=self.zero)
        try:
            super().create_accelerator_and_postprocess()
        finally:
            trainer_module.Accelerator = original

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            decay = set(self.get_decay_parameter_names(opt_model))
            named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                      {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
            self.optimizer = ShardedOptimizer(groups, lr=self.args.learning_rate,
                                              betas=(self.args.adam_beta1, self.args.adam_beta2),
                                              eps=self.args.adam_epsilon, config=self.zero, module=opt_model)
        if self.zero.needs_module:
            self._gather_for_weight_readers()
        return self.optimizer

    def _gather_for_weight_readers(self) -> None:
        """Stage 3: the callbacks known to read the model's weights between steps read them gathered. TRL's
        ``SyncRefModelCallback`` (DPO's ``sync_ref_model=True``, TR-DPO) mixes the trained weights into the
        reference model every ``ref_model_sync_steps``; between steps those are empty placeholders (torch's size
        error), and TRL gathers them only for DeepSpeed ZeRO-3. Its ``sync_target_model`` runs inside
        ``full_parameters()`` here (every rank calls it, as every rank runs the callback); a TRL whose callback
        lacks that method is refused, naming stages 1-2."""
        for callback in self.callback_handler.callbacks:
            kind = type(callback)
            if kind.__name__ != "SyncRefModelCallback" or not kind.__module__.startswith("trl"):
                continue
            sync = getattr(callback, "sync_target_model", None)
            if getattr(sync, "_fused_zero_gathered", False):
                continue
            if not callable(sync):
                raise ValueError("TRL's SyncRefModelCallback (sync_ref_model=True) reads the model's weights between "
                                 "steps, which stage 3 keeps sharded, and this TRL's callback has no "
                                 "sync_target_model for ZeroTrainer to run with them gathered: train at "
                                 "ZeroConfig(stage=2) (or 1), or set sync_ref_model=False")

            @functools.wraps(sync)
            def gathered(model, target_model, alpha, _sync=sync):
                with self.sharded_optimizer.full_parameters():
                    return _sync(model, target_model, alpha)
            gathered._fused_zero_gathered = True
            callback.sync_target_model = gathered

    @property
    def sharded_optimizer(self) -> ShardedOptimizer | None:
        """The fused_zero.ShardedOptimizer inside Accelerate's wrapper (None before training set it up)."""
        opt = unwrap_optimizer(self.optimizer) if self.optimizer is not None else None
        return opt if isinstance(opt, ShardedOptimizer) else None

    # -- checkpoints -------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        from .. import checkpoint

        opt = self.sharded_optimizer
        checkpoint.save(os.path.join(output_dir, FRAMEWORK_DIR), self.model, opt, tag=_TAG)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        from .. import checkpoint

        if checkpoint_dir is None:
            return
        folder = os.path.join(checkpoint_dir, FRAMEWORK_DIR)
        if os.path.isdir(folder):
            checkpoint.load(folder, self.model, self.sharded_optimizer, tag=_TAG)
        elif os.path.isfile(os.path.join(checkpoint_dir, "optimizer.pt")):  # a plain Trainer's checkpoint
            state = torch.load(os.path.join(checkpoint_dir, "optimizer.pt"), map_location="cpu", weights_only=True)
            self.sharded_optimizer.load_state_dict(state)
        else:
            return
        scheduler = os.path.join(checkpoint_dir, "scheduler.pt")
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        """Trainer's ``load_best_model_at_end``; at stage 3 with a peft model inside ``full_parameters(writeback=True)``:
        peft's ``load_adapter`` reads ``model.state_dict()`` before loading into it (a model of its own loads into
        the released parameters, as between steps)."""
        opt = self.sharded_optimizer
        if opt is None or not opt.config.needs_module or not hasattr(self.model, "load_adapter"):
            return super()._load_best_model()
        with opt.full_parameters(writeback=True):
            super()._load_best_model()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer's save_model; at stage 3 inside ``full_parameters()``, so every rank must call it."""
        opt = self.sharded_optimizer
        if opt is None or not opt.config.needs_module:
            return super().save_model(output_dir, _internal_call)
        with opt.full_parameters(), opt._state_dict_views():  # saved inside: no copy of the model needed
            super().save_model(output_dir, _internal_call)



class ZeroSeq2SeqTrainer(ZeroTrainer, _transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` with a fused_zero.ShardedOptimizer (``ZeroTrainer``'s set-up); at stage 3
    across ranks, generation in evaluation and prediction keeps the ranks in step (``synced_gpus=True``)."""

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        if self.args.predict_with_generate and self.zero.needs_module and self.args.world_size > 1:
            if not gen_kwargs and hasattr(self, "_gen_kwargs"):  # (what Seq2SeqTrainer takes when none are given)
                gen_kwargs = self._gen_kwargs.copy()
            gen_kwargs.setdefault("synced_gpus", True)  # each rank's sequences end at their own length
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)
