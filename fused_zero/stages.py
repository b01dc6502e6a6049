"""The ZeRO stages as strategy objects: what each shards, and the verbs the optimizer calls.

- ``Stage1``: optimizer states sharded; ``.grad`` kept and reduced at step;
  updated shards all-gathered back into the full parameters after the update.
- ``Stage2``: also gradients: each bucket reduce-scattered during backward and
  ``.grad`` freed once packed.
- ``Stage3``: also parameters: the model is cut into units (sharding/units.py) whose
  parameters are gathered just in time (comm/gatherer.py) and released after use;
  the update gathers nothing.

The optimizer calls ``build`` (lay out partitions), ``grad_hook`` (once: what its gradient hooks call),
``end_backward`` (from its end-of-backward callback), ``after_update`` (gather or release),
``full_parameters`` and ``close``; it reads ``reducer`` (the gradient
reducer's class, comm/grad_sync.py), ``shards_params`` (memory accounting) and ``can_add_groups``.
Nothing outside this file and config.py branches on the stage number (others ask ``STAGE_TRAITS``).
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

from .comm.codec import codec_for
from .comm.collectives import Comm
from .comm.topology import Topology
from .config import ALIGN, STAGE_TRAITS, ZeroConfig
from .comm.gatherer import ParamGatherer
from .comm.grad_sync import ReduceAmongGathers, ReduceAtStep, ReduceInBackward
from .comm.param_sync import ParamSync
from .comm.secondary import SecondaryCopies
from .frozen import gather_frozen, load_frozen, split_frozen
from .generation_sync import mark_generation_synced
from .ownership import held
from .sharding.layout import build_layout
from .sharding.partition import Partition, unalias
from .sharding.units import plan_units, resolve_units
from .behind import UpdateBehind
from .behind_buckets import BucketsBehind
from .tiers.factory import Tiers
from .tiers.tier import Tier
from .tiers.staging import Staging


class Stage1:
    """Shard the optimizer states."""

    number = 1
    traits = STAGE_TRAITS[1]
    reducer = ReduceAtStep
    can_add_groups = True
    #: the host update running behind step() (offloaded states with the parameters on a GPU: behind.py; stages
    #: 1-2 only when built with the model, behind_buckets.py), or None: inside step()
    behind: UpdateBehind | None = None
    buckets_behind: BucketsBehind | None = None

    @property
    def shards_params(self) -> bool:
        return self.traits.shards_params

    def __init__(self, topology: Topology, config: ZeroConfig) -> None:
        self.topology = topology
        self._offload_checked = False  # check_offload ran (once: before a previous optimizer closes)
        self.comm = topology.shard
        self.config = config
        self.sync = ParamSync(self.comm)
        self.frozen: list[nn.Parameter] = []  # frozen at build: the user's tensors (stage 3: in frozen_parts)
        self.frozen_parts: list[Partition] = []  # stage 3: the weights-only partitions, gathered with their unit
        # shared by the offloaded stores of every partition
        self.staging = Staging(config.offload_chunk_numel, direct=config.nvme_direct)
        self.tiers = Tiers.from_config(config, self.staging, self.shards_params)

    # -- construction -----------------------------------------------------
    def check_groups(self, groups: list[dict], names: dict, outside: list[nn.Parameter] = ()) -> None:
        """Raise on every rank unless every rank holds the same parameters in the same groups and order (and the
        same ``outside`` ones, which the build broadcasts)."""
        signature = [(gi, names.get(p, i), tuple(p.shape), str(p.dtype), p.requires_grad)
                     for gi, g in enumerate(groups) for i, p in enumerate(g["params"])]
        signature += [("outside the groups", names.get(p, i), tuple(p.shape), str(p.dtype))
                      for i, p in enumerate(outside)]
        self.topology.check_same(signature, "parameters", hint="build the optimizer with the same parameters, "
                             "in the same groups and order, on every rank")

    def _outside(self, groups: list[dict], module: nn.Module | None) -> list[nn.Parameter]:
        """The model's parameters in no group that no other optimizer trains (a frozen base left out of the groups,
        peft's habit): DDP's constructor gives every rank rank 0's values of all of them, so the build does too."""
        if module is None or self.topology.world_size == 1:
            return []
        grouped = {p for g in groups for p in g["params"]}
        return [p for p in module.parameters() if p not in grouped and not held(p)]

    def build(self, groups: list[dict], names: dict, module: nn.Module | None, units,
              begin_backward: Callable[[], None], previous: list[Partition],
              first_forward: Callable[[], None] | None = None) -> tuple[list[Partition], list[list[int]]]:
        """One partition per (param group, dtype), and each parameter's position (for bucket order).

        Partitions in ``previous`` (a rebuild after add_param_group) are kept with their states.
        """
        self.names = names
        self.check_offload()
        outside = self._outside(groups, module) if not previous else []  # (a rebuild: broadcast at the first)
        self.check_groups(groups, names, outside)
        self._broadcast_values(outside)
        built = {id(part.params[0]): part for part in previous}
        built_params = {p for part in previous for p in part.params}
        partitions, positions, position = [], [], {}
        for gi, group in enumerate(groups):
            for p in group["params"]:
                position.setdefault(p, len(position))
            # a parameter trained before a rebuild (add_param_group) and frozen for now (peft's set_adapter) keeps its
            # place, its state and its gradient's way, as torch's AdamW keeps its state: only one frozen at the first
            # build is frozen for this optimizer
            trainable, frozen = split_frozen(group["params"], trained=built_params)
            self._take_frozen(frozen)
            for dtype in dict.fromkeys(p.dtype for p in trainable):
                # Reverse order, as DDP's buckets: backward reaches the last parameters
                # first, so the short remainder bucket (the layout's last) holds the first
                # parameters and is the last to reduce, leaving step() little to wait for.
                params = [p for p in reversed(trainable) if p.dtype == dtype]
                partitions.append(built.get(id(params[0])) or self._new_partition(gi, group, params))
                positions.append([position[p] for p in params])
        self._behind_buckets(module, partitions, names)
        return partitions, positions

    def _overlaps(self, device: torch.device) -> bool:
        """Whether the host update runs behind step(): offloaded states, the parameters on a GPU (on CPU the
        forward would take the update's cores; the tests set ``UpdateBehind.on_cpu``)."""
        return self.tiers.states is not Tier.DEVICE and (device.type != "cpu" or UpdateBehind.on_cpu)

    def _agree_group(self) -> Comm | None:
        """The update worker's gloo group for the ranks' verdicts (None: one rank); made once, as every rank
        builds alike."""
        if getattr(self, "_agree", None) is None and self.topology.world_size > 1:
            self._agree = self.topology.everyone(backend="gloo")
        return getattr(self, "_agree", None)

    def _gather_group(self) -> Comm:
        """Stages 1-2 behind step(): the group the worker gathers the updated buckets on; made once."""
        if getattr(self, "_gathers", None) is None:
            self._gathers = self.topology.own_group()
        return self._gathers

    def _behind_buckets(self, module: nn.Module | None, partitions: list[Partition], names: dict) -> None:
        """With ``update_behind`` (the model given): offloaded states on a GPU, the update runs behind step()
        bucket by bucket (behind_buckets.py); states in the parameters' memory with more than one rank to gather
        from (the shard group: HSDP's replicas gather nothing), the update stays inside step() and the all-gathers
        go behind it (gathers_behind.py); otherwise all inside step()."""
        if self.buckets_behind is not None:  # a rebuild (add_param_group): the new partitions' buckets
            self.buckets_behind.close()
            self.buckets_behind = self.behind = None
        device = partitions[0].flat.device if partitions else torch.device("cpu")
        if not self.config.update_behind or module is None or not partitions:
            return
        gathers_only = self.tiers.states is Tier.DEVICE
        if not (self.topology.shard.world_size > 1 if gathers_only else self._overlaps(device)):
            return
        self.buckets_behind = BucketsBehind(module, partitions, ParamSync(self._gather_group()), device,
                                            None if gathers_only else self._agree_group(), names,
                                            gathers_only=gathers_only)
        self.behind = self.buckets_behind.behind

    def _take_frozen(self, frozen: list[nn.Parameter]) -> None:
        """Frozen parameters stay the user's tensors, with rank 0's values on every rank (as DDP's constructor)."""
        known = set(self.frozen)
        new = [p for p in frozen if p not in known]
        self.frozen += new
        self._broadcast_values(new)

    def _broadcast_values(self, params: list[nn.Parameter]) -> None:
        """Rank 0's values of ``params`` on every rank, in place."""
        if self.topology.world_size > 1:
            for p in params:  # one by one, in place: no second copy of a large frozen base
                t = p.data if p.data.is_contiguous() else p.data.contiguous()
                self.topology.broadcast(t, src=0)
                if t is not p.data:
                    p.data.copy_(t)

    def _new_partition(self, group_index: int, group: dict, params: list[nn.Parameter],
                       frozen: bool = False) -> Partition:
        """Lay ``params`` (one dtype) out flat, with rank 0's values on every rank (``frozen``: weights only)."""
        layout = build_layout([p.numel() for p in params], self.comm.world_size, self.config.bucket_numel, ALIGN)
        def make() -> Partition:
            return Partition(group_index, params, layout, self.comm.rank, self.config.reduce_dtype or params[0].dtype,
                             amsgrad=bool(group.get("amsgrad", False)), tiers=self.tiers, frozen=frozen)
        if self.topology.world_size > 1 and self.tiers.offloaded:
            # an offload tier's room (a file's space, pinned host memory) can be missing on one rank alone: every
            # rank raises here, none waits in the broadcast below (the partitions built so far are collected)
            part = self.topology.agree(make)
        else:
            part = make()
        if self.topology.world_size > 1:
            self.topology.broadcast(part.flat, src=0)
            part.load_master_from_params()
        return part

    def check_offload(self) -> None:
        """The NVMe folder is usable on every rank (or every rank raises, before any collective); once."""
        if not self._offload_checked:
            self.tiers.check(self.topology.agree)
            self._offload_checked = True

    def precheck(self, module: nn.Module | None, units) -> None:
        """What can refuse the build without touching the parameters, before a previous optimizer over them is
        closed (a refused constructor leaves it working): the NVMe folder (stage 3: also ``units``)."""
        self.check_offload()

    # -- the training loop --------------------------------------------------
    def grad_hook(self):
        """What the optimizer's gradient hook calls with each parameter after the reducer's, or None (nothing:
        the hook then makes no call)."""
        return None

    def end_backward(self) -> None:
        pass

    def before_update(self, partitions: list[Partition]) -> None:
        """Take in what user code did to the parameters since the last step (load_state_dict, .to(), ...); raises
        the first change that cannot be taken in after taking in every other (the step is then refused)."""
        refused = None
        for part, changed in zip(partitions, unalias(partitions)):
            try:
                part.adopt_outside_changes(self.names, changed)
            except RuntimeError as error:
                refused = refused or error
        if refused is not None:
            raise refused

    def check_fit(self, partitions: list[Partition]) -> None:
        """Raise what ``before_update`` would refuse, changing nothing."""
        for part in partitions:
            part.check_fit(self.names)

    def after_update(self, partitions: list[Partition], updated: tuple[tuple[bool, ...], ...]) -> None:
        """The updated shards back into every rank's full parameters (behind step(): as each bucket is updated)."""
        if self.buckets_behind is None:
            self._gather_now(partitions, updated)

    def params_from_shards(self, partitions: list[Partition]) -> None:
        """The shards were written whole (a checkpoint load): every rank's full parameters take them now, also
        where step() leaves its gathers behind (``after_update`` then gathers nothing)."""
        self._gather_now(partitions, tuple((True,) * len(part.params) for part in partitions))

    def _gather_now(self, partitions: list[Partition], updated: tuple[tuple[bool, ...], ...]) -> None:
        self.sync.gather_updated(partitions, updated)
        for part in partitions:
            part.mark_synced()

    def start_behind(self, partitions: list[Partition], plan, updated) -> None:
        """Run the planned update behind step() (``behind`` is set); ``updated``: the step's has-grad flags."""
        self.buckets_behind.start(plan, updated)

    def settle(self) -> None:
        """Wait for the update behind the last step (raising if it failed, undone); the parameters are whole."""
        if self.buckets_behind is not None:
            self.buckets_behind.settle()
        elif self.behind is not None:
            self.behind.wait()

    @contextmanager
    def full_parameters(self):
        self.settle()
        yield

    def frozen_weights(self, keep: bool) -> dict:
        """Stage 3's frozen parameters' full values (stages 1-2: none; they are the user's whole tensors)."""
        return {}

    def load_frozen(self, values: dict) -> None:
        """Stage 3: frozen parameters' full values into their shards (stages 1-2: the caller copies)."""

    def codec_state(self) -> dict:
        """What a checkpoint keeps of the codecs' own state (stage 3 with qwZ: the gathers' count); none here."""
        return {}

    def load_codec_state(self, state: dict) -> None:
        """Take in ``codec_state()`` from a checkpoint (one without it, or saved without the codec: from 0)."""

    def traffic(self) -> dict[str, int]:
        """Bytes this stage's own communicator moved since the last call (none: it shares the optimizer's; with
        the update behind step(), the worker's all-gathers)."""
        return {} if self.buckets_behind is None else self.buckets_behind.traffic()

    def held_bytes(self) -> dict[str, int]:
        """memory_bytes()'s keys of this stage's own (stage 3 with hpZ: "secondary"); none here."""
        return {}

    def close(self) -> None:
        if self.buckets_behind is not None:
            self.buckets_behind.close()  # the update behind the last step ends (or raises) before the files go


class Stage2(Stage1):
    """Also shard the gradients: reduce-scatter each bucket during backward."""

    number = 2
    traits = STAGE_TRAITS[2]
    reducer = ReduceInBackward


class Stage3(Stage2):
    """Also shard the parameters: gather each unit just in time, release it after use."""

    number = 3
    traits = STAGE_TRAITS[3]
    reducer = ReduceAmongGathers
    can_add_groups = False

    def __init__(self, topology: Topology, config: ZeroConfig) -> None:
        super().__init__(topology, config)
        self.gatherer: ParamGatherer | None = None

    def precheck(self, module: nn.Module | None, units) -> None:
        super().precheck(module, units)
        resolve_units(module, units)  # classes or submodules of the model, no container

    def build(self, groups, names, module, units, begin_backward, previous, first_forward=None):
        """One partition per (unit, param group, dtype); the gatherer owns the full buffers."""
        self.names = names
        self.check_offload()
        plan = plan_units(module, units, self.config.min_unit_numel)
        group_of = {p: gi for gi, g in enumerate(groups) for p in g["params"]}
        in_module = {p for ps in plan.params for p in ps}
        missing = [names[p] for p in names if p not in group_of and p.requires_grad]
        if missing:
            raise ValueError(f"stage 3 shards every parameter of the model, but the trainable {missing[:5]} "
                             f"{'(and more) ' if len(missing) > 5 else ''}are in no param group; add them to a "
                             "group, or freeze them (requires_grad=False) before building the optimizer")
        extra = [tuple(p.shape) for p in group_of if p not in in_module]
        if extra:
            raise ValueError(f"param groups hold {len(extra)} parameters (shapes {extra[:5]}) that are not "
                             "parameters of the model passed as module=: stage 3 shards and gathers parameters with "
                             "the model's modules. Register such a parameter on a module of the model (a learnable "
                             "loss temperature as model.temperature), or train it at stage 1 or 2")
        unit_of = {p: ui for ui, ps in enumerate(plan.params) for p in ps}
        signature = [(group_of.get(p, -1), unit_of[p], name, tuple(p.shape), str(p.dtype), p.requires_grad)
                     for p, name in names.items()]
        self.topology.check_same(signature, "parameters", hint="build the same model and param groups on every rank")
        position = {p: i for i, p in enumerate(p for ps in plan.params for p in ps)}
        unit_parts, positions = [], []
        for ps in plan.params:
            parts = []
            for gi, group in enumerate(groups):
                mine = [p for p in reversed(ps) if group_of.get(p) == gi and p.requires_grad]
                for dtype in dict.fromkeys(p.dtype for p in mine):
                    params = [p for p in mine if p.dtype == dtype]
                    parts.append(self._new_partition(gi, group, params))
                    positions.append([position[p] for p in params])
            # the unit's frozen parameters, in a group or not: weights only, one partition per dtype
            frozen = [p for p in reversed(ps) if not p.requires_grad]
            for dtype in dict.fromkeys(p.dtype for p in frozen):
                params = [p for p in frozen if p.dtype == dtype]
                self.frozen += params
                self.frozen_parts.append(self._new_partition(-1, {}, params, frozen=True))
                parts.append(self.frozen_parts[-1])
            unit_parts.append(parts)
        # The root (unit 0) holds the lowest positions: its buckets reduce last, after the
        # embedding's gradient, which backward produces at the very end.
        # hpZ: backward gathers inside a block of secondary_shard ranks (a group made after the options agreed)
        secondary = None if self.config.secondary_shard is None else SecondaryCopies(self.topology.secondary())
        self.gatherer = ParamGatherer(module, plan.modules, unit_parts, self._param_sync(),
                                      self.config.max_live_units, self.config.reshard_after_forward, begin_backward,
                                      names, first_forward, secondary)
        self.gatherer.alone = self.topology.world_size == 1
        if not self.gatherer.alone:  # transformers' generate() keeps the ranks in step (generation_sync.py)
            self.gatherer.generation_marks = mark_generation_synced(module, self.gatherer)
        device = next((p.device for ps in plan.params for p in ps), torch.device("cpu"))
        if self._overlaps(device):  # the host update overlaps the next forward, unit by unit (behind.py)
            self.behind = self.gatherer.behind = UpdateBehind(device, self._agree_group())
        return [part for parts in unit_parts for part in parts if not part.frozen], positions

    def _param_sync(self) -> ParamSync:
        """The gathers' own group, with qwZ's codec when ``param_comm`` asks for it."""
        comm = self.topology.own_group()
        return ParamSync(comm, codec_for(self.config.param_comm, self.config.quant_block, comm))

    def grad_hook(self):
        return self.gatherer.on_grad  # releases a unit once all of its gradients are in

    def end_backward(self) -> None:
        self.gatherer.end_backward()

    def check_fit(self, partitions) -> None:
        """What a gather put back (``ParamGatherer.refused``); released parameters are placeholders until the step
        takes in what was assigned: checked there."""
        if self.gatherer.refused is not None:
            raise self.gatherer.refused

    def before_update(self, partitions) -> None:
        refused, self.gatherer.refused = self.gatherer.refused, None
        self.gatherer.adopt_assigned()
        if refused is not None:
            raise refused

    def after_update(self, partitions, updated) -> None:
        self.gatherer.release_all()  # the next forward gathers the new values

    def params_from_shards(self, partitions) -> None:
        self.gatherer.release_all()  # the next forward (or full_parameters()) gathers the loaded values
        self.gatherer.regather_held()  # (inside full_parameters(): now)

    def start_behind(self, partitions, plan, updated) -> None:
        self.behind.start(partitions, plan, self.update_order(plan.jobs))

    def update_order(self, jobs: list) -> list:
        """``jobs`` keyed by unit, in the order the next forward gathers the units (the root first)."""
        unit_of = {id(part): u.index for u in self.gatherer.units for part in u.parts}
        by_unit: dict[int, list] = {}
        for job in jobs:
            by_unit.setdefault(unit_of[id(job.part)], []).append(job)
        return [(i, by_unit[i]) for i in [0] + self.gatherer.schedule if i in by_unit]

    @contextmanager
    def full_parameters(self):
        with self.gatherer.full_parameters():
            yield

    def frozen_weights(self, keep: bool) -> dict:
        return gather_frozen(self.frozen_parts, self.gatherer.sync, keep)

    def load_frozen(self, values: dict) -> None:
        load_frozen(self.frozen_parts, values, self.names, self.gatherer._placeholder)
        self.gatherer.regather_held()  # inside full_parameters(): the block holds the loaded weights

    def codec_state(self) -> dict:
        sync = self.gatherer.sync
        return {} if sync.codec is None else {"param_gathers": sync.gathers}

    def load_codec_state(self, state: dict) -> None:
        if self.gatherer.sync.codec is not None:
            self.gatherer.sync.gathers = state.get("param_gathers", 0)

    def traffic(self) -> dict[str, int]:
        comm = self.gatherer.comm
        out = comm.traffic()
        comm.reset_traffic()
        if self.gatherer.secondary is not None:  # hpZ: backward's gathers inside a node, apart
            out.update(self.gatherer.secondary.traffic())
        return out

    def held_bytes(self) -> dict[str, int]:
        secondary = self.gatherer.secondary
        return {} if secondary is None else {"secondary": secondary.nbytes()}

    def close(self) -> None:
        try:
            if self.behind is not None:
                self.behind.close()  # the update behind the last step ends (or raises) before the files go
        finally:
            if self.gatherer is not None:
                self.gatherer.close()
        for part in self.frozen_parts:  # the optimizer closes its own partitions; these are the stage's
            part.close()


STAGES = {1: Stage1, 2: Stage2, 3: Stage3}


def make_stage(topology: Topology, config: ZeroConfig) -> Stage1:
    return STAGES[config.stage](topology, config)
