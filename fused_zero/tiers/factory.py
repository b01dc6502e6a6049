"""Tiers: the one tier decision. Built once per optimizer from its config, it gives each partition its
optimizer-state store and its narrow param shard together (``PartitionMemory``), and says where the
reduced gradient shard lives. Nothing else compares tiers: a new tier is a store and a param shard
registered here.

The narrow param shard (``param_store.py``): stage 3 (``shards_params``) keeps it in the
``offload_params`` tier; at stages 1-2 offloaded states use the flat buffer's own slices
(``OwnSlices``: the update writes the parameters in place, the all-gather is in place), and narrow
(bf16/fp16) parameters with the states on the device a device tensor; fp32 parameters with their
master on the device need none: at stages 1-2 the master is their own slices (``ParamsAsMaster``), at
stage 3 they are gathered from the master. So are fp32 parameters on a CPU-only run at stages 1-2 with
``offload_optimizer="cpu"`` (``HostParamsAsMaster``): host memory is where they live.
"""
from __future__ import annotations

import os

from collections.abc import Callable
from typing import NamedTuple

import torch

from .param_store import DeviceParamShard, HostParamShard, NvmeParamShard, ParamShard
from .staging import Staging
from .store import DeviceStore, ParamsAsMaster, ShardStore, WeightsOnly
from .store_host import HostParamsAsMaster, HostStore
from .store_nvme import NvmeStore, check_nvme_path
from .tier import Tier


class PartitionMemory(NamedTuple):
    """Where one partition's shards live."""

    store: ShardStore  # fp32 master and Adam moments
    param_shard: ParamShard | None  # the narrow param shard, or None (fp32 gathered from the master)
    grad: Tier  # the reduced gradient shard: where the update runs (beside the states; a frozen one has none)


class Tiers:
    """The tiers of one optimizer's partitions (``offload_optimizer``, and ``offload_params`` at stage 3)."""

    def __init__(self, states: Tier = Tier.DEVICE, params: Tier | None = None, *, staging: Staging | None = None,
                 nvme_path: str | None = None, nvme_direct: bool = False, chunk_numel: int = 1 << 20) -> None:
        """``params``: the narrow param shard's tier when the stage shards parameters, else None."""
        self.states = states
        self.params = params
        self.staging = staging
        self.nvme_path = None if nvme_path is None else os.path.expanduser(os.fspath(nvme_path))  # "~/scratch"
        self.nvme_direct = nvme_direct
        self.chunk_numel = chunk_numel

    @property
    def offloaded(self) -> bool:
        """Some of a partition's memory is off the device (its allocation can fail on one rank alone)."""
        return self.states is not Tier.DEVICE or self.params not in (None, Tier.DEVICE)

    @classmethod
    def from_config(cls, config, staging: Staging, shards_params: bool) -> Tiers:
        return cls(Tier.of(config.offload_optimizer), Tier.of(config.offload_params) if shards_params else None,
                   staging=staging, nvme_path=config.nvme_path, nvme_direct=config.nvme_direct,
                   chunk_numel=config.offload_chunk_numel)

    def check(self, agree: Callable[[Callable[[], None]], object]) -> None:
        """The NVMe folder is usable on every rank (``agree``: every rank raises, before any collective)."""
        if Tier.NVME in (self.states, self.params):
            agree(lambda: check_nvme_path(self.nvme_path, self.nvme_direct))

    def _store(self, numel: int, device: torch.device, amsgrad: bool) -> ShardStore:
        if self.states is Tier.HOST:
            # its master goes up to the parameters' device after each update unless the param shard is on the host
            return HostStore(numel, device, amsgrad, staging=self.staging,
                             pin_master=self.params in (None, Tier.DEVICE))
        if self.states is Tier.NVME:
            return NvmeStore(numel, device, amsgrad, path=self.nvme_path, staging=self.staging,
                             direct=self.nvme_direct)
        return DeviceStore(numel, device, amsgrad)

    def _param_shard(self, numel: int, dtype: torch.dtype, device: torch.device,
                     kernel_device: torch.device) -> ParamShard:
        if self.params is Tier.HOST:
            return HostParamShard(numel, dtype, device, kernel_device, chunk_numel=self.chunk_numel)
        if self.params is Tier.NVME:
            return NvmeParamShard(numel, dtype, device, kernel_device, chunk_numel=self.chunk_numel,
                                  path=self.nvme_path)
        return DeviceParamShard(numel, dtype, device)

    def __call__(self, numel: int, device: torch.device, dtype: torch.dtype, amsgrad: bool,
                 own_slices: Callable[[], ParamShard], frozen: bool = False) -> PartitionMemory:
        """A partition's store and narrow param shard (``numel`` elements each); ``own_slices()`` makes the
        shard that is the partition's own slices of its resident flat buffer. ``frozen``: stage 3's
        weights-only partition (frozen.py): no state, no gradient shard, its weights in the param shard."""
        if frozen:
            return PartitionMemory(WeightsOnly(numel, device), self._param_shard(numel, dtype, device, device),
                                   Tier.DEVICE)
        if self.states is Tier.DEVICE and self.params is None and dtype == torch.float32:
            # stages 1-2, fp32: the master is the parameters' own slices of the flat buffer; no narrow shard
            return PartitionMemory(ParamsAsMaster(numel, device, amsgrad, own_slices()), None, Tier.DEVICE)
        if self.states is Tier.HOST and self.params is None and dtype == torch.float32 and device.type == "cpu" \
                and not HostStore.copy_up:
            # "cpu" on a CPU-only run: the parameters are in host memory already and are the master there too
            return PartitionMemory(HostParamsAsMaster(numel, device, amsgrad, own_slices()), None, Tier.HOST)
        store = self._store(numel, device, amsgrad)
        offloaded = self.states is not Tier.DEVICE  # the master is not on the device: nothing to gather from
        kernel_device = device if not offloaded else torch.device("cpu")  # where the update runs
        shard = None
        if dtype != torch.float32 or offloaded:
            if self.params is not None:
                shard = self._param_shard(numel, dtype, device, kernel_device)
            elif offloaded:
                shard = own_slices()
            else:
                shard = DeviceParamShard(numel, dtype, device)
        return PartitionMemory(store, shard, Tier.DEVICE if not offloaded else Tier.HOST)


#: No offload: the states and param shards beside the parameters.
ON_DEVICE = Tiers()
