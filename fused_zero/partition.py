"""Flat buffers of one partition: the full param buffer and this rank's shards.

A partition is the parameters of one param group that share a dtype. Its
parameters become views into one padded flat buffer laid out by
``layout.build_layout``; this rank keeps fp32 master weights, exp_avg,
exp_avg_sq and the reduced gradient only for its shard of every bucket,
concatenated into flat shard buffers.
"""
from __future__ import annotations

import torch

from typing import NamedTuple

from .layout import Bucket, FlatLayout, ShardPiece

#: The sharded optimizer states every partition holds, in this order.
STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")


class PartitionIndex(NamedTuple):
    """What a partition's shard holds, for code outside the optimizer (checkpoints)."""

    group_index: int
    params: tuple  # the partition's parameters, in layout order
    shapes: tuple  # their shapes (stage 3 parameters may be 0-element placeholders)
    pieces: tuple[ShardPiece, ...]  # runs of parameter elements in this rank's shard
    shard_numel: int
    kinds: tuple[str, ...]  # the state kinds this shard holds (STATE_KINDS, + max_exp_avg_sq with amsgrad)


class Partition:
    """The flat buffers of the parameters of one (param group, dtype)."""

    def __init__(
        self,
        group_index: int,
        params: list[torch.nn.Parameter],
        layout: FlatLayout,
        rank: int,
        reduce_dtype: torch.dtype,
    ) -> None:
        self.group_index = group_index
        self.params = params
        # The parameters' shapes, kept: stage 3 points released parameters at empty tensors.
        self.shapes = tuple(p.shape for p in params)
        self.layout = layout
        self.rank = rank
        # The layout is frozen: its per-step lookups are computed once here.
        self.pieces = layout.shard_pieces(rank)
        self.bucket_params = tuple(layout.params_of_bucket(k) for k in range(len(layout.buckets)))
        device = params[0].device
        self.dtype = params[0].dtype
        self.reduce_dtype = reduce_dtype
        self.flat = torch.zeros(layout.numel, dtype=self.dtype, device=device)
        with torch.no_grad():
            for p, slot in zip(params, layout.slots):
                view = self.flat[slot.offset: slot.offset + slot.numel].view(p.shape)
                view.copy_(p)
                p.data = view
        n = layout.shard_numel
        self.master = torch.empty(n, dtype=torch.float32, device=device)
        self.exp_avg = torch.zeros(n, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(n, dtype=torch.float32, device=device)
        self.grad_shard = torch.zeros(n, dtype=reduce_dtype, device=device)
        # Narrow params are written back by the fused kernel into a contiguous
        # shard, then all-gathered; fp32 params are gathered from the master.
        self.param_shard = None if self.dtype == torch.float32 else torch.empty(n, dtype=self.dtype, device=device)
        self.load_master_from_params()

    def load_master_from_params(self) -> None:
        """master (and the narrow param shard) <- this rank's shard of the params.

        Call it whenever the parameters were changed outside the optimizer:
        step() would otherwise overwrite them from the old master.
        """
        for b in self.layout.buckets:
            self.shard(self.master, b).copy_(self.bucket(self.flat, b)[self._own(b)])
        if self.param_shard is not None:
            self.param_shard.copy_(self.master)

    def bucket(self, full: torch.Tensor, b: Bucket) -> torch.Tensor:
        """The view of a full-size flat buffer that bucket ``b`` covers."""
        return full[b.offset: b.offset + b.numel]

    def shard(self, shard_buffer: torch.Tensor, b: Bucket) -> torch.Tensor:
        """The view of a shard buffer that holds this rank's part of ``b``."""
        return shard_buffer[b.shard_offset: b.shard_offset + b.shard_numel]

    def gather_source(self, b: Bucket) -> torch.Tensor:
        """What this rank contributes to bucket ``b``'s all-gather of params."""
        return self.shard(self.master if self.param_shard is None else self.param_shard, b)

    def _own(self, b: Bucket) -> slice:
        return slice(self.rank * b.shard_numel, (self.rank + 1) * b.shard_numel)

    def shard_bytes(self) -> dict[str, int]:
        def nbytes(t):
            return 0 if t is None else t.untyped_storage().nbytes()

        return {
            "params": nbytes(self.flat),
            "grad_shard": nbytes(self.grad_shard),
            "master": nbytes(self.master),
            "exp_avg": nbytes(self.exp_avg),
            "exp_avg_sq": nbytes(self.exp_avg_sq),
            "param_shard": nbytes(self.param_shard),
        }
