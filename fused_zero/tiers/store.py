"""Where a partition's optimizer state lives: the ShardStore interface.

A store owns this rank's shard of the fp32 master weights and the Adam moments
(exp_avg, exp_avg_sq, and max_exp_avg_sq for amsgrad groups) of one partition.
The optimizer never touches those tensors directly: the update asks the store
for chunks (``update_chunks``), checkpoints read and write ranges, and the
parameter all-gather asks for a gather source. ``DeviceStore`` keeps everything
in the parameters' memory and hands out views; a host or NVMe tier is one more
class with the same verbs that stages each chunk in and out.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import NamedTuple

import torch

from .tier import Tier

#: The sharded optimizer states, in the order checkpoints and kernels take them.
STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
AMSGRAD_KIND = "max_exp_avg_sq"


class StateChunk(NamedTuple):
    """Elements [start, end) of a shard's states, as tensors the update kernel may write.

    ``grad`` and ``param_out`` are the gradient shard and the narrow param shard over the same
    range, where the states live (the store stages ``param_out`` when the parameters live elsewhere).
    """

    start: int
    end: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_exp_avg_sq: torch.Tensor | None
    grad: torch.Tensor
    param_out: torch.Tensor | None


class ShardStore(ABC):
    """This rank's optimizer states of one partition (``numel`` fp32 elements per kind)."""

    tier = Tier.DEVICE
    #: whether ``rollback`` undoes the updates of a step that failed midway. A store in memory is updated in
    #: place and cannot: nothing in its own update fails, and a failed write of an NVMe param shard beside it
    #: leaves its step done (``Partition.param_shard_lost``)
    undoes_failed_steps = False

    def __init__(self, numel: int, amsgrad: bool) -> None:
        self.numel = numel
        self.kinds = STATE_KINDS + ((AMSGRAD_KIND,) if amsgrad else ())

    def _check(self, kind: str, start: int, end: int) -> None:
        if kind not in self.kinds:
            raise ValueError(f"this shard holds {self.kinds}, not {kind!r}")
        if not 0 <= start <= end <= self.numel:
            raise ValueError(f"range [{start}, {end}) is outside the shard's {self.numel} elements")

    @abstractmethod
    def read(self, kind: str, start: int, end: int) -> torch.Tensor:
        """A CPU copy of elements [start, end) of ``kind``."""

    @abstractmethod
    def write(self, kind: str, start: int, values: torch.Tensor) -> None:
        """Elements [start, start + len(values)) of ``kind`` <- ``values``."""

    @abstractmethod
    def update_chunks(self, ranges: list[tuple[int, int]], grad: torch.Tensor,
                      param_out: torch.Tensor | None) -> Iterator[StateChunk]:
        """The states over each range in turn, with ``grad`` and ``param_out`` over the same range.

        ``grad`` lives where the states do (``Partition.grad_tier``: the host for an offloaded store).

        What the caller writes into a chunk is kept once the generator resumes (into
        ``param_out`` as well); a store that stages may make it final only at ``commit()``.
        """

    def commit(self) -> None:
        """The step's updates all succeeded: make them the states."""

    def rollback(self) -> None:
        """A step failed midway: the states stay as they were before it (where ``undoes_failed_steps``)."""

    @abstractmethod
    def gather_source(self, start: int, end: int) -> torch.Tensor | None:
        """Elements [start, end) of the fp32 master on the parameters' device (fp32 parameters are gathered from
        it), or None."""

    def edges(self) -> list[int]:
        """Shard offsets an update chunk must not cross (none: the states are whole tensors)."""
        return []

    @abstractmethod
    def nbytes(self) -> dict[str, int]:
        """Bytes held per kind (where they live is the store's ``tier``)."""

    def close(self) -> None:
        """Give back what the store holds outside the process's tensors (files)."""


class DeviceStore(ShardStore):
    """The states as tensors on the parameters' device: chunks are views, nothing to stage."""

    def __init__(self, numel: int, device: torch.device, amsgrad: bool = False) -> None:
        super().__init__(numel, amsgrad)
        self.tensors = {kind: torch.zeros(numel, dtype=torch.float32, device=device) for kind in self.kinds}

    def read(self, kind: str, start: int, end: int) -> torch.Tensor:
        self._check(kind, start, end)
        return self.tensors[kind][start:end].detach().to("cpu", copy=True)

    def write(self, kind: str, start: int, values: torch.Tensor) -> None:
        self._check(kind, start, start + values.numel())
        self.tensors[kind][start:start + values.numel()].copy_(values.reshape(-1))

    def update_chunks(self, ranges, grad, param_out):
        yield from _chunks_of(self.tensors, ranges, grad, param_out)

    def gather_source(self, start: int, end: int) -> torch.Tensor:
        return self.tensors["master"][start:end]

    def nbytes(self) -> dict[str, int]:
        return {kind: t.numel() * t.element_size() for kind, t in self.tensors.items()}


class ParamsAsMaster(DeviceStore):
    """fp32 parameters at stages 1-2, states on the device: the master *is* this rank's slices of the resident
    flat buffer (``OwnSlices``), as Megatron's distributed optimizer and FSDP2 update an fp32 parameter shard
    in place rather than a copy of it.

    The update writes the parameters in place and the all-gather is in place (at world size 1 there is
    nothing to copy). That saves 4 bytes per shard element and, per step, the gather's read of a separate
    master; the values are the same bits (an fp32 master rounds to an fp32 parameter unchanged). An update
    chunk never crosses a bucket edge (``edges``): the own slices are contiguous only within a bucket.
    """

    def __init__(self, numel: int, device: torch.device, amsgrad: bool, own) -> None:
        """``own``: the partition's ``OwnSlices`` (tiers/param_store.py) over its flat buffer."""
        ShardStore.__init__(self, numel, amsgrad)
        self.own = own
        self.tensors = {kind: torch.zeros(numel, dtype=torch.float32, device=device)
                        for kind in self.kinds if kind != "master"}

    def read(self, kind: str, start: int, end: int) -> torch.Tensor:
        if kind != "master":
            return super().read(kind, start, end)
        self._check(kind, start, end)
        return self.own.read(start, end).detach().to("cpu", copy=True)

    def write(self, kind: str, start: int, values: torch.Tensor) -> None:
        if kind != "master":
            return super().write(kind, start, values)
        self._check(kind, start, start + values.numel())
        self.own.write(start, values)  # the parameters' own elements (a copy onto itself is skipped by copy_)

    def update_chunks(self, ranges, grad, param_out):
        t, amsgrad = self.tensors, self.tensors.get(AMSGRAD_KIND)
        for start, end in ranges:  # Partition.update_ranges cut them at the bucket edges
            yield StateChunk(start, end, self.own[start:end], t["exp_avg"][start:end], t["exp_avg_sq"][start:end],
                             None if amsgrad is None else amsgrad[start:end], grad[start:end], None)

    def gather_source(self, start: int, end: int) -> torch.Tensor:
        return self.own.source(start, end)  # the all-gather's own slice of its output: in place

    def edges(self) -> list[int]:
        return self.own.edges()

    def nbytes(self) -> dict[str, int]:
        return {"master": 0, **super().nbytes()}  # the master is counted under params


def _chunks_of(tensors: dict, ranges, grad: torch.Tensor, param_out: torch.Tensor | None,
               offset: int = 0) -> Iterator[StateChunk]:
    """Views of ``tensors`` (which start at shard element ``offset``), ``grad`` and ``param_out``."""
    for start, end in ranges:
        a, b = start - offset, end - offset
        yield StateChunk(start, end, *(tensors[k][a:b] for k in STATE_KINDS),
                         tensors[AMSGRAD_KIND][a:b] if AMSGRAD_KIND in tensors else None,
                         grad[a:b], None if param_out is None else param_out[a:b])


class WeightsOnly(ShardStore):
    """The store of a frozen partition (frozen.py, stage 3): no state at all; its weights live in the param
    shard."""

    def __init__(self, numel: int, device: torch.device, amsgrad: bool = False) -> None:
        super().__init__(numel, amsgrad)
        self.kinds = ()

    def read(self, kind, start, end):
        raise ValueError(f"a frozen partition holds no optimizer state, not {kind!r}")

    def write(self, kind, start, values) -> None:
        """The weights are the param shard's (``Partition`` writes it beside): nothing kept here."""

    def update_chunks(self, ranges, grad, param_out):
        raise RuntimeError("a frozen partition is never updated")

    def gather_source(self, start: int, end: int) -> None:
        return None  # gathered from the param shard

    def nbytes(self) -> dict[str, int]:
        return {}
