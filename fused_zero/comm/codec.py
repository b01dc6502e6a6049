"""Quantized communication (ZeRO++'s qwZ and qgZ): the codec that stands in for a collective.

A ``Codec`` (``ZeroConfig.param_comm`` / ``grad_comm``: block-wise absmax int8 or int4 with an fp32 scale
per ``quant_block`` elements, ``ops.quantize_`` / ``ops.dequantize_``) replaces three collectives:

- ``all_gather`` (qwZ, stage 3's parameter gathers, ``ParamSync``): each rank quantizes its narrow param
  shard into its slice of a payload, the payloads are all-gathered, and every rank, the shard's owner
  included, decodes all of them into the full flat bucket: every rank computes with the same (dequantized)
  parameters; the fp32 master is never touched, and each gather quantizes the shard afresh (no drift).
  Weights are rounded stochastically, with a new seed for every gather (``ParamSync.seed``): rounded to
  nearest, an update smaller than half a step never reached the weights the forward uses until the master
  had accumulated it, so in warm-up the forward's weights lagged the master (the 33.7M GPT 1.5-8.7% above
  full precision at steps 20-60 on two seeds, +2.1% at step 200); stochastically they equal the master on
  average (within 1% at steps 20-60; bench/results/cpu2core_2026-11-25_codec_early_rounding.txt). A run
  repeats exactly (the seeds count the gathers), and one resumed from a ``fused_zero.checkpoint`` rounds as
  the run that went on (the checkpoint keeps the count: ``ParamSync.gathers``).
- ``reduce_scatter`` (qgZ, ``GradBucket.start``): the packed bucket (pre-divided by every rank) is quantized
  slice by slice, slice r for rank r, and sent with one all-to-all; each rank decodes the N versions of
  its slice and sums them in fp32 in rank order (fixed: deterministic) into its gradient shard. Each
  contribution is quantized once (error at most half a step of its block), with no state kept: error
  feedback would need a residual of the full gradient on every rank, the memory stages 2-3 shard away.
- ``all_reduce`` (qgZ under HSDP: the reduced shard over the R replicas) in two exchanges, as a ring
  all-reduce moves its data (``TwoPhase``): each replica quantizes its shard in R slices and one all-to-all
  sends slice j to replica j, which sums the R decoded versions in fp32 in replica order; then each replica
  quantizes its summed slice and an all-gather (on a second group of the same replicas, so its launches,
  made as the first exchanges land, never interleave with the next buckets' first exchanges) brings every
  summed slice to every replica, which decodes them all, its own included: the replicas stay identical,
  and the bytes are twice a quantized shard whatever R (a single quantized all-gather would grow with R).

Traffic is counted under the exchange it replaces, suffixed by the codec ("all_gather_int8",
"reduce_scatter_int4", "all_reduce_int8"; "replicate_" in front for the replicas' level in
``comm_bytes()``), as the payload bytes the collective moves. Alone (one rank) there is nothing to
compress: ``codec_for`` returns None and the plain collective runs.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .. import ops
from ..config import CODECS
from .collectives import Comm, Handle


def _after(handle: Handle, fn: Callable[[], object]) -> Handle:
    """``handle``, with ``fn`` run after its wait (and after the wait's own ``then``); idempotent if both are."""
    first = handle.then

    def then() -> None:
        if first is not None:
            first()
        fn()

    return Handle(handle.work, then)


class Codec(NamedTuple):
    """Block-wise absmax quantization of ``bits`` per value, one fp32 scale per ``block`` values."""

    name: str
    bits: int
    block: int

    def payload_bytes(self, n: int) -> int:
        return ops.payload_bytes(n, self.bits, self.block)

    def _encode(self, x: torch.Tensor, payload: torch.Tensor, chunks: int = 1, seed: int | None = None) -> None:
        ops.quantize_(x, payload, bits=self.bits, block=self.block, chunks=chunks, seed=seed)

    def _decode(self, payload: torch.Tensor, out: torch.Tensor, chunks: int, sum_chunks: bool) -> None:
        ops.dequantize_(payload, out, bits=self.bits, block=self.block, chunks=chunks, sum_chunks=sum_chunks)

    def all_gather(self, comm: Comm, output: torch.Tensor, input: torch.Tensor, kind: str = "all_gather",
                   seed: int | None = None) -> Handle:
        """``output`` <- every rank's ``input``, quantized (this rank's own included; ``seed``: rounded
        stochastically, see ``ops.quantize_``); async. Counted under ``kind`` plus the codec's name."""
        n, ranks = input.numel(), comm.world_size
        size = self.payload_bytes(n)
        payload = torch.empty(ranks * size, dtype=torch.uint8, device=input.device)
        own = payload[comm.rank * size:(comm.rank + 1) * size]
        self._encode(input.view(-1), own, seed=seed)
        handle = comm.all_gather(payload, own, async_op=True, kind=f"{kind}_{self.name}")
        return _after(handle, lambda: self._decode(payload, output.view(-1), ranks, sum_chunks=False))

    def all_reduce_in_two(self, first: Comm, second: Comm, tensor: torch.Tensor) -> "TwoPhase":
        """``tensor`` <- the sum over the ranks of ``first`` (and ``second``: the same ranks) of their
        ``tensor``, in two quantized exchanges (``TwoPhase``); async."""
        return TwoPhase(self, first, second, tensor)

    def reduce_scatter(self, comm: Comm, output: torch.Tensor, input: torch.Tensor) -> Handle:
        """``output`` <- the sum over ranks of slice ``rank`` of their ``input``, sent quantized; async."""
        n, ranks = output.numel(), comm.world_size
        send = torch.empty(ranks * self.payload_bytes(n), dtype=torch.uint8, device=input.device)
        self._encode(input.view(-1), send, chunks=ranks)
        recv = torch.empty_like(send)
        handle = comm.all_to_all(recv, send, async_op=True, kind=f"reduce_scatter_{self.name}")
        return _after(handle, lambda: self._decode(recv, output.view(-1), ranks, sum_chunks=True))


class TwoPhase:
    """An all-reduce sent quantized in two exchanges: an all-to-all of slices summed where they land, then an
    all-gather of the sums. ``done()`` launches the second exchange once the first has landed (its caller
    polls the oldest first, so every rank launches them in one order); ``wait()`` ends both and decodes."""

    def __init__(self, codec: Codec, first: Comm, second: Comm, tensor: torch.Tensor) -> None:
        ranks, n = first.world_size, tensor.numel()
        self.codec, self.second, self.tensor = codec, second, tensor
        self.slice = -(-n // ranks)  # elements per replica's slice (the last padded with zeros)
        x = tensor.view(-1)
        if self.slice * ranks != n:
            x = torch.zeros(self.slice * ranks, dtype=tensor.dtype, device=tensor.device)
            x[:n].copy_(tensor.view(-1))
        send = torch.empty(ranks * codec.payload_bytes(self.slice), dtype=torch.uint8, device=tensor.device)
        codec._encode(x, send, chunks=ranks)
        self.recv = torch.empty_like(send)
        self.first = first.all_to_all(self.recv, send, async_op=True, kind=f"all_reduce_{codec.name}")
        self.out: torch.Tensor | None = None  # where the second exchange decodes
        self.gathering: Handle | None = None  # the second exchange, once launched

    def _second(self) -> Handle:
        """The all-gather of the summed slices (launched at the first call, once the all-to-all has landed)."""
        if self.gathering is None:
            self.first.wait()
            mine = torch.empty(self.slice, dtype=torch.float32, device=self.tensor.device)
            ranks = self.second.world_size
            self.codec._decode(self.recv, mine, ranks, sum_chunks=True)  # the replicas' slices, in replica order
            # every summed slice, this one's too, decoded into the tensor (or a padded copy of it) at the wait
            self.out = self.tensor.view(-1) if self.slice * ranks == self.tensor.numel() else \
                torch.empty(self.slice * ranks, dtype=self.tensor.dtype, device=self.tensor.device)
            self.gathering = self.codec.all_gather(self.second, self.out, mine, kind="all_reduce")
        return self.gathering

    def done(self) -> bool:
        """True when ``wait()`` would not block (launching the second exchange once the first has landed)."""
        if self.gathering is None and not self.first.done():
            return False
        return self._second().done()

    def wait(self) -> None:
        self._second().wait()
        if self.out.data_ptr() != self.tensor.data_ptr():
            self.tensor.view(-1).copy_(self.out[:self.tensor.numel()])


def codec_for(name: str | None, block: int, comm: Comm | None) -> Codec | None:
    """The codec ``name`` ("int8", "int4"; None: full precision) over ``comm``, or None where nothing is sent."""
    if name is None or comm is None or comm.world_size == 1:
        return None
    return Codec(name, CODECS[name], block)
