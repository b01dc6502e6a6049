"""Gradient buckets and the pipe they reduce through: what both reducers (``grad_sync.py``) share.

A ``GradBucket`` is one bucket of one partition: the runs of parameters (and padding) it covers,
the parameters whose ``.grad`` it frees once packed, and its pack plan. Its two verbs pair up as
Megatron's bucket groups' do: ``start()`` packs the gradients into a pool buffer (cast to the
reduce dtype and pre-divided by N: the codec point) and launches the reduce-scatter (``grad_comm``:
a quantized all-to-all, comm/codec.py); ``finish()``
lands the result in the partition's gradient shard (added to it when the round accumulates).

The ``BucketPipe`` owns what the buckets share: the pool buffers (at most ``MAX_INFLIGHT`` per
reduce dtype), the reductions in flight (finished oldest first: every rank launched them in the same
order) and, with the states offloaded (``Partition.grad_tier`` is ``Tier.HOST``), the copies down to
the host shard: each bucket is reduced in place (this rank's slice of the pool buffer) and copied
down once its reduction completes (``tiers/transfer.py``: on a GPU on a side stream). A round that
accumulates is added on the device, on that stream (``Transfers.add_down``): the host shard's slice goes up
into a device scratch per pool buffer, takes the new round and comes back down, so the host thread never
adds (on a 1B model each accumulating round was a pass over the whole bf16 shard on the host, on the
thread that launches backward's kernels). Where the pool buffers are
host memory too (a CPU-only run) the reduction lands in the host shard directly, and one rank packs
straight into it, as without offload (``BucketPipe.copy_down`` makes the tests take the GPU's way there).
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch

from .. import ops
from ..config import MAX_INFLIGHT
from ..profiling import PACK, REDUCE_SCATTER, label
from ..sharding.intervals import intersect
from ..sharding.partition import Partition
from ..tiers.tier import Tier
from ..tiers.transfer import Ticket, transfers
from .codec import codec_for
from .collectives import Comm, Handle


class _Segment(NamedTuple):
    """A run of one bucket: part of a parameter, or padding (param None)."""

    param: torch.nn.Parameter | None
    start: int  # first element within the flattened parameter
    bucket_offset: int
    numel: int
    index: int = -1  # the parameter's position in its partition
    whole: bool = False  # the run is the whole parameter (packed without slicing)


class _Inflight(NamedTuple):
    bucket: GradBucket
    handle: Handle
    buffer: torch.Tensor  # the pool buffer, busy until the handle is waited
    out: torch.Tensor  # where the reduce-scatter lands (host tier: this rank's slice of buffer)
    accumulate_into: torch.Tensor | None  # on the device: the shard ``out`` is added to
    down: torch.Tensor | None  # host tier: where ``out`` is copied (the host shard's slice)
    scratch: torch.Tensor | None = None  # host tier, accumulating: where ``down`` goes up to be added to


class _Landing(NamedTuple):
    """A reduced shard on its way down to the host (host tier)."""

    ticket: Ticket
    buffer: torch.Tensor  # the pool buffer it came from (busy until the ticket is done)


def _segments(part: Partition, k: int) -> tuple[_Segment, ...]:
    b = part.layout.buckets[k]
    segs, pos = [], b.offset
    for j in part.bucket_params[k]:
        slot = part.layout.slots[j]
        start, end = intersect(slot.offset, slot.offset + slot.numel, b.offset, b.offset + b.numel)
        if start > pos:
            segs.append(_Segment(None, 0, pos - b.offset, start - pos))
        segs.append(_Segment(part.params[j], start - slot.offset, start - b.offset, end - start, j,
                             end - start == slot.numel))
        pos = end
    if pos < b.offset + b.numel:
        segs.append(_Segment(None, 0, pos - b.offset, b.offset + b.numel - pos))
    return tuple(segs)


class GradBucket:
    """Bucket ``k`` of partition ``part`` (the ``pi``-th), reduced through ``pipe``."""

    def __init__(self, pipe: BucketPipe, part: Partition, k: int, pi: int = 0) -> None:
        self.pipe = pipe
        self.part = part
        self.pi = pi
        self.bucket = part.layout.buckets[k]
        self.segments = _segments(part, k)
        self.params = [s.param for s in self.segments if s.param is not None]
        # a bucket of frozen parameters is never reduced (the same decision on every rank). A partition's parameters
        # are trained (stage 3's frozen ones have weights-only partitions of their own), even one that requires no
        # gradient for now (frozen after a rebuild's add_param_group had laid it out, peft's set_adapter)
        self.trainable = bool(self.params) and not getattr(part, "frozen", False)
        self.frees: list[torch.nn.Parameter] = []  # params whose .grad can be freed once this bucket is packed
        # params this bucket holds part of whose last bucket comes later: their .grad moves to ``pipe.held`` once
        # packed here, so a gradient accumulated after (a late one, grad_sync) arrives in a .grad of its own
        self.partial: list[torch.nn.Parameter] = []
        self.order = 0  # its place in the launch order (grad_sync)
        self._plan = None  # the pack plan: its device table serves every step (kernels/pack.py)
        self.remaining = 0  # stages 2-3: trainable parameters whose gradient this round still waits for

    @torch.no_grad()  # (in a hook of a backward(create_graph=True), grad mode is on)
    def start(self, present, accumulate: bool, free_grads: bool, block: bool, late: dict | None = None) -> bool:
        """Pack the gradients and launch the reduce-scatter (``accumulate``: added to the shard when it lands);
        the parameters that held a gradient are marked in ``present`` (a ``grad_sync.Presence``).

        ``late`` (by parameter id): pack these gradients instead of ``.grad`` (zeros for the parameters not in
        it) and free nothing: a second reduction of this bucket in one round (grad_sync's late gradients).

        Returns False, launching nothing, when no pool buffer is free and not ``block``."""
        if not self.trainable:
            return True
        part, b, pipe = self.part, self.bucket, self.pipe
        dst = part.shard(part.grad_shard, b)
        direct = pipe.direct(part)
        if direct:  # one rank: the gradients pack straight into the shard (nothing to reduce, no pool buffer)
            base = buf = dst
        else:
            base = pipe.acquire(part.reduce_dtype, b.numel, block)
            if base is None:
                return False
            buf = base[: b.numel]
        tensors = self.gradients(present, late)
        n = pipe.divisor
        if self._plan is None:
            self._plan = ops.pack_plan(tensors, [s.bucket_offset for s in self.segments], buf,
                                       numels=[s.numel for s in self.segments])
        # Pre-divide by the world size as DDP does (SUM then no AVG: portable).
        with label(PACK):  # the gradients were checked when backward produced them (grad_sync._check_grad)
            ops.pack_checked_(self._plan, tensors, buf, scale=1.0 / n if n > 1 else None,
                              accumulate=direct and accumulate)
        if direct:
            self._free(free_grads and late is None)
            return True
        acc = down = scratch = None
        if part.grad_tier is Tier.HOST and (pipe.copy_down or dst.device != buf.device):  # reduce in place, copy down
            # (HSDP: into a tensor of its own, so the pool buffer is free while the replicas all-reduce it)
            out = buf[part.own(b)] if pipe.replicate is None else torch.empty(b.shard_numel, dtype=buf.dtype,
                                                                              device=buf.device)
            down = dst
            if accumulate:  # added on the device (Transfers.add_down), not by the host
                scratch = pipe.scratch_of(base, b.shard_numel)
        else:
            out = dst
            if accumulate:
                acc, out = out, torch.empty_like(out)
        with label(REDUCE_SCATTER):  # qgZ: a quantized all-to-all, summed into out at the wait (comm/codec.py)
            handle = pipe.comm.reduce_scatter(out, buf, async_op=True, scratch_input=True) if pipe.codec is None \
                else pipe.codec.reduce_scatter(pipe.comm, out, buf)
        pipe.pending.append(_Inflight(self, handle, base, out, acc, down, scratch))
        self._free(free_grads and late is None)
        return True

    def gradients(self, present, late: dict | None = None) -> list:
        """What each segment packs (None: zeros), its parameter marked in ``present``: ``.grad`` (the part of it
        this bucket holds), or from ``late`` (by parameter id) when given."""
        tensors = []
        flags = present.flags[self.pi]
        held = self.pipe.held
        for s in self.segments:
            if s.param is None:
                g = None
            elif late is not None:
                g = late.get(id(s.param))
            elif s.whole or not held:
                g = s.param.grad
            else:  # part of a parameter that an earlier bucket packed part of
                g = held.get(id(s.param), s.param.grad)
            if g is not None:
                flags[s.index] = True
                if not (s.whole and g.is_contiguous()):  # a whole contiguous .grad packs as it is
                    g = g.reshape(-1)[s.start: s.start + s.numel]
                    if not g.is_contiguous():  # a .grad set by hand whose strides flatten without a copy (t[:, ::2])
                        g = g.contiguous()
            tensors.append(g)
        return tensors

    def _free(self, free_grads: bool) -> None:
        if free_grads:
            held = self.pipe.held
            for p in self.frees:
                p.grad = None
                if held:
                    held.pop(id(p), None)
            for p in self.partial:
                if p.grad is not None and id(p) not in held:
                    held[id(p)] = p.grad  # what its later buckets pack
                    p.grad = None

    def finish(self, f: _Inflight) -> None:
        """Land this bucket's reduction ``f`` (the oldest in flight) in the gradient shard. HSDP: first launch
        the all-reduce of the reduced shard over the replicas; it lands once that completes (``BucketPipe``'s
        ``replicating``), so no hook and no end of backward ever waits for a replica."""
        pipe = self.pipe
        if pipe.replicate is not None:
            f.handle.wait()  # once: an emulated reduce-scatter's copy would overwrite the all-reduce
            codec = pipe.replicate_codec
            pipe.replicating.append((f, pipe.replicate.all_reduce(f.out, async_op=True) if codec is None
                                     else codec.all_reduce_in_two(pipe.replicate, pipe.replicate_again, f.out)))
            return
        self.land(f, f.handle)

    def land(self, f: _Inflight, after: Handle | None) -> None:
        """``f``'s reduced shard into the gradient shard, once ``after`` (a collective, or None) is complete."""
        pipe = self.pipe
        if f.down is not None:  # host tier: the copy down waits for the reduction, the host does not
            ticket = (pipe.copies.copy(f.down, f.out, after=after) if f.scratch is None
                      else pipe.copies.add_down(f.down, f.out, f.scratch, after=after))
            pipe.landing.append(_Landing(ticket, f.buffer))
            return
        if after is not None:
            after.wait()
        if f.accumulate_into is not None:
            f.accumulate_into.add_(f.out)


class BucketPipe:
    """The pool buffers, the reductions in flight and the copies down that every bucket shares."""

    #: host tier with host pool buffers (a CPU-only run): reduce in place and copy down as on a GPU
    #: (True: the tests' way to run that path on CPU), rather than land in the host shard directly
    copy_down = False

    def __init__(self, partitions: list[Partition], comm: Comm) -> None:
        self.partitions = partitions
        self.comm = comm
        self.replicate: Comm | None = None  # HSDP: each reduced shard is all-reduced over the replicas too
        self.codec = self.replicate_codec = None  # qgZ (``quantize``): the reductions' codecs (comm/codec.py)
        self.replicate_again: Comm | None = None
        self.divisor = comm.world_size  # gradients are pre-divided by every rank that trains (DDP's average)
        self.pending: deque[_Inflight] = deque()
        self.replicating: deque = deque()  # HSDP: (reduction, its all-reduce over the replicas) not yet landed
        self.landing: deque[_Landing] = deque()  # host tier: copies down not yet settled
        # by parameter id: the .grad of a parameter spread over several buckets, between the pack of its first
        # bucket and of its last (GradBucket.partial)
        self.held: dict[int, torch.Tensor] = {}
        self.copies = transfers(partitions[0].flat.device) if partitions else None
        self._pool: dict[torch.dtype, list[torch.Tensor]] = {}
        # host tier: per pool buffer, the device scratch an accumulating round is added in (Transfers.add_down)
        self._scratch: dict[int, torch.Tensor] = {}
        self._pool_cap: dict[torch.dtype, int] = {}

    def direct(self, part: Partition) -> bool:
        """Whether ``part``'s buckets pack straight into its gradient shard: one rank, no codec and no replicas
        (nothing to reduce), the shard beside the gradients: the states not offloaded, or offloaded on a CPU-only
        run (the host shard is where the gradients are; not with ``copy_down``, the GPU's way). ``plan/memory.py``
        then counts no pool buffer (it plans the GPU's way: with offload, a pool buffer on the device)."""
        if self.comm.world_size != 1 or self.replicate is not None or self.codec is not None:
            return False
        if part.grad_tier is Tier.DEVICE:
            return True
        return not self.copy_down and part.grad_shard is not None and part.grad_shard.device == part.flat.device

    def span(self, replicate: Comm | None, world_size: int) -> None:
        """HSDP: also all-reduce each reduced shard over ``replicate``; average over ``world_size`` ranks."""
        self.replicate, self.divisor = replicate, world_size

    def quantize(self, name: str | None, block: int, replicate_again: Comm | None = None) -> None:
        """qgZ (``grad_comm``): the reductions at both levels send ``name``-quantized values (None: as they are);
        HSDP: ``replicate_again`` is a second group of the replicas, for the second of the two exchanges that
        stand for each all-reduce over them (``codec.TwoPhase``)."""
        self.codec = codec_for(name, block, self.comm)
        self.replicate_codec = codec_for(name, block, self.replicate)
        self.replicate_again = replicate_again

    def count(self, bucket: GradBucket) -> None:
        """``bucket`` is ever reduced: its dtype's pool may hold one more buffer (up to MAX_INFLIGHT)."""
        if bucket.trainable:
            dtype = bucket.part.reduce_dtype
            self._pool_cap[dtype] = min(MAX_INFLIGHT, self._pool_cap.get(dtype, 0) + 1)

    def acquire(self, dtype: torch.dtype, numel: int, block: bool) -> torch.Tensor | None:
        """A pool buffer of ``dtype`` holding ``numel`` that no reduction uses.

        At most MAX_INFLIGHT buffers per dtype. When all are in flight, wait for the
        oldest only if ``block``: a hook inside backward must not, since another rank
        may need this rank to reach a later collective (stage 3's next gather) before
        it can launch the reduction this one would wait for.
        """
        pool = self._pool.setdefault(dtype, [])  # least recently used first
        while True:
            if len(pool) < self._pool_cap.get(dtype, 1):  # the pool grows to its bound first: its size never depends on timing
                size = max(b.numel for part in self.partitions if part.reduce_dtype == dtype
                           for b in part.layout.buckets)
                pool.append(torch.empty(size, dtype=dtype, device=self.partitions[0].flat.device))
                return pool[-1]
            busy = {id(f.buffer) for f in self.pending}
            for buf in pool:
                if id(buf) not in busy and buf.numel() >= numel:
                    pool.remove(buf)
                    pool.append(buf)
                    for landing in self.landing:  # host tier: packing into it waits (on the GPU) for its copy down
                        if landing.buffer is buf:
                            landing.ticket.order_before()
                    return buf
            if not block and not self.pending[0].handle.done():
                return None
            self.finish_oldest()

    def finish_oldest(self) -> None:
        f = self.pending.popleft()
        f.bucket.finish(f)

    def finish_completed(self) -> None:
        """Finish the reductions already complete (host tier: start their copies down) and settle the
        copies already down, without blocking: the hooks call it, so shards go down during backward."""
        while self.pending and self.pending[0].handle.done():
            self.finish_oldest()
        while self.replicating and self.replicating[0][1].done():
            f, handle = self.replicating.popleft()
            f.bucket.land(f, handle)
        self.settle(block=False)

    def wait(self) -> None:
        """Every reduction finished and (host tier) every shard down."""
        with label(REDUCE_SCATTER):
            while self.pending:
                self.finish_oldest()
            while self.replicating:
                f, handle = self.replicating.popleft()
                f.bucket.land(f, handle)
            self.settle(block=True)

    def settle(self, block: bool) -> None:
        """Settle the copies down (oldest first): every one if ``block`` (before the host reads the shard), else
        those already done."""
        while self.landing:
            first = self.landing[0]
            if not (block or first.ticket.done()):
                return
            self.landing.popleft()
            first.ticket.wait()

    def scratch_of(self, base: torch.Tensor, numel: int) -> torch.Tensor:
        """The device scratch of pool buffer ``base``, beside it (made on first use: only a run that accumulates
        pays for it). Its uses queue in order on the copy stream, the only one that touches it."""
        s = self._scratch.get(id(base))
        if s is None:
            size = max(b.shard_numel for part in self.partitions if part.reduce_dtype == base.dtype
                       for b in part.layout.buckets)
            s = self._scratch[id(base)] = torch.empty(size, dtype=base.dtype, device=base.device)
        return s[:numel]

    def buffer_bytes(self) -> int:
        """Bytes of the pool buffers (on the parameters' device)."""
        return sum(t.numel() * t.element_size() for bufs in self._pool.values() for t in bufs)
