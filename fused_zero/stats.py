"""StepStats: the one all-reduce of scalars every step() makes.

Which parameters got a gradient on any rank (torch semantics: a parameter
whose gradient is None everywhere is not updated), the squared global gradient
norm and a non-finite flag when clipping or a GradScaler needs them, and a
checksum of what every rank must agree on (hyperparameters, options, whether
this step clips), folded into the same collective so that checking costs no
extra round trip.

Nothing here is read on the host in a step where this rank saw a gradient for
every parameter (the usual case): then every rank's flags are all set, the norm
and the non-finite flag stay device tensors, and the checksum's verdict is a
device flag (``disagree``) that the update acts on (it skips) and the host
learns one step later (deferred.py). Only a rank among several that saw some
parameter without a gradient reads the flags (one read), as it cannot know
otherwise whether another rank saw one; alone, its own flags are the answer.
"""
from __future__ import annotations

import zlib
from typing import NamedTuple

import torch

from . import ops
from .comm.collectives import Comm
from .config import STATS_HEAD as HEAD
from .host_read import to_host
from .sharding.partition import Partition

# A checksum travels as two small integers and their squares, with as many bits as keep their
# sums over the ranks exact in fp32 (N * (2**b)**2 <= 2**24), and N * sum(c**2) == sum(c)**2
# holds on every rank exactly when every rank sent the same c (Cauchy-Schwarz), so every rank
# reaches the same verdict.
# HEAD (config.STATS_HEAD): the scalars before the per-parameter has-grad flags.


class StepStats(NamedTuple):
    """What step() learns from the stats all-reduce."""

    sq_norm: torch.Tensor  # squared L2 norm of the averaged gradient (0 if not asked for)
    nonfinite: torch.Tensor  # > 0 if any rank's gradient shard holds inf or nan
    has_grad: tuple[tuple[bool, ...], ...]  # per partition, per parameter: got a gradient on some rank
    disagree: torch.Tensor | None  # 0-d fp32 on the device: 1 if the ranks' checksums differ (None alone)

    def total_norm(self, inv_scale: torch.Tensor | None) -> torch.Tensor:
        total = self.sq_norm.sqrt()
        return total if inv_scale is None else total * inv_scale


def checksum(value, world_size: int) -> tuple[int, int]:
    """Two small integers that summarise ``repr(value)``, small enough to sum exactly over the ranks."""
    bits = max(1, (24 - (world_size - 1).bit_length()) // 2)
    h = zlib.crc32(repr(value).encode())
    mask = (1 << bits) - 1
    return h & mask, (h >> 16) & mask


def stats_vector(partitions: list[Partition], flags: list[bool], check: tuple[int, int]) -> torch.Tensor:
    """The all-reduce's input on the device: the norm's two slots, the checksum, the has-grad flags (``flags``:
    per partition, per parameter). Built on the host and sent in one copy that does not wait (page-locked on
    CUDA)."""
    device = partitions[0].flat.device if partitions else torch.device("cpu")
    c1, c2 = check
    host = torch.tensor([0.0, 0.0, c1, c1 * c1, c2, c2 * c2, *flags], dtype=torch.float32,
                        pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def reduce_stats(comm: Comm, partitions: list[Partition], stats: torch.Tensor, flags: tuple[bool, ...],
                 with_norm: bool, replicate: Comm | None = None) -> StepStats:
    """The all-reduce of ``stats_vector``'s ``stats`` (in place), and what step() learns from it. Device work only,
    except where this rank, among several, saw some parameter without a gradient (``flags``, this rank's has-grad
    flags as ``stats_vector`` took them): it reads whether another rank saw one.
    ``replicate`` (HSDP): the replicas of this rank's shard. The norm sums the shards inside ``comm``; the flags,
    the non-finite count and the checksum span the replicas too (a second all-reduce, without the norm)."""
    device = stats.device
    if with_norm and partitions:
        norm = ops.norm_stats_many([part.grad_shard for part in partitions])
        stats[0], stats[1] = norm.sq_sum.to(device), norm.nonfinite.to(device)  # offloaded: the shards are on the host
    comm.all_reduce(stats)
    n = comm.world_size
    if replicate is not None:
        replicate.all_reduce(stats[1:])
        n *= replicate.world_size
    disagree = None
    if n > 1:  # exact in float64: the sums are exact in fp32 by construction, their squares are not
        c = stats[2:HEAD].double()
        disagree = ((c[1] * n != c[0] * c[0]) | (c[3] * n != c[2] * c[2])).float()
    if all(flags):  # this rank saw every gradient, so every rank's sum is positive: nothing to read
        has_grad = tuple((True,) * len(part.params) for part in partitions)
    elif n == 1:  # alone: its own flags are the answer
        has_grad = per_partition(flags, partitions)
    else:
        has_grad = per_partition([v > 0 for v in to_host(stats[HEAD:], "has-grad flags")], partitions)
    return StepStats(stats[0], stats[1], has_grad, disagree)


def per_partition(flags, partitions: list[Partition]) -> tuple[tuple[bool, ...], ...]:
    """Flat per-parameter flags (partition after partition, the stats vector's order) cut per partition."""
    it = iter(flags)
    return tuple(tuple(next(it) for _ in part.params) for part in partitions)
