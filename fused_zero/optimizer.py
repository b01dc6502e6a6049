"""ShardedOptimizer: ZeRO stages 1, 2 and 3 as a drop-in torch.optim.Optimizer.

step() has three phases:
1. reduce: wait for the buckets' reduce-scatters (stage 2 launched them
   during backward; stage 1 launches them now);
2. update: one all-reduce of a few scalars (which parameters got a gradient
   on any rank, the squared grad norm and a non-finite flag when clipping or
   a GradScaler needs them), then the fused AdamW kernel over this rank's
   fp32 master shard, writing the narrow param shard in the same pass;
3. gather: all-gather every updated bucket back into the full param buffer
   (stage 3 gathers nothing here: each unit's next forward does, see comm/gatherer.py).

Semantics follow torch.optim.AdamW: a parameter whose gradient is None on
every rank is not updated and its step count does not advance; a step that a
GradScaler finds non-finite is skipped on every rank and does not count.
"""
from __future__ import annotations

import functools
import warnings
import weakref
from contextlib import contextmanager, nullcontext
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from .amp import PendingClip, ScalerInputs, calling_scaler, kept_factor, scaler_inputs, scaler_unscaled, update_scalars
from .backward_events import BackwardEvents
from .call_guards import reason_left_for_peers, refused_on_every_rank
from .checkpoint.save_load import ShardOwner
from .comm.collectives import Comm, collectives_checked_on_host, default_world_size
from .comm.rendezvous import EVAL_FORWARD
from .comm.topology import Topology
from .clip_value import clamp_, clamp_bounds
from .clipping import ClipMethods
from .config import ZeroConfig
from .comm.grad_sync import GradSync
from .frozen import refuse_unfrozen
from .grad_readers import grad_reader_around_step
from .hooks import HookSet, ModelHook, Relay, _eagerly, call_only, eager_under_compile
from .host_read import to_host
from .deferred import DeferredFlags
from .hyper import agreement_key, check_flags, check_foreach_tensors, check_group, check_hyperparameters, \
    check_param
from .habits import (STAGE1_GRADS_EDITED, STEP_WITHOUT_ZERO_GRAD, adalora_unserved, framework_without_integration,
                     group_initialised_after_build, lightning_without_strategy, stage3_model_wrapped,
                     torch_clip_in_loop)
from .model_guard import ModelGuard
from . import module_zero_grad
from .ownership import claim, others_on_group, release
from .sharding.partition import Partition, unalias
from .profiling import UPDATE, label
from .stages import make_stage
from .state_io import StateAccess
from .state_views import OptimizerState, attach_all, check_state_edits
from .stats import StepStats, checksum, reduce_stats, stats_vector
from .step_graph import StepGraph, check_not_capturing, refusal as capturable_refusal
from .tiers.tier import Tier
from .user_frames import user_stacklevel
from .update import REFUSED, mark_written, plan_update, read_hypers, shared_counters, update_all


class _Body(NamedTuple):
    """What step()'s device body hands the host half after it (step_graph.py: a replay hands the captured one)."""

    stats: StepStats
    # what the kept .grad (stage 1) is multiplied by after the update, as torch's left it: the clip factor, and the
    # GradScaler's inverse scale where the step was not skipped (torch's fused AdamW unscales .grad in place)
    kept_factor: torch.Tensor | None
    found_inf: dict | None  # the GradScaler state's found_inf_per_device, for scaler.update()


class _Unset:
    """An option the caller did not pass (so config= and options never mix silently)."""

    def __repr__(self) -> str:
        return "<ZeroConfig's default>"


_UNSET = _Unset()


class ShardedOptimizer(StateAccess, BackwardEvents, ClipMethods, torch.optim.Optimizer):
    """AdamW (or Adam) with ZeRO-sharded states, grads and fused kernels.

    Replace ``torch.optim.AdamW(model.parameters(), ...)`` with
    ``ShardedOptimizer(model.parameters(), ...)`` and do not wrap the model
    in DDP: gradients are averaged over ``process_group`` (the default group
    when one is initialised, else a single rank) by the optimizer itself, or
    over ``mesh``: a 1-D ``DeviceMesh``, a 2-D one with dims named
    ("replicate", "shard") for HSDP, or the data-parallel sub-mesh of a
    larger one (``mesh["dp"]``; see comm/topology.py).
    Takes torch.optim.AdamW's whole signature (``amsgrad``, ``maximize``,
    ``decoupled_weight_decay`` per group as in torch.optim.Adam; ``foreach``
    and ``fused`` are accepted and change nothing: the update is always
    fused) plus the ZeRO options of ``ZeroConfig`` as keywords, or one
    ``config=``.
    """

    _step_supports_amp_scaling = True

    @staticmethod
    def profile_hook_step(func):
        """torch.optim's wrapper of each class's ``step`` (pre/post hooks, the profiler label), run once per step:
        a subclass's ``step()`` calling ``super().step()`` runs the hooks only in its own, outer wrapper (torch's
        runs them again in the parent class's, once any instance of that class was made)."""
        hooked = torch.optim.Optimizer.profile_hook_step(func)

        @functools.wraps(func)
        def once(self, *args, **kwargs):
            if self.__dict__.get("_in_hooked_step"):
                return func(self, *args, **kwargs)
            self._in_hooked_step = True
            try:
                return hooked(self, *args, **kwargs)
            finally:
                self._in_hooked_step = False
        return once

    @property
    def state(self):
        """torch.optim's per-parameter state (``step``, ``exp_avg``, ``exp_avg_sq``): read after the update
        that may still run behind the last ``step()`` (stage 3 with offloaded states) has ended."""
        self._settle_update()
        return self.__dict__["state"]

    @state.setter
    def state(self, value) -> None:
        """(torch.optim's constructor, or user code resetting it: ``optimizer.state = defaultdict(dict)``) kept as
        an ``OptimizerState`` with its entries, which the next step checks and takes in."""
        flags = self.__dict__.setdefault("_state_flags", {})
        if not (isinstance(value, OptimizerState) and value.flags is flags):
            value = OptimizerState(flags, value)
            for flag in flags.values():
                flag[0] = True
        self.__dict__["state"] = value

    def _settle_update(self) -> None:
        """Wait for the update running behind the last step (offloaded states on a GPU: behind.py; raises if
        it failed on some rank, after undoing it)."""
        stage = self.__dict__.get("_stage")
        if stage is not None and stage.behind is not None:
            stage.settle()

    @refused_on_every_rank
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=None, config: ZeroConfig | None = None, process_group=None, mesh=None,
                 module: nn.Module | None = None, units=None, stage=_UNSET, bucket_numel=_UNSET,
                 reduce_dtype=_UNSET, adam_w_mode=_UNSET, max_grad_norm=_UNSET, overlap=_UNSET,
                 max_live_units=_UNSET, min_unit_numel=_UNSET, reshard_after_forward=_UNSET, secondary_shard=_UNSET,
                 offload_optimizer=_UNSET, offload_params=_UNSET, nvme_path=_UNSET, offload_chunk_numel=_UNSET,
                 nvme_direct=_UNSET, update_behind=_UNSET, broadcast_buffers=_UNSET,
                 param_comm=_UNSET, grad_comm=_UNSET, quant_block=_UNSET) -> None:
        given = {k: v for k, v in dict(stage=stage, bucket_numel=bucket_numel, reduce_dtype=reduce_dtype,
                                       adam_w_mode=adam_w_mode, max_grad_norm=max_grad_norm, overlap=overlap,
                                       max_live_units=max_live_units, min_unit_numel=min_unit_numel,
                                       reshard_after_forward=reshard_after_forward, secondary_shard=secondary_shard,
                                       offload_optimizer=offload_optimizer, offload_params=offload_params,
                                       nvme_path=nvme_path, offload_chunk_numel=offload_chunk_numel,
                                       nvme_direct=nvme_direct, update_behind=update_behind,
                                       broadcast_buffers=broadcast_buffers,
                                       param_comm=param_comm, grad_comm=grad_comm, quant_block=quant_block,
                                       ).items() if v is not _UNSET}
        config = ZeroConfig.resolve(config, given)
        check_foreach_tensors(lr, betas, foreach, capturable)
        betas = check_hyperparameters(lr, betas, eps, weight_decay)
        check_flags(foreach, fused, capturable, differentiable, bool(capturable))
        if isinstance(params, nn.Module):
            if module is not None and module is not params:
                raise ValueError("the first argument is a model and module= names another one; pass one model")
            module, params = params, list(params.parameters())
        if module is not None and not isinstance(module, nn.Module):
            raise TypeError(f"module= takes the model (a torch.nn.Module), got {type(module).__name__}")
        if module is None and config.needs_module:
            raise ValueError("stage 3 shards the model's parameters: pass the nn.Module itself, "
                             "ShardedOptimizer(model, stage=3, ...), or its param groups with module=model")
        if config.update_behind and module is None:
            raise ValueError("update_behind=True needs the model (each module's forward waits for its own "
                             "parameters): pass ShardedOptimizer(model, ...) or module=model")
        if units is not None and not config.needs_module:
            raise ValueError("units= only applies to stage 3")
        self._names: dict[nn.Parameter, str] = {} if module is None else {p: n for n, p in module.named_parameters()}
        self.module = module
        # given the model: that it still holds the parameters this optimizer trains (model_guard)
        self._guard = None if module is None else ModelGuard(module)
        self._units = units
        self.config = config
        self.topology = Topology(process_group, mesh, config.secondary_shard)  # which group each collective uses
        # alone because no process group existed yet: refused at a step once one of several ranks exists
        self._alone_by_default = process_group is None and mesh is None and self.topology.world_size == 1
        self.comm = self.topology.shard
        self._rendezvous = self.topology.rendezvous()  # None alone; see comm/rendezvous.py
        self._control: Comm | None = None  # the group state_dict() gathers on, made at its first call
        self._stage = make_stage(self.topology, config)
        self.partitions: list[Partition] = []
        self._shared_versions: tuple = ()  # (partition, index) of parameters sharing a version counter (update.py)
        self.grad_sync: GradSync | None = None
        self._reduce_comm: Comm = self.comm  # what the gradient reductions go over (_reduction_group)
        self._unhooked: list[nn.Parameter] = []  # laid out while frozen for now: no gradient hook yet (_build)
        self._hooks: HookSet | None = None
        self._in_backward = False
        self._backwards_begun = 0  # backwards that reached this optimizer's gradients (step(closure) reads it)
        self._holding = 0  # inside full_parameters() (nested: the depth)
        self._backward_dropped = False  # a backward raised: its end-of-backward callback never ran (hooks.py)
        self._closed = False
        self._integrated = False  # a framework integration drives it (mark_integrated)
        if self._rendezvous is not None:
            self._rendezvous.serve("state_dict()", self._serve_state_dict)
        self._habits_checked = False
        self._framework_checked = False
        self._clip: PendingClip | None = None  # clip_grad_norm_ called since the last step
        # this step's clips, also those a backward since applied: what each agreed on (max_norm), and a refusal of
        # their arguments on this rank (raised by the step, after its collectives)
        self._clipped: tuple = ()
        self._clip_refused: Exception | None = None
        self._clip_values: tuple = ()  # clip_grad_value_ called since the last step: its values (clip_value.py)
        self._clamped: list = []  # stage 1: the kept .grad a clip_grad_value_ since the last step clamps (weakly)
        self._clip_warned = False  # torch's clip_grad_norm_ seen in the training loop (stages 2-3)
        self._zero_grad_warned = False  # a step with no zero_grad() since the last one (stages 2-3)
        self._dp_clip_warned = False  # a norm clip over a data-parallel sub-mesh of a larger mesh (habits.py)
        if config.max_grad_norm is not None:
            self._warn_norm_over_dp_only("max_grad_norm")
        self._scaler_ref = None  # the GradScaler that last passed itself to step()
        self._verdicts = DeferredFlags()  # the steps' "ranks disagree" flags, learnt at the next call
        self._steps_done = 0  # step() calls that finished (where a collective call stands: comm/rendezvous.py)
        self._state_len = -1  # len(self.state) when last put in param_groups order (_order_state)
        if self._rendezvous is not None:
            self._rendezvous.progress = Relay(self._steps_finished)
        self._last_update = None  # what the last update used: the next stats all-reduce checks it
        self._stats_agreed = None
        self._last_traffic = {"reduce_scatter": 0, "all_gather": 0, "all_reduce": 0}
        self._graph: StepGraph | None = None  # capturable=True: the step's captured device work (step_graph.py)
        self._overflow: list | None = None  # the last step's GradScaler verdict, on the device (last_step_overflowed)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=config.adam_w_mode if decoupled_weight_decay is None
                        else bool(decoupled_weight_decay))
        super().__init__(params, defaults)
        first = next((p for g in self.param_groups for p in g["params"]), None)
        if module is not None and first is not None and not self._names.keys() & {
                p for g in self.param_groups for p in g["params"]}:
            raise ValueError("module= names a model that holds none of the parameters given: its buffers would be "
                             "broadcast and its parameters watched while others are trained. Pass the model whose "
                             "parameters these are")
        refused = capturable_refusal(bool(capturable), config, None if first is None else first.device,
                                     self.topology.world_size > 1 and collectives_checked_on_host())
        if refused is not None:  # every rank alike (the options agree), before any collective
            raise ValueError(refused)
        refused = adalora_unserved(module, config.stage, self.topology.world_size,
                                   [p for g in self.param_groups for p in g["params"]])
        if refused is not None:  # every rank alike (the same model and options), before any collective
            raise ValueError(refused)
        self._build()
        if capturable:
            self._graph = StepGraph(lambda: [self.comm] + ([self.topology.replicate] if self.topology.replicate
                                                           else []))

    # -- construction -----------------------------------------------------
    @reason_left_for_peers("add_param_group()")
    @eager_under_compile
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            if len(set(map(id, group["params"]))) != len(group["params"]):
                raise ValueError("a param group holds the same parameter twice: list each parameter once. "
                                 "(torch.optim warns and keeps both entries, which its state_dict() numbers "
                                 "twice, pytorch issue 36831; a flat buffer holds each parameter once)")
            check_group(group, bool(self.defaults.get("capturable")))
            for p in group["params"]:
                self._check_param(p)
            self._check_disjoint()
        except (TypeError, ValueError, RuntimeError):
            self.param_groups.pop()
            raise
        if self.grad_sync is not None:  # after construction: lay out the new group too
            if not self._stage.can_add_groups:
                self.param_groups.pop()
                raise RuntimeError(
                    "stage 3 lays out every parameter of the model at construction; pass all param groups to "
                    "ShardedOptimizer(..., module=model) instead of add_param_group. To train parameters frozen at the "
                    "build (gradual unfreezing) or added to the model since (a new adapter): sd = "
                    "optimizer.state_dict(), build a new ShardedOptimizer over the model as it is now, and load sd "
                    "into it (every rank; a state dict with fewer parameters than the new optimizer needs its groups "
                    "and states renumbered first, as for torch)")
            # every rank adds it (a lone call raises at once, naming it), and the ranks agree on the new layout
            # before the rebuild changes anything: refused, the group is taken back and the optimizer trains on
            building = False
            try:
                with self.collective_call("add_param_group()"):
                    self.topology.agree(self._check_no_gradients_in_shards)
                    self._stage.check_groups(self.param_groups, self._names)
                    building = True
                    self._build()
            except (TypeError, ValueError, RuntimeError):
                if not building:
                    self.param_groups.pop()
                raise

    def _check_no_gradients_in_shards(self) -> None:
        """add_param_group at stage 2 between a backward and its step: the rebuild would drop the reduced gradients
        the shards hold (torch's keeps them on ``.grad``), so it is refused on every rank, naming the fix."""
        if self.grad_sync.holds_reduced_grads():
            raise RuntimeError("add_param_group() after a backward and before its step(): at stages 2-3 the reduced "
                               "gradients live in the optimizer's shards, which adding a group lays out anew. Call "
                               "add_param_group() after step() (or after zero_grad()), before the next backward")

    def _check_disjoint(self) -> None:
        """Parameters that are views of one memory (``nn.Parameter(w.data[:4])`` beside ``w``) are refused: each
        gets a slot of its own in the flat buffers, so they would stop sharing it and drift apart silently (torch
        keeps them aliased). One Parameter used in two places (tied weights) is fine."""
        spans = []
        for g in self.param_groups:
            for q in g["params"]:
                if q.numel():
                    extent = 1 + sum((n - 1) * st for n, st in zip(q.shape, q.stride()))
                    spans.append((q.data_ptr(), q.data_ptr() + extent * q.element_size(), q))
        spans.sort(key=lambda span: span[0])
        for (a0, a1, p), (b0, _, q) in zip(spans, spans[1:]):
            if b0 < a1 and p is not q:
                first, second = (self._names.get(t, f"of shape {tuple(t.shape)}") for t in (p, q))
                raise ValueError(f"parameters {first} and {second} "
                                 "share memory (views of one tensor): ShardedOptimizer lays each parameter out on its "
                                 "own, so they would stop sharing it. Tie them as one nn.Parameter used in both "
                                 "places, or make them separate (clone the data)")

    def _check_param(self, p: torch.Tensor) -> None:
        if isinstance(p, nn.parameter.UninitializedParameter):  # (its shape cannot even be read)
            raise ValueError("a parameter of a lazy module (nn.LazyLinear, nn.LazyConv2d, ...) is not materialized "
                             "yet: its shape comes with the first forward. Run one forward (a dry run with a "
                             "sample batch) before building ShardedOptimizer, which lays out every parameter then")
        first = next(q for g in self.param_groups for q in g["params"])
        check_param(p, self._names.get(p, f"of shape {tuple(p.shape)}"), first.device)

    @torch.inference_mode(False)  # built under inference_mode (a setup helper): its buffers stay trainable
    def _build(self) -> None:
        """Lay out every group, check all ranks agree, broadcast rank 0's values, hook the parameters."""
        zeroed = []  # parameters holding torch's zero .grad in the reducer this build replaces
        if self.grad_sync is None:  # first build: a previous optimizer over these parameters steps aside
            params = [p for g in self.param_groups for p in g["params"]]
            message = lightning_without_strategy()  # on every rank, before any collective
            if message is not None:
                raise RuntimeError(message)
            if params:
                self.topology.check_device(params[0].device)
            # everything that can refuse the build, before a previous optimizer over these parameters is closed
            # (a refused constructor leaves it as it was)
            self.__dict__["_met"] = True  # a refusal from here on reaches every rank (the meeting, then collectives)
            self.topology.meet()  # the ranks were given the same groups (a store check: no collective yet)
            # (whether a module was given decides the collectives below: its buffers' check and broadcast)
            given = agreement_key({"module= (or the model in place of its parameters)": self.module is not None})
            self.topology.check_same(self._agreed() + given, "optimizer options and hyperparameters",
                                     hint="build the optimizer with the same options, param group "
                                          "hyperparameters and module= (or the model) on every rank")
            if self.module is not None and self.config.broadcast_buffers:  # rank 0's are broadcast below
                self.topology.check_same(
                    [(name, tuple(b.shape), str(b.dtype)) for name, b in self.module.named_buffers()],
                    "module buffers", hint="build the same model on every rank (its buffers are broadcast from rank "
                                           "0, as DDP does), or pass broadcast_buffers=False")
            self._stage.precheck(self.module, self._units)
            for previous in claim(self, params):
                reducer = getattr(previous, "grad_sync", None)  # (a stage-3 model's gatherer has none)
                if reducer is not None:  # torch's zeros left by its zero_grad(set_to_none=False)
                    zeroed += reducer.zeroed_grads()
                previous.close()
            self._reduce_comm = self._reduction_group()
            self._sync_module_buffers()
        else:
            self.grad_sync.wait()
            zeroed = self.grad_sync.zeroed_grads()  # (add_param_group: the partitions it had are kept)
        if self._hooks is not None:
            self._hooks.remove()
        if self._graph is not None:  # a rebuild (add_param_group): new partitions, a graph over the old ones is stale
            self._graph.close()
        self.partitions, positions = self._stage.build(self.param_groups, self._names, self.module, self._units,
                                                       Relay(self._begin_backward), self.partitions,
                                                       Relay(self._first_forward))
        gatherer = getattr(self._stage, "gatherer", None)
        if gatherer is not None and self._rendezvous is not None:
            gatherer.meet_eval = Relay(self._meet_eval)
        if gatherer is not None:  # a forward after a backward that raised ends that backward first
            gatherer.recover_backward = Relay(self._recover_if_dropped)
            gatherer.check_model = Relay(self._check_still_the_models)
        claim(self, [p for part in self.partitions for p in part.params])
        # parameters sharing an autograd version counter (views of one tensor): the step's marking moves them apart
        self._shared_versions = shared_counters((*self.partitions, *self._stage.frozen_parts))
        self._params = {p for part in self.partitions for p in part.params}
        self._on_cuda = any(part.flat.device.type == "cuda" for part in self.partitions)
        self._layout = [tuple(map(id, g["params"])) for g in self.param_groups]  # what the flat buffers hold
        if self._guard is not None:
            self._guard.watch(self.param_groups)
        flags = self.__dict__["_state_flags"]  # optimizer.state's: an entry put in whole flags its partition
        flags.clear()
        flags.update((id(p), part.state_edited) for part in self.partitions for p in part.params)
        attach_all(self.state, self.partitions)  # new flat states: the moment views follow them
        self.grad_sync = self._stage.reducer(self.partitions, positions, self._reduce_comm, self.config.overlap)
        self.grad_sync.names = self._names
        self.grad_sync.keep_zeroed_grads(zeroed)
        self.grad_sync.on_unseen = Relay(self._take_swapped)  # (stages 2-3: a .grad no hook saw, before refusing it)
        self.grad_sync.pipe.span(self.topology.replicate, self.topology.world_size)  # HSDP: the replicas too
        self.grad_sync.pipe.quantize(self.config.grad_comm, self.config.quant_block,  # qgZ (comm/codec.py)
                                     self.topology.replicate_again() if self.config.grad_comm else None)
        if self.grad_sync.frees_grads:  # model.zero_grad() reaches the shards that stand in for .grad
            module_zero_grad.watch(self)
        self._hooks = HookSet(self)
        # what every gradient hook calls, found once (bound methods: no attribute chain per parameter)
        self._reduce_grad = self.grad_sync.on_grad
        self._stage_on_grad = self._stage.grad_hook()
        for p in self.grad_sync.hooked(self._params):
            self._hooks.grad(p, self._on_grad, self.grad_sync.entries[p])
        # laid out while frozen for now (trained before this rebuild): no hook can be registered yet (_take_unfrozen)
        self._unhooked = [p for part in self.partitions for p in part.params if not p.requires_grad]
        self._buffers = [] if self.module is None or self.topology.world_size == 1 else list(self.module.buffers())
        self._buffers_due = True
        if self._buffers and self.config.broadcast_buffers:
            # collectives inside: kept out of torch.compile's graph, as stage 3's gathers are
            hook = torch.compiler.disable(self._hooks.relay(self._before_forward))
            self._hooks.add(self.module.register_forward_pre_hook(ModelHook(call_only, hook), prepend=True))

    def _reduction_group(self) -> Comm:
        """The group the gradient reductions go over: the shard group, or, where another open optimizer already
        reduces over it (two models trained by one backward, each with its own optimizer), a group of its own
        (the buckets' launches move with timing, so two optimizers' reductions would interleave differently on
        different ranks), and with HSDP replicas' groups of its own as well. Every rank alike: the ranks of both
        levels agree on it (one of them may still hold a dropped one)."""
        shared = others_on_group(self, self.comm.group)
        if self.topology.world_size > 1:
            shared = self.topology.any_rank(shared)
        if not shared:
            return self.comm
        self.topology.separate_replicas()  # HSDP: the replicas' all-reduces too
        return self.topology.own_group()

    def _agreed(self) -> tuple:
        """What every rank must share: the options and every group's hyperparameters."""
        # nvme_path is each rank's own folder (a local disk per node): the one option that may differ
        shared = {"option": {**self.config.__dict__, "nvme_path": None}}
        for gi, g in enumerate(self.param_groups):
            shared[f"param group {gi}"] = {k: v for k, v in g.items() if k not in ("params", "param_names")}
        return agreement_key(shared)  # (name, value) pairs: a difference is reported by name

    def _sync_module_buffers(self) -> None:
        """As DDP does when built: every rank takes rank 0's module buffers (BatchNorm statistics), unless
        broadcast_buffers=False (then DDP never touches them)."""
        if self.module is not None and self.config.broadcast_buffers:
            self.topology.broadcast_coalesced(list(self.module.buffers()))

    def _before_forward(self) -> None:
        """DDP's broadcast_buffers=True, as DDP decides it: rank 0's buffers before a forward that follows
        a forward whose gradients were to be reduced (with gradients enabled, outside no_sync()), and
        before the first."""
        if self._closed or self._holding:  # inside full_parameters(): a forward there meets no other rank
            return
        self._recover_if_dropped()
        if self._buffers_due:
            self.topology.broadcast_coalesced(self._buffers)
        self._buffers_due = torch.is_grad_enabled() and self.grad_sync.sync

    def owns(self, p: nn.Parameter) -> bool:
        """Whether this (open) optimizer holds ``p`` in its flat buffers."""
        return not self._closed and p in getattr(self, "_params", ())

    @property
    def closed(self) -> bool:
        """Whether this optimizer stepped aside: ``close()`` ran, or a newer one took its parameters over."""
        return self._closed

    @property
    def integrated(self) -> bool:
        """Whether a framework integration drives this optimizer (``mark_integrated``)."""
        return self._integrated

    def mark_integrated(self) -> None:
        """For a framework integration (ZeroAccelerator, ZeroTrainer) that drives this optimizer: its clipping,
        accumulation and model wrapping go through the optimizer, so the refusals of a plain framework
        (habits.py) stand aside."""
        self._integrated = True

    @property
    def state_tier(self) -> Tier:
        """Where the optimizer states live (``offload_optimizer``): ``Tier.NVME`` states are gone once closed."""
        return self._stage.tiers.states

    @eager_under_compile
    def close(self) -> None:
        """Step aside: remove the hooks and, at stage 3, give the parameters their full values back.

        Collective at stage 3 (every rank calls it). A new ShardedOptimizer over the
        same parameters calls this on the previous one; a closed optimizer refuses
        to step.
        """
        if self._closed:
            return
        with self.collective_call("close()") if self.config.needs_module else nullcontext():
            if self.grad_sync is not None:
                self.grad_sync.wait()
            if self._hooks is not None:
                self._hooks.remove()
            self._stage.close()  # waits for the update behind the last step first
            if self._graph is not None:
                self._graph.close()
            for part in self.partitions:
                part.close()
            self._closed = True
            module_zero_grad.unwatch(self)
            release(self, list(getattr(self, "_params", ())))
            if self._guard is not None:
                self._guard.close()
        if self._rendezvous is not None:
            self._rendezvous.close()

    def collective_call(self, name: str):
        """A context in which every rank makes call ``name`` (see comm/rendezvous.py); nothing alone."""
        return nullcontext() if self._rendezvous is None else self._rendezvous.collective(name)

    def _check_open(self) -> None:
        if not self._closed:
            self._recover_if_dropped()
        if self._closed:
            raise RuntimeError("this ShardedOptimizer was closed: a newer ShardedOptimizer took over its parameters "
                               "(or close() was called: ZeroAccelerator.end_training() and Lightning's teardown "
                               "call it); step the new optimizer, or rebuild this one")

    def __getstate__(self):
        raise TypeError("a ShardedOptimizer cannot be copied or pickled (it owns hooks, flat buffers and process "
                        "groups): save optimizer.state_dict() or use fused_zero.checkpoint, and build a new "
                        "optimizer over the copied model")

    def __deepcopy__(self, memo):
        self.__getstate__()

    def join_hook(self, **kwargs):
        """``torch.distributed.algorithms.Join([model, optimizer])`` (uneven inputs, as ZeroRedundancyOptimizer
        joins): refused when the context is made, on every rank alike, before any collective."""
        raise RuntimeError("ShardedOptimizer does not take part in torch.distributed.algorithms.Join: ranks running "
                           "different numbers of batches are not served (a rank with more waits in a collective its "
                           "peers never make). Give every rank the same number of batches: a DistributedSampler with "
                           "drop_last=True, or pad the last batches")

    def _meet_eval(self) -> None:
        """Stage 3, an evaluation forward (without gradients, or in eval mode): every rank runs it, so they meet
        first."""
        with self.collective_call(EVAL_FORWARD):
            pass

    def _first_forward(self) -> None:
        """Stage 3, the model's first training forward, before any gather: refuse what wraps the model."""
        message = stage3_model_wrapped(self, self.module)
        if message is not None:
            raise RuntimeError(message)

    # -- the training-loop API --------------------------------------------
    @contextmanager
    def full_parameters(self, writeback: bool = False):
        """Inside, every parameter of the model holds its full value (all ranks must enter).

        For export or evaluation under stage 3: ``model.state_dict()`` inside the
        block gives full tensors, copies that stay valid after it (other tensors taken from the
        parameters inside, ``p.detach()``, are views of memory the block gives back: clone what
        you keep). ``writeback=True`` copies changes made inside back into the master weights.
        Stages 1 and 2 hold full parameters, so there it only applies ``writeback`` (with
        ``update_behind=True`` it first waits for the update and the all-gathers the last step() left
        behind it).
        """
        self._check_open()
        # a truthy "no" would write back (checked on every rank alike, before any collective)
        if not isinstance(writeback, (bool, np.bool_)):
            raise TypeError(f"full_parameters(writeback=...) must be True or False, got {writeback!r}")
        lone_ok = not self.config.needs_module  # stages 1-2 hold full parameters: nothing collective here
        with nullcontext() if lone_ok else self.collective_call("full_parameters()"), self._stage.full_parameters():
            self._holding += 1  # a forward inside (one rank's evaluation) broadcasts no buffers: no peer joins
            try:
                yield
            finally:
                self._holding -= 1
            if writeback:  # stage 3: before the gathered copies are released
                gatherer = getattr(self._stage, "gatherer", None)
                if gatherer is not None:  # state-dict copies written in place (a load into model.state_dict())
                    gatherer.take_in_copies()
                parts = (*self.partitions, *self._stage.frozen_parts)  # stage 3's frozen weights too
                unalias(parts)
                for part in parts:
                    part.take_in_assigned_full(self._names)
                    part.load_master_from_params(changed_only=True)

    def _state_dict_views(self):
        """Stage 3: ``model.state_dict()`` inside gives views of the gathered parameters, not copies (the
        integrations that save inside ``full_parameters()``); at stages 1-2 nothing changes."""
        gatherer = getattr(self._stage, "gatherer", None)
        return nullcontext() if gatherer is None else gatherer.state_dict_views()

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally: backward passes inside do not reduce."""
        self._check_open()
        with self.grad_sync.no_sync():
            yield

    @reason_left_for_peers("zero_grad()")
    @eager_under_compile
    def zero_grad(self, set_to_none: bool = True) -> None:
        self._recover_if_dropped()
        if self._hooks is not None:
            self._hooks.rehook_swapped()  # (a state dict loaded with swap_tensors: hooked again before backward)
        if not set_to_none:  # zeroes the gradient shards the update behind step() may still read
            self._settle_update()
        self.grad_sync.zero_grad(set_to_none)
        self._forget_clips()
        super().zero_grad(set_to_none=set_to_none)

    @reason_left_for_peers("step()")
    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step of every parameter that got a gradient on some rank (every rank calls it).

        Under a ``torch.amp.GradScaler`` (``scaler.step(optimizer)``), the scaler's loss scale and
        the overflow verdict every rank agrees on are taken from it (``amp.py``); an overflow skips
        the update on the device (no element changes, no step count advances) and the host does not
        wait for the verdict.

        Ranks that disagree on a step (a param group's hyperparameters, the options, whether it
        clips, clip_grad_norm_ called on some ranks only) are found in the step's all-reduce, on
        the device: that step is skipped on every rank, and the next ``step()`` or
        ``clip_grad_norm_()`` raises RuntimeError on every rank, as do ``state_dict()`` and
        ``fused_zero.checkpoint.save`` before they write anything. Hyperparameters changed between
        ``clip_grad_norm_()`` and ``step()`` are checked one step later.
        """
        # the step's own body, never the hooked step() again: a subclass's override and the step hooks ran once
        if torch.compiler.is_compiling():  # torch.compile(opt.step), or a compiled training step: run eagerly
            return _eagerly(self._step_without_grad, closure)
        if torch.is_inference_mode_enabled():  # what a step allocates (its first: the step counts) must stay
            with torch.inference_mode(False):  # usable by the steps outside inference_mode (which enables grad)
                return self._step_without_grad(closure)
        return self._step(closure)

    def last_step_overflowed(self) -> bool:
        """Whether the last ``step()`` ran under a GradScaler that found a non-finite gradient on some rank, so
        that the step was skipped on every rank (the scaler's overflow verdict; False without a scaler). One host
        read of the device verdict: what Accelerate's ``optimizer.step_was_skipped`` and HF Trainer, which steps
        its scheduler only after a step that was not skipped, ask (``scaler.step`` always calls ``step()`` here,
        as for torch's fused AdamW, so a wrapper cannot tell from that call alone)."""
        found = self._overflow  # (None: before the first step, or a step without a scaler)
        return bool(found) and any(to_host(t.sum(), "last_step_overflowed()") > 0 for t in found)

    def _step_without_grad(self, closure):
        with torch.no_grad():
            return self._step(closure)

    def _step(self, closure):
        """``step()``'s body, under no_grad, outside compile and inference_mode."""
        self._check_open()
        if self.grad_sync.frees_grads:  # (every rank alike, before any collective)
            if self._in_backward and _in_autograd_engine():
                raise RuntimeError(STEP_IN_BACKWARD.format(stage=self.config.stage))
            message = grad_reader_around_step()
            if message is not None:
                raise RuntimeError(message)
        if self._on_cuda:
            check_not_capturing()
        self._settle_update()
        self._overflow = None  # this step's GradScaler verdict (last_step_overflowed)
        grad_scaler = calling_scaler(self)
        if not self._habits_checked:  # no hooked gradient seen yet (stage 1 hooks one parameter per bucket)
            self._check_habits()
        if self._alone_by_default and default_world_size() > 1:  # every rank alike, before any collective
            raise RuntimeError(group_initialised_after_build(default_world_size()))
        if not self._framework_checked:  # once, on every rank, before any collective
            self._framework_checked = True
            message = framework_without_integration(self)
            if message is not None:
                raise RuntimeError(message)
        loss, failed = None, None
        if closure is not None:
            with torch.enable_grad():
                begun = self._backwards_begun
                try:
                    loss = closure()
                except Exception as error:  # noqa: BLE001 - raised again at the step's end
                    if self.topology.world_size == 1 or self._backwards_begun == begun:
                        # before its backward reached a gradient (in its forward): this rank made none of the
                        # backward's collectives, so it raises at once, as torch and DDP (the others wait in theirs
                        # and fail with this reason if this process ends: reason_left_for_peers)
                        raise
                    # perhaps on this rank alone, after its backward: the step goes through its collectives
                    # skipped and raises it
                    failed = error
                    self._recover_if_dropped()
        if not self._zero_grad_warned and self.grad_sync.consumed_unzeroed():  # (after the closure's own zero_grad)
            self._zero_grad_warned = True
            warnings.warn(STEP_WITHOUT_ZERO_GRAD.format(stage=self.config.stage), UserWarning,
                          stacklevel=user_stacklevel())
        if grad_scaler is not None:
            self._scaler_ref = weakref.ref(grad_scaler)
        _, edited = self._refusal(self._check_edits)  # before the step's collectives, as the hyperparameters
        hypers, bad_hyper = self._refusal(lambda: read_hypers(self.partitions, self.param_groups,
                                                              self.config.adam_w_mode, self._graph is not None))
        if bad_hyper is not None:
            hypers = REFUSED
        # 1. reduce, and take in what user code did to the parameters since the last step
        if self._unhooked:
            self._take_unfrozen()
        hand_set = self._reduce_grads()
        self._raise_if_disagreed()
        # what user code did to the parameters (p.data = t, model.to(), a write between stage-3 steps): a change the
        # flat buffers cannot take may be on this rank alone
        _, unfit = self._refusal(lambda: self._stage.before_update(self.partitions))
        refused = next((e for e in (failed, edited, bad_hyper, hand_set, self._clip_refused, unfit)
                        if e is not None), None)
        if refused is not None:  # the update keeps its shape and changes nothing, user code's state edits included
            hypers = REFUSED
        for part in self.partitions:
            part.pending_master = None  # masters load_state_dict kept for weights that never came
        # 2. update
        scaler = self._scaler(grad_scaler)
        if self.topology.world_size > 1 and self.grad_sync.grads_edited() and not scaler_unscaled(scaler):
            warnings.warn(STAGE1_GRADS_EDITED, stacklevel=2)
        if self._clip is None and not self._clip_warned and self.grad_sync.frees_grads \
                and self.config.max_grad_norm is None:
            found = torch_clip_in_loop()
            if found is not None:
                self._clip_warned = True
                warnings.warn(found[0], UserWarning, stacklevel=found[1])
        need_norm = self._clip is None and self.config.max_grad_norm is not None
        amp = scaler.state is not None or scaler.found_inf is not None
        clip, vector, flags = self._clip, None, ()
        values = self._clip_values  # clip_grad_value_: clamped right before the update (clip_value.py)
        if clip is not None:  # (a backward since would have applied it: _begin_backward)
            agreed = self._agreed()  # clip_grad_norm_'s all-reduce serves this step; the next one checks this
        else:
            # (clips a backward applied since: their norms agree in this all-reduce, so a mismatch skips this step)
            site = ("step", self._clipped, values) if self._clipped or values else "step"
            vector, flags = self._stats_input(need_norm or amp, site, refused is not None)
            agreed = self._stats_agreed
        key = None
        if self._graph is not None:  # capturable: the body reads static inputs, refilled here (step_graph.py)
            graph = self._graph
            hypers = graph.hypers(hypers, self.partitions)
            if refused is None and not values and (clip is None or graph.clip_serves(clip, scaler)):
                key = graph.key(self.partitions, self.state, need_norm or amp, scaler, hypers, flags,
                                self.topology.world_size == 1, self._names, clip)
            if key is not None:
                if clip is None:
                    vector = graph.static("stats", vector)
                else:
                    clip = graph.clip(clip)
                scaler = graph.scaler(scaler)

        bounds: list = []  # clip_grad_value_'s, in the shards' units (body() sets them)

        def body() -> _Body:
            """The step's device work: the stats all-reduce, the factors and the verdict, the update, the gather."""
            stats = clip.stats if clip is not None else reduce_stats(
                self.comm, self.partitions, vector, flags, need_norm or amp, self.topology.replicate)
            grad_scale, skip, clip_coef = update_scalars(stats, scaler, clip, self.config.max_grad_norm)
            if refused is not None:  # this rank's step is skipped; the others skip it too (their checksum differs)
                # (among ranks the all-reduce always gives a verdict; alone only clip_grad_value_'s refusal of a
                # backward after it comes here, the others raise before the step's work)
                skip = torch.ones((), device=stats.sq_norm.device) if skip is None else torch.ones_like(skip)
            if values and refused is None:  # (never captured: a step with them runs eagerly)
                bounds.extend(clamp_bounds(values, scaler, grad_scale, scaler_unscaled(scaler)))
                clamp_([part.grad_shard for part in self.partitions], bounds)
            # 3. then gather (stages 1-2) or release (stage 3: the next forward gathers)
            self._update(stats.has_grad, grad_scale, skip, hypers)
            kept = None if self.grad_sync.frees_grads else kept_factor(  # (.grad an unscale_ divided owes no more)
                clip_coef, scaler.inv_scale if scaler.unscaled_by is None else None, skip)
            return _Body(stats, kept, None if scaler.state is None else scaler.state["found_inf_per_device"])

        runs = None if key is None else (self._graph.replays, self._graph.captures)
        out = body() if key is None else self._graph.run(key, body)
        if clip is None:
            self._verdicts.post(out.stats.disagree)
        if out.found_inf is not None:  # what scaler.update() reads (a replay's scaler state is a new dict)
            # a replay's flag is the graph's own tensor, written again by the next replay: the scaler gets a copy
            scaler.state["found_inf_per_device"] = out.found_inf if key is None else {
                d: t.clone() for d, t in out.found_inf.items()}
            # a copy: scaler.update() adds every other optimizer's verdict into the first one's flag, in place
            self._overflow = [t.clone() for t in scaler.state["found_inf_per_device"].values()]
        if key is not None:  # a replay wrote the parameters: what they are now is the optimizer's own
            replayed, captured = self._graph.replays != runs[0], self._graph.captures != runs[1]
            if replayed and not captured:  # (a replay runs no Python: a capture's body marked them already)
                mark_written(self.partitions, out.stats.has_grad, self._shared_versions)
            for part in self.partitions:
                part.mark_synced()
        self._last_update = agreed
        if bounds:  # stage 1 keeps .grad: clamped, clipped and unscaled in place, as torch's clip and step left it
            self.grad_sync.clamp_kept_grads(tuple(bounds))
        if out.kept_factor is not None:
            self.grad_sync.scale_kept_grads(out.kept_factor)
        self._end_step()
        if refused is not None:
            raise refused
        return loss

    def _check_still_the_models(self) -> None:
        """Refuse a model whose parameters were replaced by new nn.Parameter objects since the build (``ModelGuard``;
        with ``module=`` only)."""
        if self._guard is not None and self._guard.check(self.param_groups, self._params, self._stage.shards_params):
            if self._stage.buckets_behind is not None:  # update_behind: its hooks wait where the parameters are now
                self._stage.buckets_behind.model_changed()

    def _check_layout(self) -> None:
        """Refuse param groups whose parameters changed since they were laid out (torch steps whatever the lists
        hold at step(); here each group's parameters live in flat buffers built once)."""
        groups = self.param_groups
        if len(groups) == len(self._layout) and all(
                tuple(map(id, g["params"])) == ids for g, ids in zip(groups, self._layout)):
            return
        if len(groups) != len(self._layout):
            what = f"param_groups holds {len(groups)} groups, {len(self._layout)} when the optimizer laid them out"
        else:
            gi = next(i for i, (g, ids) in enumerate(zip(groups, self._layout)) if tuple(map(id, g["params"])) != ids)
            what = f"param group {gi}'s 'params' were edited after the optimizer laid them out"
        raise RuntimeError(f"{what}: ShardedOptimizer keeps each group's parameters in flat buffers laid out once. "
                           "Add parameters with optimizer.add_param_group({'params': [...]}) (stages 1-2), or build "
                           "a new optimizer over the new parameter list (save and load its state_dict() to keep the "
                           "states)")

    def _check_edits(self) -> None:
        """What user code changed since the build that this optimizer cannot serve: a parameter frozen when
        laid out now given a gradient, a param group's parameter list edited, a state[p] entry replaced by what
        the update cannot take."""
        refuse_unfrozen(self._stage.frozen, self._names, self.param_groups)
        self._check_layout()
        self._check_still_the_models()
        for part in self.partitions:
            check_state_edits(self.state, part)

    def _refusal(self, check, errors=(TypeError, ValueError, RuntimeError, LookupError, OSError)):
        """``(check(), None)``, or ``(None, error)`` for an ``errors`` it raised, which only this rank may have found:
        ``check`` makes no collective before it raises. Alone the error is raised now. Among ranks this rank goes
        through the step's collectives with the update skipped and raises at their end, nothing changed; its
        all-reduce's checksum says it refused, so the other ranks skip the step too and raise at their next
        step() (as for any disagreement), or at this one where every rank refused alike. Serves a bad
        hyperparameter (``update.read_hypers``), an edit of the parameters (``_check_edits``) and what a stage-3
        gather met since the last step (``Stage3.before_update``: an assigned tensor it cannot take, a failed read of
        an NVMe param shard); a gradient the step cannot take comes the same way (``_reduce_grads``)."""
        try:
            return check(), None
        except errors as error:
            if self.topology.world_size == 1:
                raise
            return None, error

    def _reduce_grads(self) -> Exception | None:
        """Every reduction of the step started and finished; the error this rank found in its gradients before
        them (a .grad set by hand at stages 2-3, a sparse or reshaped one at stage 1), which ``_refusal`` serves:
        its reductions ran without those gradients, so the ranks stay in step."""
        refused = self.grad_sync.prepare_step()
        if refused is not None and self.topology.world_size == 1:  # alone: raised now, and found again next time
            self.grad_sync.refused = None  # (a .grad mended since is reduced then)
            raise refused
        return refused

    # -- phases -----------------------------------------------------------
    def _scaler(self, grad_scaler) -> ScalerInputs:
        device = self.partitions[0].flat.device if self.partitions else torch.device("cpu")
        return scaler_inputs(self, grad_scaler, device, grads_unscaled_in_place=not self.grad_sync.frees_grads,
                             reduced_before_unscale=self.grad_sync.reduced_scaled)

    def _stats(self, with_norm: bool, site, refusing: bool) -> StepStats:
        """The one all-reduce of clip_grad_norm_ (step() runs its two halves apart: its device body may be a
        replayed graph). The verdict stays on the device (``StepStats.disagree``) and is posted to ``_verdicts``."""
        vector, flags = self._stats_input(with_norm, site, refusing)
        stats = reduce_stats(self.comm, self.partitions, vector, flags, with_norm, self.topology.replicate)
        self._verdicts.post(stats.disagree)
        return stats

    def _stats_input(self, with_norm: bool, site, refusing: bool) -> tuple[torch.Tensor, tuple[bool, ...]]:
        """The stats all-reduce's input on the device, sent without a wait, and this rank's has-grad flags (per
        partition, per parameter, flat). Its checksum covers what every rank must agree on now (``_stats_agreed``), how it got
        here (``site``: step or clip_grad_norm_; ``refusing``: this rank refuses the step), and what the last
        update used."""
        self._stats_agreed = self._agreed()
        self.grad_sync.clear_if_empty()  # nothing reduced since zero_grad(): the norm is 0, not the last step's
        flags = self.grad_sync.present.flat()
        check = checksum((self._stats_agreed, with_norm, site, self._last_update, refusing,
                          self.grad_sync.empty_at_step), self.topology.world_size)
        return stats_vector(self.partitions, flags, check), tuple(flags)

    def _raise_if_disagreed(self, every: bool = False) -> None:
        """Raise on every rank if a step's all-reduce found the ranks disagreeing (``every``: also the step in
        progress; else the steps that ended). Called after the step's reductions, before its own all-reduce."""
        if self._verdicts.check_all() if every else self._verdicts.check_due():
            self._last_update = None  # what the skipped step would have used: not checked again at the next one
            if not every:  # inside step() or clip_grad_norm_: this step's gradients are dropped
                self.grad_sync.end_step()
                self._forget_clips()
            raise RuntimeError(
                "ranks disagree on this step or the one before it, which was skipped on every rank (nothing "
                "changed): a param group's hyperparameters (lr, betas, eps, weight_decay, ...; an LR scheduler "
                "stepped with each rank's own metric, as ReduceLROnPlateau given a local loss: all_reduce the metric "
                "first), the optimizer's options, or whether the step clips (clip_grad_norm_, clip_grad_value_ and its value) or uses a "
                "GradScaler differ across ranks, or "
                "a rank refused the step and raised why (a bad hyperparameter, a .grad set by hand or unlike its "
                "parameter, a param group's parameters edited, a bad clip_grad_norm_ argument, a closure that "
                "raised, a stage-3 gather that could not read an NVMe parameter file), or at stages 2-3 a rank had no gradient reduced since its last step while the others had "
                "(it skipped the backward they ran, called step() twice, or zero_grad() between its backward and "
                "step()); set hyperparameters (and call clip_grad_norm_ / the scaler) identically on every rank, "
                "and to skip a batch, agree on it across ranks first (all_reduce the flag) so that every rank skips")

    @reason_left_for_peers("check_agreement()")
    @eager_under_compile
    def check_agreement(self) -> None:
        """Raise on every rank if the ranks disagreed on a step whose verdict is still on its way (``step()``)."""
        self._raise_if_disagreed(every=True)

    def _update(self, has_grad: tuple[tuple[bool, ...], ...], grad_scale: torch.Tensor | None,
                skip: torch.Tensor | None, hypers) -> None:
        """The update, then the stage's ``after_update``. With offloaded states on a GPU (stages 1-2: when built
        with the model) the update is planned here and the host update left running behind the step
        (behind.py, behind_buckets.py); stages 1-2 with ``update_behind`` and the states beside the parameters
        update here and leave the all-gathers running behind the step (gathers_behind.py)."""
        mark_written(self.partitions, has_grad, self._shared_versions)
        behind = self._stage.behind
        if behind is None or behind.gathers_only:
            # a store that can fail (a disk): every rank learns whether every rank's update succeeded before any commits
            agree = self.topology.agree if self.config.on_disk and self.topology.world_size > 1 else None
            with label(UPDATE):
                update_all(self.partitions, self.state, has_grad, grad_scale, skip, hypers, agree,
                           read_skip=self._graph is None)
            if behind is None:
                self._stage.after_update(self.partitions, has_grad)
            else:  # stages 1-2, update_behind without offload: the all-gathers go behind step() (gathers_behind.py)
                self._stage.start_behind(self.partitions, None, has_grad)
            return
        with label(UPDATE):
            plan = plan_update(self.partitions, self.state, has_grad, grad_scale, skip, hypers)
        self._stage.after_update(self.partitions, has_grad)  # drops staged copies before the worker writes
        self._stage.start_behind(self.partitions, plan, has_grad)

    def _steps_finished(self) -> int:
        return self._steps_done

    def _end_step(self) -> None:
        self._steps_done += 1
        if len(self.__dict__["state"]) != self._state_len:  # new states (a first step, a new group): in torch's order
            # (not the property: it would wait for the update running behind this step)
            self._order_state()
        self._verdicts.end_step()
        self.grad_sync.end_step()
        self._forget_clips()
        self._last_traffic = self.comm.traffic()
        self.comm.reset_traffic()
        for kind, n in self.topology.replicate_traffic().items():  # HSDP: what crossed between the replicas, apart
            self._last_traffic[f"replicate_{kind}"] = n
        # stage 3: this step's gathers (hpZ's inside a node apart); the reductions over a group of their own
        own = {} if self._reduce_comm is self.comm else self._reduce_comm.traffic()
        self._reduce_comm.reset_traffic()
        for kind, n in (*self._stage.traffic().items(), *own.items()):
            self._last_traffic[kind] = self._last_traffic.get(kind, 0) + n


    def _order_state(self) -> None:
        """``self.state`` in param_groups order, as torch.optim's first step creates it (the partitions create the
        states in their layout order, which is backward's): ``list(optimizer.state.values())[0]`` is the first
        parameter's. Other keys keep their place after them. (The update behind a step touches the shards only.)"""
        state = self.__dict__["state"]
        first = [p for p in dict.fromkeys(p for g in self.param_groups for p in g["params"]) if p in state]
        ids = {id(p) for p in first}
        for key in first + [k for k in state if id(k) not in ids]:
            dict.__setitem__(state, key, dict.pop(state, key))  # (a move, not an edit: OptimizerState)
        self._state_len = len(state)


ShardOwner.register(ShardedOptimizer)  # what fused_zero.checkpoint saves and loads


#: step() from a gradient hook while backward runs (torch's "optimizer in backward" pattern), stages 2-3
STEP_IN_BACKWARD = (
    "step() was called during backward (from a gradient hook): at stage {stage} the gradients are reduced as "
    "backward produces them and reach the shards only once it ends, so a step inside it would update from a part "
    "of them. Call step() after loss.backward() returns (fusing the step into backward saves no memory here: the "
    "full gradients never stay), or use stage=1, where it steps as torch's")


def _in_autograd_engine() -> bool:
    """Whether this thread runs inside autograd's engine now (a hook called by backward)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1
