"""hpZ (ZeRO++'s hierarchical partitioning): stage 3's node-local copy of each unit for its backward.

The shard group (N ranks) is cut into blocks of ``s`` consecutive ranks (``Topology.secondary``: ranks
[0..s-1], [s..2s-1], ... stand for nodes). A forward gathers each unit from the primary shards over all
N ranks, as without hpZ. When a training forward releases a unit, each rank first keeps its slice of
the gathered unit within its block: for every bucket of every partition of the unit (a bucket's size is a
multiple of ALIGN x N, so of s), elements [j*B/s, (j+1)*B/s) of the bucket for the rank's place j in its
block; the copy of a partition is those slices in bucket order, ``F/s`` elements for a flat buffer of ``F``.
The unit's backward gathers each bucket from the copies of the block's s ranks only: an all-gather inside
a node, never across nodes (its bytes are counted apart, ``comm_bytes()``'s "secondary_all_gather").

A copy lives from its unit's release after the forward until the unit's backward gather lands, then it is
dropped (DeepSpeed keeps its secondary tensors until the step; dropping them as soon as they served keeps
the extra memory to the copies of the units backward has not reached: at most 1/s of the released units,
at the end of the forward). Anything that may change the parameters drops every copy first (the step, an
escaped forward, the end of a backward); only backward gathers from a copy, so an eval forward between a
training forward and its backward gathers from the primary shards as usual. Copies live beside the
gathered parameters (on the device), also with ``offload_params``: they exist to keep backward off the
network between nodes, which a copy on the host would trade for a transfer per unit.
"""
from __future__ import annotations

import torch

from .collectives import Comm, Handle
from ..sharding.partition import Partition


class SecondaryCopies:
    """Each released unit's node-local copy (one flat tensor per partition), gathered over ``comm`` (a block)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._held: dict[int, list[torch.Tensor]] = {}  # unit index -> the copy of each of its partitions

    def _slices(self, part: Partition):
        """(bucket view of the flat buffer, where this rank's slice of it starts in the copy, its size) per bucket."""
        s, j = self.comm.world_size, self.comm.rank
        for b in part.layout.buckets:
            n = b.numel // s
            yield part.bucket(part.flat, b), b.offset // s, n, j * n

    @torch.no_grad()
    def keep(self, index: int, parts: list[Partition]) -> None:
        """Unit ``index`` is about to be released after a training forward: keep this rank's slices of it."""
        copies = self._held.get(index)
        if copies is None:
            copies = [torch.empty(part.flat.numel() // self.comm.world_size, dtype=part.flat.dtype,
                                  device=part.flat.device) for part in parts]
        for part, copy in zip(parts, copies):
            for full, at, n, mine in self._slices(part):
                copy[at:at + n].copy_(full[mine:mine + n])
        self._held[index] = copies

    def copies(self, index: int) -> list[torch.Tensor] | None:
        """The copy of unit ``index``'s partitions, or None when none is held."""
        return self._held.get(index)

    def gather(self, part: Partition, copy: torch.Tensor) -> list[Handle]:
        """Launch the all-gather of every bucket of ``part`` from the block's copies (inside the block)."""
        return [self.comm.all_gather(full, copy[at:at + n], async_op=True) for full, at, n, _ in self._slices(part)]

    def drop(self, index: int) -> None:
        self._held.pop(index, None)

    def drop_all(self) -> None:
        self._held.clear()

    def nbytes(self) -> int:
        """Device bytes the copies hold now (memory_bytes()'s "secondary")."""
        return sum(t.untyped_storage().nbytes() for copies in self._held.values() for t in copies)

    def traffic(self) -> dict[str, int]:
        """The backward gathers' bytes since the last call, under "secondary_all_gather" (then reset)."""
        n = self.comm.traffic()["all_gather"]
        self.comm.reset_traffic()
        return {"secondary_all_gather": n}
