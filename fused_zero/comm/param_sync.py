"""ParamSync: all-gather a partition's updated shards back into its full flat buffer.

Stages 1 and 2 gather right after the update (only the buckets that hold an
updated parameter); stage 3 gathers a unit's partitions just before the unit
runs. Each bucket is one all-gather of every rank's shard of it (the narrow
param shard; for fp32 parameters the fp32 master, which at stages 1-2 is the
bucket's own slice: the gather is in place), launched asynchronously;
the caller waits on the handles. With a codec (``param_comm="int8"``, stage 3:
comm/codec.py) each bucket's shards travel quantized and are decoded into the bucket
when the handle is waited; ``exact()`` turns it off for gathers that must be exact
(``full_parameters()``, frozen weights for a checkpoint).
"""
from __future__ import annotations

from collections.abc import Iterable

from ..lifecycle import setting
from ..profiling import ALL_GATHER, label
from .codec import Codec
from .collectives import Comm, Handle
from ..sharding.partition import Partition


class ParamSync:
    """Gathers partitions' buckets over one communicator."""

    def __init__(self, comm: Comm, codec: Codec | None = None) -> None:
        self.comm = comm
        self.codec = codec  # qwZ (comm/codec.py), or None: the shards as they are
        self._exact = False
        self._gathers = 0  # qwZ: gathers launched so far, part of every gather's rounding seed

    def exact(self):
        """Gathers inside send the shards as they are, whatever the codec (a context manager)."""
        return setting(self, "_exact", True)

    @property
    def gathers(self) -> int:
        """qwZ: quantized gathers launched so far (a checkpoint keeps it: a resumed run draws the same seeds)."""
        return self._gathers

    @gathers.setter
    def gathers(self, n: int) -> None:
        self._gathers = int(n)

    def seed(self, k: int) -> int:
        """qwZ's stochastic rounding seed of a partition's bucket ``k``: a new one for every gather (a backward's
        gather rounds independently of its forward's), from the gathers so far, the bucket and the rank (the
        same on every run: ints hash alike in every process)."""
        self._gathers += 1
        return hash((self._gathers, k, self.comm.rank)) & 0x7FFFFFFF

    def lossy(self, part: Partition) -> bool:
        """Whether a gather of ``part`` now sends quantized values (qwZ; a frozen float64 or integer weight
        travels as it is)."""
        return self.codec is not None and not self._exact and part.flat.is_floating_point() \
            and part.flat.dtype.itemsize <= 4

    def gather(self, part: Partition, buckets: Iterable[int] | None = None) -> list[Handle]:
        """Launch the all-gather of ``buckets`` (all by default) of ``part``; returns the handles."""
        with label(ALL_GATHER):
            return self._launch(part, buckets)

    def _launch(self, part: Partition, buckets: Iterable[int] | None) -> list[Handle]:
        layout = part.layout
        ks = range(len(layout.buckets)) if buckets is None else buckets
        part.lossy_gather = self.lossy(part)
        if part.lossy_gather:
            return [self.codec.all_gather(self.comm, part.bucket(part.flat, layout.buckets[k]),
                                          part.gather_source(layout.buckets[k]), seed=self.seed(k)) for k in ks]
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
