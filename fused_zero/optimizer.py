"""ShardedOptimizer: ZeRO stages 1, 2 and 3 as a drop-in torch.optim.Optimizer.

step() has three phases:
1. reduce: wait for the buckets' reduce-scatters (stage 2 launched them
   during backward; stage 1 launches them now);
2. update: one all-reduce of a few scalars (which parameters got a gradient
   on any rank, the squared grad norm and a non-finite flag when clipping or
   a GradScaler needs them), then the fused AdamW kernel over this rank's
   fp32 master shard, writing the narrow param shard in the same pass;
3. gather: all-gather every updated bucket back into the full param buffer
   (stage 3 gathers nothing here: each unit's next forward does, see stage3.py).

Semantics follow torch.optim.AdamW: a parameter whose gradient is None on
every rank is not updated and its step count does not advance; a step that a
GradScaler finds non-finite is skipped on every rank and does not count.
"""
from __future__ import annotations

import math
import warnings
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from . import ops
from .buffers import STATE_KINDS, Partition, PartitionIndex
from .collectives import Comm
from .config import ALIGN, ZeroConfig
from .layout import build_layout
from .reducer import GradReducer
from .stage3 import ParamGatherer
from .units import plan_units

# GradScaler passes itself to step() when step() takes `grad_scaler`: that is
# how it learns the globally agreed found_inf (see _scaler_inputs). The
# deprecation notice it prints for that protocol says nothing to our users.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_hyperparameters(lr, betas, eps, weight_decay) -> None:
    # torch.optim.AdamW's checks and wording.
    if not isinstance(lr, torch.Tensor) and not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


class ShardedOptimizer(torch.optim.Optimizer):
    """AdamW (or Adam) with ZeRO-sharded states, grads and fused kernels.

    Replace ``torch.optim.AdamW(model.parameters(), ...)`` with
    ``ShardedOptimizer(model.parameters(), ...)`` and do not wrap the model
    in DDP: gradients are averaged over ``process_group`` (the default group
    when one is initialised, else a single rank) by the optimizer itself.
    """

    _step_supports_amp_scaling = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 stage: int = 2, bucket_numel: int = 1 << 24, reduce_dtype: torch.dtype | None = None,
                 adam_w_mode: bool = True, max_grad_norm: float | None = None, overlap: bool = True,
                 maximize: bool = False, process_group=None, config: ZeroConfig | None = None,
                 module: nn.Module | None = None, units=None, max_live_units: int = 2,
                 reshard_after_forward: bool = True) -> None:
        options = dict(stage=stage, bucket_numel=bucket_numel, reduce_dtype=reduce_dtype,
                       adam_w_mode=adam_w_mode, max_grad_norm=max_grad_norm, overlap=overlap,
                       max_live_units=max_live_units, reshard_after_forward=reshard_after_forward)
        if config is None:
            config = ZeroConfig(**options)
        elif options != dict(ZeroConfig().__dict__):
            raise ValueError("pass either config= or the keyword options (stage=, bucket_numel=, ...), not both")
        _check_hyperparameters(lr, betas, eps, weight_decay)
        if isinstance(params, nn.Module):
            if module is not None and module is not params:
                raise ValueError("the first argument is a model and module= names another one; pass one model")
            module, params = params, list(params.parameters())
        if module is None and config.stage == 3:
            raise ValueError("stage 3 shards the model's parameters: pass the nn.Module itself, "
                             "ShardedOptimizer(model, stage=3, ...), or its param groups with module=model")
        if units is not None and config.stage != 3:
            raise ValueError("units= only applies to stage 3")
        self._names: dict[nn.Parameter, str] = {} if module is None else {p: n for n, p in module.named_parameters()}
        self.module = module
        self._units = units
        self.gatherer: ParamGatherer | None = None
        self.config = config
        self.comm = Comm(process_group)
        self.partitions: list[Partition] = []
        self.reducer: GradReducer | None = None
        self._clip_coef: torch.Tensor | None = None
        self._last_traffic = {"reduce_scatter": 0, "all_gather": 0, "all_reduce": 0}
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)
        self._build()

    # -- construction -----------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            for p in group["params"]:
                self._check_param(p)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        if self.reducer is not None:  # after construction: lay out the new group too
            if self.config.stage == 3:
                self.param_groups.pop()
                raise RuntimeError("stage 3 lays out every parameter of the model at construction; pass all "
                                   "param groups to ShardedOptimizer(..., module=model) instead of add_param_group")
            self._build()

    def _check_param(self, p: torch.Tensor) -> None:
        name = self._names.get(p, f"of shape {tuple(p.shape)}")
        if p.is_sparse or p.layout != torch.strided:
            raise TypeError(f"parameter {name} is sparse ({p.layout}); ShardedOptimizer needs dense parameters")
        if p.is_complex():
            raise TypeError(f"parameter {name} is complex ({p.dtype}); ShardedOptimizer supports float32, "
                            "bfloat16 and float16: pass torch.view_as_real(p) as a real parameter")
        if p.dtype not in _DTYPES:
            raise TypeError(f"parameter {name} has dtype {p.dtype}; ShardedOptimizer supports float32, "
                            "bfloat16 and float16 parameters")
        first = self.param_groups[0]["params"][0]
        if p.device != first.device:
            raise ValueError(f"parameter {name} is on {p.device} but the first parameter is on {first.device}; "
                             "move the model to one device before building the optimizer")

    def _build(self) -> None:
        """Lay out every group, check all ranks agree, broadcast rank 0's values."""
        if self.reducer is not None:
            self.reducer.wait()
            self.reducer.close()
        if self.config.stage == 3:
            return self._build_stage3()
        signature = [(gi, self._names.get(p, i), tuple(p.shape), str(p.dtype), p.requires_grad)
                     for gi, g in enumerate(self.param_groups) for i, p in enumerate(g["params"])]
        self.comm.check_same(signature, "parameters", hint="build the optimizer with the same parameters, "
                             "in the same groups and order, on every rank")
        built = {id(part.params[0]): part for part in self.partitions}
        partitions, positions, position = [], [], {}
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                position.setdefault(p, len(position))
            for dtype in dict.fromkeys(p.dtype for p in group["params"]):
                # Reverse order, as DDP's buckets: backward reaches the last parameters
                # first, so the short remainder bucket (the layout's last) holds the first
                # parameters and is the last to reduce, leaving step() little to wait for.
                params = [p for p in reversed(group["params"]) if p.dtype == dtype]
                part = built.get(id(params[0])) or self._new_partition(gi, params)
                partitions.append(part)
                positions.append([position[p] for p in params])
        self.partitions = partitions
        self.reducer = GradReducer(partitions, positions, self.comm, self.config.stage, self.config.overlap)

    def _new_partition(self, group_index: int, params: list[nn.Parameter]) -> Partition:
        """Lay ``params`` (one dtype) out flat, with rank 0's values on every rank."""
        layout = build_layout([p.numel() for p in params], self.comm.world_size, self.config.bucket_numel, ALIGN)
        part = Partition(group_index, params, layout, self.comm.rank, self.config.reduce_dtype or params[0].dtype)
        if self.comm.world_size > 1:
            self.comm.broadcast(part.flat, src=0)
            part.load_master_from_params()
        return part

    def _build_stage3(self) -> None:
        """One partition per (unit, group, dtype); the gatherer owns the full buffers."""
        plan = plan_units(self.module, self._units)
        group_of = {p: gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        in_module = {p for ps in plan.params for p in ps}
        missing = [self._names[p] for p in self._names if p not in group_of]
        if missing:
            raise ValueError(f"stage 3 shards every parameter of the model, but {missing[:5]} "
                             f"{'(and more) ' if len(missing) > 5 else ''}are in no param group; "
                             "add them to a group (frozen ones too)")
        extra = [tuple(p.shape) for p in group_of if p not in in_module]
        if extra:
            raise ValueError(f"param groups hold {len(extra)} parameters (shapes {extra[:5]}) that are not "
                             "parameters of the model passed as module=")
        unit_of = {p: ui for ui, ps in enumerate(plan.params) for p in ps}
        signature = [(group_of[p], unit_of[p], name, tuple(p.shape), str(p.dtype), p.requires_grad)
                     for p, name in self._names.items()]
        self.comm.check_same(signature, "parameters", hint="build the same model and param groups on every rank")
        position = {p: i for i, p in enumerate(p for ps in plan.params for p in ps)}
        unit_parts, positions = [], []
        for ps in plan.params:
            parts = []
            for gi in range(len(self.param_groups)):
                mine = [p for p in reversed(ps) if group_of[p] == gi]
                for dtype in dict.fromkeys(p.dtype for p in mine):
                    params = [p for p in mine if p.dtype == dtype]
                    parts.append(self._new_partition(gi, params))
                    positions.append([position[p] for p in params])
            unit_parts.append(parts)
        self.partitions = [part for parts in unit_parts for part in parts]
        # The root (unit 0) holds the lowest positions: its buckets reduce last, after the
        # embedding's gradient, which backward produces at the very end.
        self.reducer = GradReducer(self.partitions, positions, self.comm, 3, self.config.overlap)
        self.gatherer = ParamGatherer(plan.modules, unit_parts, self.comm.duplicate(),
                                      self.config.max_live_units, self.config.reshard_after_forward)

    # -- the training-loop API --------------------------------------------
    @contextmanager
    def full_parameters(self, writeback: bool = False):
        """Inside, every parameter of the model holds its full value (all ranks must enter).

        For export or evaluation under stage 3: ``model.state_dict()`` inside the
        block reads full tensors (clone what you keep). ``writeback=True`` copies
        changes made inside back into the master weights. Stages 1 and 2 always
        hold full parameters; there it only applies ``writeback``.
        """
        with self.gatherer.full_parameters() if self.gatherer is not None else nullcontext():
            yield
            if writeback:  # stage 3: before the gathered copies are released
                for part in self.partitions:
                    part.load_master_from_params()

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally: backward passes inside do not reduce."""
        with self.reducer.no_sync():
            yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.reducer.zero_grad(set_to_none)
        self._clip_coef = None
        super().zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, grad_scaler=None) -> torch.Tensor:
        """Clip the global gradient norm in the next step(); return the norm.

        Equals ``torch.nn.utils.clip_grad_norm_`` over the full averaged
        gradients. With a GradScaler and stage 2, pass ``grad_scaler`` (or
        use ``max_grad_norm=``) so the norm is taken of unscaled gradients.
        """
        if norm_type != 2.0:
            raise ValueError(f"only the 2-norm is supported, got norm_type={norm_type}")
        self._reduce()
        inv_scale = self._scaler_inputs(grad_scaler)[0] if grad_scaler is not None else None
        stats = self._all_reduce_stats(with_norm=True)
        total = self._total_norm(stats, inv_scale)
        self._clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return total

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._reduce()
        inv_scale, found_inf, scaler_state = self._scaler_inputs(grad_scaler)
        need_norm = self._clip_coef is None and self.config.max_grad_norm is not None
        stats = self._all_reduce_stats(with_norm=need_norm or scaler_state is not None or found_inf is not None)
        active = stats[2:].tolist()
        if scaler_state is not None or found_inf is not None:
            found = (stats[1] > 0).float()
            if found_inf is not None:
                found = torch.maximum(found, found_inf.to(found))
            if scaler_state is not None:
                scaler_state["found_inf_per_device"] = {found.device: found}
            if found.item():
                self._end_step()
                return loss
        coef = self._clip_coef
        if need_norm:
            total = self._total_norm(stats, inv_scale)
            coef = torch.clamp(self.config.max_grad_norm / (total + 1e-6), max=1.0)
        grad_scale = inv_scale
        if coef is not None:
            grad_scale = coef if grad_scale is None else grad_scale * coef
        self._update(active, grad_scale)
        if self.gatherer is not None:
            self.gatherer.release_all()  # the next forward gathers the new values
        else:
            self._gather(active)
        self._end_step()
        return loss

    # -- phases -----------------------------------------------------------
    def _reduce(self) -> None:
        if self.config.stage == 1:
            self.reducer.reduce_all()
        else:
            stale = self.reducer.unreduced_grads()
            if stale:
                raise RuntimeError(
                    f"{len(stale)} parameters hold gradients that were never reduced (accumulated under "
                    "no_sync() without a final backward outside it); run the last micro-batch's backward "
                    "outside opt.no_sync()")
        self.reducer.wait()

    def _all_reduce_stats(self, with_norm: bool) -> torch.Tensor:
        """[squared grad norm, non-finite flag, has-grad per param...], summed over ranks."""
        params = [p for part in self.partitions for p in part.params]
        device = self.partitions[0].flat.device if self.partitions else torch.device("cpu")
        stats = torch.zeros(2 + len(params), dtype=torch.float32, device=device)
        if with_norm and self.partitions:
            norm = ops.norm_stats_many([part.grad_shard for part in self.partitions])
            stats[0], stats[1] = norm.sq_sum, norm.nonfinite
        has = self.reducer.present
        stats[2:] = torch.tensor([p in has for p in params], dtype=torch.float32)
        self.comm.all_reduce(stats)
        return stats

    @staticmethod
    def _total_norm(stats: torch.Tensor, inv_scale: torch.Tensor | None) -> torch.Tensor:
        total = stats[0].sqrt()
        return total if inv_scale is None else total * inv_scale

    def _update(self, active: list[float], grad_scale: torch.Tensor | None) -> None:
        flags = iter(active)
        for part in self.partitions:
            group = self.param_groups[part.group_index]
            steps = {}
            for p, flag in zip(part.params, flags):
                if flag:
                    state = self.state[p]
                    if "step" not in state:
                        state["step"] = torch.tensor(0.0)
                    state["step"] += 1
                    steps[p] = int(state["step"])
            beta1, beta2 = group["betas"]
            for start, end, step in self._runs(part, steps):
                ops.adamw_(part.master[start:end], part.grad_shard[start:end], part.exp_avg[start:end],
                           part.exp_avg_sq[start:end], step=step, lr=group["lr"], beta1=beta1, beta2=beta2,
                           eps=group["eps"], weight_decay=group["weight_decay"],
                           adam_w_mode=self.config.adam_w_mode, maximize=group.get("maximize", False),
                           param_out=None if part.param_shard is None else part.param_shard[start:end],
                           grad_scale=grad_scale)

    def _runs(self, part: Partition, steps: dict) -> list[tuple[int, int, int]]:
        """Maximal [start, end) shard ranges of active params sharing a step count.

        Padding between two pieces of one run is updated too (it stays zero).
        """
        runs: list[list[int]] = []
        current = None
        for piece in part.pieces:
            step = steps.get(part.params[piece.param_index])
            if step is None:
                current = None
                continue
            if current is not None and current[2] == step:
                current[1] = piece.shard_offset + piece.numel
            else:
                current = [piece.shard_offset, piece.shard_offset + piece.numel, step]
                runs.append(current)
        return [tuple(r) for r in runs]

    def _gather(self, active: list[float]) -> None:
        flags = iter(active)
        handles = []
        for part in self.partitions:
            updated = [bool(next(flags)) for _ in part.params]
            for k, b in enumerate(part.layout.buckets):
                if any(updated[j] for j in part.bucket_params[k]):
                    handles.append(self.comm.all_gather(part.bucket(part.flat, b), part.gather_source(b),
                                                        async_op=True))
        for h in handles:
            h.wait()

    def _end_step(self) -> None:
        self.reducer.end_step()
        self._clip_coef = None
        self._last_traffic = self.comm.traffic()
        self.comm.reset_traffic()
        if self.gatherer is not None:  # the gathers of this step's forward and backward
            for kind, n in self.gatherer.comm.traffic().items():
                self._last_traffic[kind] += n
            self.gatherer.comm.reset_traffic()

    def _scaler_inputs(self, grad_scaler):
        """(inverse loss scale or None, found_inf or None, the scaler's per-optimizer state or None)."""
        if grad_scaler is None or not grad_scaler.is_enabled():
            # The attribute protocol: GradScaler sets these when step() takes no grad_scaler.
            scale = getattr(self, "grad_scale", None)
            inv = None if scale is None else scale.double().reciprocal().float()
            return inv, getattr(self, "found_inf", None), None
        from torch.amp.grad_scaler import OptState

        state = grad_scaler._per_optimizer_states[id(self)]
        # Stage 1 keeps .grad: scaler.unscale_(opt) has already unscaled it in place.
        if state["stage"] is OptState.UNSCALED and self.config.stage == 1:
            return None, None, state
        scale = grad_scaler._scale
        return scale.double().reciprocal().float().to(self.partitions[0].flat.device), None, state

    # -- accounting and state ---------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the model state, by kind."""
        totals = dict.fromkeys(["params", "grads", "master", "exp_avg", "exp_avg_sq", "buffers"], 0)
        for part in self.partitions:
            b = part.shard_bytes()
            totals["params"] += b["params"]
            totals["grads"] += b["grad_shard"] + sum(p.grad.numel() * p.grad.element_size()
                                                     for p in part.params if p.grad is not None)
            totals["master"] += b["master"]
            totals["exp_avg"] += b["exp_avg"]
            totals["exp_avg_sq"] += b["exp_avg_sq"]
            # stage 3: the narrow param shard is the resident copy of the params
            totals["params" if self.gatherer is not None else "buffers"] += b["param_shard"]
        totals["buffers"] += self.reducer.buffer_bytes()
        return totals

    def comm_bytes(self) -> dict[str, int]:
        """Bytes per collective in the last step, counted as the ZeRO paper does."""
        return dict(self._last_traffic)

    def state_dict(self) -> dict:
        """torch.optim.AdamW's state_dict of the whole optimizer. COLLECTIVE: every rank calls it.

        As FSDP's optim_state_dict, it all-gathers the full fp32 state into every rank's CPU
        memory (8 bytes per trained element, 12 for bf16/fp16 parameters, whose fp32 master
        goes under the extra state key "master"), in bounded chunks; identical on every rank.
        ``torch.optim.AdamW(same groups).load_state_dict()`` takes it, and vice versa.
        """
        from .checkpoint.optim_state import gather_state_dict

        return gather_state_dict(self)

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state_dict() (or a torch.optim.AdamW one) at any world size and stage; every rank calls it.

        Hyperparameters and step counts come from the dict; the parameters keep their values
        (load the model's own state dict for them), the fp32 masters come from them, or from a
        saved "master" where it rounds to them. A bad dict raises on every rank.
        """
        from .checkpoint.optim_state import load_state_dict

        load_state_dict(self, state_dict)

    # -- the shards, for checkpoints ---------------------------------------
    def shard_index(self) -> tuple[PartitionIndex, ...]:
        """This rank's shards: one entry per partition, in partition order."""
        return tuple(PartitionIndex(part.group_index, tuple(part.params), part.shapes, part.pieces,
                                    part.layout.shard_numel, STATE_KINDS) for part in self.partitions)

    def read_shard(self, partition: int, kind: str, start: int, end: int) -> torch.Tensor:
        """A CPU copy of elements [start, end) of partition ``partition``'s ``kind`` shard."""
        if kind not in STATE_KINDS:
            raise ValueError(f"kind must be one of {STATE_KINDS}, got {kind!r}")
        self.reducer.wait()
        return getattr(self.partitions[partition], kind)[start:end].detach().to("cpu", copy=True)

    @torch.no_grad()
    def load_shards(self, staged) -> None:
        """Write whole shards, then make the parameters what the masters say (every rank joins).

        ``staged`` holds one mapping per partition (shard_index() order) from a state
        kind to a tensor of the shard's size, or None to keep that kind as it is.
        """
        if len(staged) != len(self.partitions):
            raise ValueError(f"load_shards got {len(staged)} partitions; this optimizer has {len(self.partitions)}")
        self.reducer.wait()
        for part, new in zip(self.partitions, staged):
            for kind, t in new.items():
                if t is not None:
                    getattr(part, kind).copy_(t)
        self._params_from_master()

    @torch.no_grad()
    def _params_from_master(self) -> None:
        """Make the model's parameters what the fp32 master shards say (every rank joins).

        For whoever wrote the master shards directly (load_state_dict, checkpoint
        loading): the narrow param shards are re-rounded and the full parameters
        all-gathered, so the next forward sees the loaded weights.
        """
        self.reducer.wait()
        for part in self.partitions:
            if part.param_shard is not None:
                part.param_shard.copy_(part.master)
        if self.gatherer is not None:
            self.gatherer.release_all()
        else:
            self._gather([1.0] * sum(len(part.params) for part in self.partitions))
        self.comm.reset_traffic()
