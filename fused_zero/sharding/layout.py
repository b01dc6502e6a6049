"""Pure index math: parameters -> flat offsets -> padded buckets -> rank shards.

A flat buffer holds a list of parameters, each starting at a multiple of
``align`` elements. The buffer is cut into buckets of a constant size (the
last one may be shorter); every bucket's size is a multiple of
``align * world_size`` so it splits into ``world_size`` equal, aligned shards.
Rank ``r`` owns shard ``r`` of every bucket; its shard buffer (master weights,
optimizer states, reduced gradient) is the concatenation of those shards, so a
bucket's reduce-scatter lands straight in it and one kernel launch covers it.

Nothing here touches tensors: only integers in, NamedTuples out.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .intervals import intersect


class ParamSlot(NamedTuple):
    """Where parameter ``index`` lives in the flat buffer."""

    index: int
    offset: int
    numel: int


class Bucket(NamedTuple):
    """A constant-size piece of the flat buffer, split into equal shards."""

    index: int
    offset: int  # first flat element
    numel: int  # padded size, a multiple of align * world_size
    shard_offset: int  # where this bucket's shard starts in every rank's shard buffer
    shard_numel: int  # numel // world_size


class ShardPiece(NamedTuple):
    """A run of one parameter's elements inside one rank's shard buffer."""

    param_index: int
    param_offset: int  # first element within the parameter (flattened)
    shard_offset: int  # first element within the shard buffer
    numel: int


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class FlatLayout:
    """The layout of one flat buffer across ``world_size`` ranks."""

    slots: tuple[ParamSlot, ...]
    buckets: tuple[Bucket, ...]
    world_size: int
    align: int

    @property
    def numel(self) -> int:
        """Padded number of elements of the full flat buffer."""
        return sum(b.numel for b in self.buckets)

    @property
    def shard_numel(self) -> int:
        """Number of elements of every rank's shard buffer."""
        return sum(b.shard_numel for b in self.buckets)

    def shard_range(self, bucket: Bucket, rank: int) -> tuple[int, int]:
        """Flat [start, end) of ``rank``'s shard of ``bucket``."""
        start = bucket.offset + rank * bucket.shard_numel
        return start, start + bucket.shard_numel

    def buckets_of_param(self, index: int) -> range:
        """Indices of the buckets that hold part of parameter ``index``."""
        slot = self.slots[index]
        if slot.numel == 0:
            return range(0)
        return range(self._bucket_at(slot.offset), self._bucket_at(slot.offset + slot.numel - 1) + 1)

    def params_of_bucket(self, bucket_index: int) -> tuple[int, ...]:
        """Indices of the parameters with elements in bucket ``bucket_index``."""
        b = self.buckets[bucket_index]
        return tuple(s.index for s in self.slots
                     if intersect(s.offset, s.offset + s.numel, b.offset, b.offset + b.numel))

    def shard_pieces(self, rank: int) -> tuple[ShardPiece, ...]:
        """Every run of parameter elements in ``rank``'s shard, in shard order."""
        pieces = []
        for b in self.buckets:
            lo, hi = self.shard_range(b, rank)
            for s in self.slots:
                common = intersect(lo, hi, s.offset, s.offset + s.numel)
                if common:
                    start, end = common
                    pieces.append(ShardPiece(s.index, start - s.offset, b.shard_offset + start - lo, end - start))
        return tuple(pieces)

    def _bucket_at(self, flat: int) -> int:
        # Buckets all have the first bucket's size except possibly the last.
        k = min(flat // self.buckets[0].numel, len(self.buckets) - 1)
        return k


def build_layout(numels: Sequence[int], world_size: int, bucket_numel: int, align: int = 64) -> FlatLayout:
    """Lay out parameters of the given element counts, in order.

    Each parameter starts at a multiple of ``align``. Buckets hold
    ``bucket_numel`` rounded up to a multiple of ``align * world_size``; the
    last bucket holds the rest, rounded up the same way. A parameter may span
    several buckets. Zero-element parameters get a slot and no elements.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    slots = []
    end = 0
    for i, n in enumerate(numels):
        if n < 0:
            raise ValueError(f"parameter {i} has a negative element count {n}")
        offset = _round_up(end, align)
        slots.append(ParamSlot(i, offset, n))
        end = offset + n if n else end
    unit = align * world_size
    size = _round_up(bucket_numel, unit)
    total = _round_up(end, unit)
    buckets = []
    offset = shard_offset = 0
    while offset < total:
        numel = min(size, total - offset)
        buckets.append(Bucket(len(buckets), offset, numel, shard_offset, numel // world_size))
        offset += numel
        shard_offset += numel // world_size
    return FlatLayout(tuple(slots), tuple(buckets), world_size, align)
