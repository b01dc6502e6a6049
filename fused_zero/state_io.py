"""The optimizer's state, read and written: ShardedOptimizer's half that serves what is outside a step.

``state_dict()`` / ``load_state_dict()`` (torch.optim.AdamW's format, through ``checkpoint/optim_state.py``),
the shard interface checkpoints use (``shard_index``, ``read_shard``, ``load_shards``), and the memory and
traffic accounting (``memory_bytes``, ``comm_bytes``). A mixin of ShardedOptimizer (optimizer.py): it reads
the partitions, GradSync and the stage the optimizer builds.
"""
from __future__ import annotations

import torch

from .accounting import memory_bytes
from .checkpoint.optim_state import gather_state_dict, load_state_dict as load_optim_state
from .comm.collectives import Comm
from .hooks import eager_under_compile
from .sharding.partition import PartitionIndex, unalias
from .state_views import attach_all, take_in_edited_moments
from .tiers.tier import Tier
from .update import step_counts_of


class StateAccess:
    """ShardedOptimizer's state_dict, checkpoint shards and accounting."""

    # -- accounting and state ---------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the model state, by kind; offloaded states and stage-3 parameter shards
        under their tier, "host" or "nvme" (on disk)."""
        return memory_bytes(self)

    def comm_bytes(self) -> dict[str, int]:
        """Bytes per collective in the last step, counted as the ZeRO paper does (a reduce-scatter its input, an
        all-gather its output, an all-reduce twice its tensor); a codec's under the exchange it replaces plus its
        name ("reduce_scatter_int8"), HSDP's across the replicas with "replicate_" in front."""
        return dict(self._last_traffic)

    @eager_under_compile
    def state_dict(self) -> dict:
        """torch.optim.AdamW's state_dict of the whole optimizer. COLLECTIVE: every rank calls it.

        As FSDP's optim_state_dict, it all-gathers the full fp32 state into every rank's CPU
        memory (8 bytes per trained element, 12 for bf16/fp16 parameters, whose fp32 master
        goes under the extra state key "master"), in bounded chunks; identical on every rank.
        ``torch.optim.AdamW(same groups).load_state_dict()`` takes it, and vice versa.
        """
        self._settle_update()  # stage 3 with offloaded states: the update behind the last step ends first
        self.check_states_kept()
        self._take_in_loaded_weights()
        self.take_in_state_edits()
        self.check_agreement()  # a step whose ranks disagreed raises here, on every rank, before any gather
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():  # torch.optim's hooks, as torch runs them
            pre_hook(self)
        with self.collective_call("state_dict()"):
            sd = gather_state_dict(self, self._control_comm())
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            sd = sd if result is None else result
        return sd

    def _control_comm(self) -> Comm:
        """The process group state_dict() gathers on: its own, so a peer can serve it while it waits in a step."""
        if self._control is None:
            self._control = self.topology.own_group()
        return self._control

    def _serve_state_dict(self) -> None:
        """A peer called state_dict() alone while this rank waits in a collective: take part in its gather.

        Runs inside that wait (comm/rendezvous.py): this rank's states are the last step's, which every
        rank finished; the reductions it waits for touch none of them.
        """
        self._settle_update()
        self._take_in_loaded_weights()
        with self.collective_call("state_dict()"):
            gather_state_dict(self, self._control_comm(), keep=False)

    @torch.no_grad()
    @eager_under_compile
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state_dict() (or a torch.optim.AdamW one) at any world size and stage; every rank calls it.

        Hyperparameters and step counts come from the dict; the parameters keep their values
        (load the model's own state dict for them), the fp32 masters come from them, or from a
        saved "master" where it rounds to them. A bad dict raises on every rank.
        """
        self._check_open()
        self._settle_update()
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()  # as torch.optim: a hook that edits the dict leaves the caller's alone
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            state_dict = state_dict if result is None else result
        with self.collective_call("load_state_dict()"):
            load_optim_state(self, state_dict)
        self._order_state()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # -- the shards, for checkpoints ---------------------------------------
    def shard_index(self) -> tuple[PartitionIndex, ...]:
        """This rank's shards: one entry per partition, in partition order."""
        return tuple(part.index() for part in self.partitions)

    def frozen_index(self) -> tuple[PartitionIndex, ...]:
        """Stage 3's weights-only partitions (frozen parameters, frozen.py); empty at stages 1-2."""
        return tuple(part.index() for part in self._stage.frozen_parts)

    def frozen_weights(self) -> dict:
        """Stage 3: {frozen parameter: full CPU copy} on rank 0 ({} elsewhere, and at stages 1-2); collective."""
        return self._stage.frozen_weights(keep=self.comm.rank == 0)

    def codec_state(self) -> dict:
        """What a checkpoint keeps of the codecs' own state, the same on every rank (qwZ: the gathers' count,
        which every stochastic rounding seed starts from); {} without a codec."""
        return self._stage.codec_state()

    def load_codec_state(self, state: dict) -> None:
        """Take in a checkpoint's ``codec_state()`` (a resumed qwZ run rounds as the uninterrupted one)."""
        self._stage.load_codec_state(state)

    def load_frozen_weights(self, values: dict) -> None:
        """Stage 3: each rank's shard of ``values`` ({frozen parameter: full tensor}) into its param shards."""
        self._stage.load_frozen(values)

    def read_shard(self, partition: int, kind: str, start: int, end: int, settle: bool = True) -> torch.Tensor:
        """A CPU copy of elements [start, end) of partition ``partition``'s ``kind`` shard.

        ``settle=False`` reads without waiting for the reductions in flight (which write gradients only).
        """
        self._settle_update()
        self.check_states_kept()
        self._take_in_loaded_weights()
        if settle:
            self.grad_sync.wait()
        return self.partitions[partition].store.read(kind, start, end)

    def take_in_state_edits(self) -> None:
        """Moments user code put in ``optimizer.state[p]`` since the last step (``state[p]["exp_avg"] = t``, a whole
        state put in) go into the shards now, as that step would take them in, so that a ``state_dict()`` or
        checkpoint saved before it holds them (both read the shards; the step counts they read from ``state``). An
        edit the step would refuse is left to it. Local, no collective."""
        for part in self.partitions:
            take_in_edited_moments(self.state, part)

    def _take_in_loaded_weights(self) -> None:
        """Stages 1-2, between ``load_state_dict`` and the model's weights loaded after it and the next step: the
        saved masters kept for those weights (``Partition.pending_master``) are taken in now, as the step would,
        so that a state dict or checkpoint saved in between holds them (it held the masters of the weights from
        before the load). A change the step would refuse is left to it (refused again there)."""
        stage = self._stage
        if stage.shards_params or not any(part.pending_master for part in self.partitions):
            return
        for part, changed in zip(self.partitions, unalias(self.partitions)):
            if part.pending_master and changed:
                try:
                    part.adopt_outside_changes(stage.names, changed)
                except RuntimeError:
                    pass

    def check_states_kept(self) -> None:
        """After ``close()`` the states stay readable where they live in memory; NVMe files are gone with it."""
        if self.closed and self.state_tier is Tier.NVME:
            raise RuntimeError('this ShardedOptimizer was closed, and close() removed the NVMe files its states '
                               '(offload_optimizer="nvme") lived in: save optimizer.state_dict() or a '
                               'fused_zero.checkpoint before close(), and load into an open optimizer')

    @torch.no_grad()
    def load_shards(self, staged, pending=None) -> None:
        """Write whole shards, then make the parameters what the masters say (every rank joins).

        ``staged`` holds one mapping per partition (shard_index() order) from a state
        kind to a tensor of the shard's size, or None to keep that kind as it is.
        ``pending`` maps a partition's index to the fp32 masters (per parameter) kept aside for
        the narrow weights a model load brings after this one (torch.distributed.checkpoint loads
        the optimizer's state first): a weight that the kept master rounds to keeps it.
        """
        if len(staged) != len(self.partitions):
            raise ValueError(f"load_shards got {len(staged)} partitions; this optimizer has {len(self.partitions)}")
        self._settle_update()
        self.grad_sync.wait()

        def write() -> None:
            for part, new in zip(self.partitions, staged):
                for kind, t in new.items():
                    if t is not None:
                        part.store.write(kind, 0, t)
                if part.grad_shard is not None:  # (a trained partition) a state taken away before the next step
                    step_counts_of(part).loaded()  # restarts from zeros, not from what the load wrote
            for part in self.partitions:
                part.param_shard_from_master()
        # the writes can fail on one rank (an NVMe file: I/O error): every rank learns it and raises ("rank r
        # failed: ...", the states partly loaded: load again) before the parameters' collectives below, where
        # the others would wait for it
        if self.config.on_disk and self.topology.world_size > 1:
            self.topology.agree(write)
        else:
            write()
        attach_all(self.state, self.partitions)
        for part in self.partitions:
            if part.grad_shard is not None:  # the loaded counts: the views later steps advance, from now on
                step_counts_of(part).take_in_loaded(self.state, part)
        self._stage.params_from_shards(self.partitions)
        for k, part in enumerate(self.partitions):
            part.pending_master = (pending or {}).get(k)
        self.comm.reset_traffic()
