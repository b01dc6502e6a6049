"""ParamSync: all-gather a partition's updated shards back into its full flat buffer.

Stages 1 and 2 gather right after the update (only the buckets that hold an
updated parameter); stage 3 gathers a unit's partitions just before the unit
runs. Each bucket is one all-gather of every rank's shard of it (the narrow
param shard, or the fp32 master for fp32 parameters), launched asynchronously;
the caller waits on the handles. Where a quantized parameter codec plugs in:
the gather source here and the unpacking of the gathered bucket.
"""
from __future__ import annotations

from collections.abc import Iterable

from ..profiling import ALL_GATHER, label
from .collectives import Comm, Handle
from ..sharding.partition import Partition


class ParamSync:
    """Gathers partitions' buckets over one communicator."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def gather(self, part: Partition, buckets: Iterable[int] | None = None) -> list[Handle]:
        """Launch the all-gather of ``buckets`` (all by default) of ``part``; returns the handles."""
        with label(ALL_GATHER):
            return self._launch(part, buckets)

    def _launch(self, part: Partition, buckets: Iterable[int] | None) -> list[Handle]:
        layout = part.layout
        ks = range(len(layout.buckets)) if buckets is None else buckets
        return [self.comm.all_gather(part.bucket(part.flat, layout.buckets[k]), part.gather_source(layout.buckets[k]),
                                     async_op=True) for k in ks]

    def gather_updated(self, parts: list[Partition], updated: list[list[bool]]) -> None:
        """Gather every bucket that holds a parameter updated this step, and wait."""
        with label(ALL_GATHER):
            handles = []
            for part, flags in zip(parts, updated):
                ks = [k for k, members in enumerate(part.bucket_params) if any(flags[j] for j in members)]
                handles += self._launch(part, ks)
            for h in handles:
                h.wait()
