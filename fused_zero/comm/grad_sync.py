"""GradSync: pack each bucket's gradients, reduce-scatter them into the rank's shard.

Every rank launches the buckets in one fixed order (by the position of their
last parameter, descending: backward reaches late parameters first), so the
collectives pair up across ranks whatever order the gradients arrive in.

Reducing during backward (stages 2 and 3): the optimizer's gradient hook calls
``on_grad``, which counts the parameters of each bucket; a bucket is launched
once it and every bucket before it in the order are complete, overlapping the
rest of backward, and the full-size ``.grad`` of a parameter is freed once its
last bucket is packed. A hook never waits for a reduction: when every pool
buffer is still in flight, the launch is deferred to the next hook (the
gradients stay in ``.grad`` until then). ``close_round``, which the optimizer
calls at the end of backward, launches whatever is left (parameters that got
no gradient count as zeros) and may wait for buffers, so each backward is one
complete round on every rank. Reducing at step (stage 1): ``.grad`` is kept and
every bucket is launched from it by ``reduce_all``.

A bucket whose parameters are all frozen is never reduced.

Which parameters hold a gradient (``present``) follows torch's ``.grad``.
Reducing at step, ``.grad`` itself is reduced afresh every step. Reducing in
backward, ``.grad`` was freed and the shards stand in for it: a round adds to
what earlier rounds of the same step left (several backwards accumulate), and
``step()`` consumes them, as if ``.grad`` were then set to None (the optimizer
cannot see ``model.zero_grad()``, so it never carries gradients across steps).
``zero_grad(set_to_none=False)`` makes the parameters that held a gradient
hold zeros, as torch does: they stay present, and step with zero gradients.

With the optimizer states offloaded (``Partition.grad_tier`` is ``Tier.HOST``) the reduced shard lives
in host memory, where the update runs: each bucket is reduce-scattered in place (this rank's
slice of the pool buffer) and copied down as soon as its reduction completes (``tiers/transfer.py``:
on a GPU, on a side stream, overlapping the rest of backward); a round that accumulates lands
in a host scratch buffer and is added on the host. ``wait()`` returns once everything is down.

Where a quantized gradient codec plugs in: ``_launch`` packs into the wire
buffer (today a cast to the partition's reduce dtype and a 1/N scale) and
``_finish_oldest`` lands the result in the shard.
"""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import NamedTuple

import torch

from .. import ops
from ..config import MAX_INFLIGHT
from ..profiling import PACK, REDUCE_SCATTER, label
from .collectives import Comm, Handle
from ..sharding.partition import Partition
from ..sharding.intervals import intersect
from ..tiers.tier import Tier
from ..tiers.transfer import Ticket, host_buffer, transfers


class GradPolicy(NamedTuple):
    """When gradients are reduced, and whether ``.grad`` survives it (the stage decides)."""

    in_backward: bool  # launch each bucket during backward (else all at step)
    free_grads: bool  # set .grad to None once packed


class _Segment(NamedTuple):
    """A run of one bucket: part of a parameter, or padding (param None)."""

    param: torch.nn.Parameter | None
    start: int  # first element within the flattened parameter
    bucket_offset: int
    numel: int


class _Inflight(NamedTuple):
    handle: Handle
    buffer: torch.Tensor  # the pool buffer, busy until the handle is waited
    out: torch.Tensor  # where the reduce-scatter lands (host tier: this rank's slice of buffer)
    accumulate_into: torch.Tensor | None
    down: torch.Tensor | None  # host tier: where ``out`` is copied (the host shard, or a scratch to add)


class _Landing(NamedTuple):
    """A reduced shard on its way down to the host (host tier)."""

    ticket: Ticket
    buffer: torch.Tensor  # the pool buffer it came from
    scratch: torch.Tensor | None  # accumulating: it landed here and is added ...
    accumulate_into: torch.Tensor | None  # ... into this slice of the host shard


def _segments(part: Partition, k: int) -> tuple[_Segment, ...]:
    b = part.layout.buckets[k]
    segs, pos = [], b.offset
    for j in part.bucket_params[k]:
        slot = part.layout.slots[j]
        start, end = intersect(slot.offset, slot.offset + slot.numel, b.offset, b.offset + b.numel)
        if start > pos:
            segs.append(_Segment(None, 0, pos - b.offset, start - pos))
        segs.append(_Segment(part.params[j], start - slot.offset, start - b.offset, end - start))
        pos = end
    if pos < b.offset + b.numel:
        segs.append(_Segment(None, 0, pos - b.offset, b.offset + b.numel - pos))
    return tuple(segs)


class GradSync:
    """Drives the reduce-scatter of every bucket of every partition."""

    def __init__(self, partitions: list[Partition], positions: list[list[int]], comm: Comm,
                 policy: GradPolicy, overlap: bool) -> None:
        self.partitions = partitions
        self.comm = comm
        self.policy = policy
        self.overlap = overlap
        self.sync = True
        keys = [(pi, k) for pi, part in enumerate(partitions) for k in range(len(part.layout.buckets))]
        last = {key: max(positions[key[0]][j] for j in partitions[key[0]].bucket_params[key[1]])
                for key in keys}
        self.order = sorted(keys, key=lambda key: (-last[key], key))
        self.segments = {key: _segments(partitions[key[0]], key[1]) for key in self.order}
        self.buckets_of = {}
        for key in self.order:
            for seg in self.segments[key]:
                if seg.param is not None:
                    self.buckets_of.setdefault(seg.param, []).append(key)
        # Parameters whose .grad can be freed once bucket `key` is packed.
        self.frees = {key: [] for key in self.order}
        for p, keys_of_p in self.buckets_of.items():
            self.frees[max(keys_of_p, key=self.order.index)].append(p)
        # zero-element parameters: in no bucket; they only count as having a gradient (torch steps them)
        self._empty = [p for part in partitions for p in part.params if p not in self.buckets_of]
        self.present: set[torch.nn.Parameter] = set()  # params whose gradient is not None
        self._last_present: set[torch.nn.Parameter] = set()  # present at the last step
        self._pool: dict[torch.dtype, list[torch.Tensor]] = {}
        self._plans: dict = {}  # one pack plan per bucket, reused while the grads stay put
        self._pending: deque[_Inflight] = deque()
        self._landing: deque[_Landing] = deque()  # host tier: copies down not yet settled
        self._scratch: dict[int, torch.Tensor] = {}  # host tier: per pool buffer, where an accumulating round lands
        self._copies = transfers(partitions[0].flat.device) if partitions else None
        # pool buffers per reduce dtype: MAX_INFLIGHT, or fewer when fewer buckets are ever reduced
        self._pool_cap: dict[torch.dtype, int] = {}
        for pi, k in self.order:
            if _trainable(self.segments[(pi, k)]):
                dtype = partitions[pi].reduce_dtype
                self._pool_cap[dtype] = min(MAX_INFLIGHT, self._pool_cap.get(dtype, 0) + 1)
        self._written = False  # the shards hold reductions: the next round adds
        self._reduced = False  # reducing at step: this step's reduction is launched
        self._round_open = False
        self._accumulated = False  # a backward ran under no_sync() since the last step
        self._grad_versions: dict = {}  # reducing at step: .grad's version counter when backward left it
        self._seen: set[torch.nn.Parameter] = set()
        self._remaining: dict = {}
        self._next = 0

    # -- backward ---------------------------------------------------------
    def on_grad(self, p: torch.nn.Parameter) -> None:
        """``p``'s gradient was accumulated (the optimizer's hook)."""
        _check_grad(p)
        keys = self.buckets_of.get(p)
        if keys is not None:  # the model was converted or moved since the build: the clear refusal, not packing's
            part = self.partitions[keys[0][0]]
            if p.dtype != part.dtype or p.device != part.device:
                part.check_kind(p, p.shape, {})
        if not self.sync:
            self._accumulated = True  # a backward under no_sync(): its .grad waits for a synced one
        if not self.policy.in_backward:
            self._grad_versions[p] = p.grad._version  # .grad is kept: see grads_edited()
            return
        if not self.sync:
            return
        if not self._round_open:
            self._open_round()
        if p in self._seen:
            return
        self._seen.add(p)
        if p not in self.buckets_of:  # zero elements: in no bucket, nothing to reduce; it still got a gradient
            self.present.add(p)
            if self.policy.free_grads:
                p.grad = None
            return
        for key in self.buckets_of[p]:
            self._remaining[key] -= 1
        if self.overlap:
            self._launch_ready(flush=False)

    def _open_round(self) -> None:
        self._round_open = True
        self._next = 0
        self._seen.clear()
        self._remaining = {key: sum(1 for s in self.segments[key] if s.param is not None and s.param.requires_grad)
                           for key in self.order}

    def close_round(self) -> None:
        """The end of a backward: launch every bucket this round has left."""
        if not self._round_open:
            return
        self._launch_ready(flush=True)
        self._round_open = False
        self._seen.clear()
        self._written = True

    def _launch_ready(self, flush: bool) -> None:
        while self._next < len(self.order):
            key = self.order[self._next]
            if not flush and self._remaining[key] > 0:
                return
            if not self._launch(key, free_grads=self.policy.free_grads, block=flush):
                return  # no free buffer: the next hook (or the end of backward) launches it
            self._next += 1
            self._finish_completed()

    # -- step -------------------------------------------------------------
    def prepare_step(self) -> None:
        """Every reduction of this step launched and waited for (or a clear error)."""
        if self.policy.in_backward:
            stale = self.unreduced_grads()
            if stale and self._accumulated:
                raise RuntimeError(
                    f"{len(stale)} parameters hold gradients that were never reduced (accumulated under "
                    "no_sync() without a final backward outside it); run the last micro-batch's backward "
                    "outside opt.no_sync()")
            if stale:
                raise RuntimeError(
                    f"{len(stale)} parameters hold a .grad that no backward produced through the optimizer "
                    "(assigned by hand?): stages 2 and 3 reduce gradients during backward and free .grad; "
                    "compute gradients with backward(), or use stage=1, which reduces .grad at step()")
        elif not self._reduced:
            for p in self.buckets_of:  # the kept .grad is read flat: it must be the parameter's own shape
                if p.grad is not None:
                    _check_grad(p)
            self.present.clear()
            self._written = False
            for key in self.order:
                self._launch(key, free_grads=False, block=True)
            self.present.update(p for p in self._empty if p.grad is not None)
            self._reduced = True
        self.wait()

    def grads_edited(self) -> bool:
        """Whether user code wrote a kept ``.grad`` in place after backward produced it (reducing at step).

        The local, not yet averaged gradient: a norm clipped from it (torch.nn.utils.clip_grad_norm_)
        is each rank's own, not the global one.
        """
        return any(p.grad is not None and p.grad._version != v for p, v in self._grad_versions.items())

    def wait(self) -> None:
        """Wait for every launched reduction and apply accumulation (host tier: every shard is down)."""
        with label(REDUCE_SCATTER):
            while self._pending:
                self._finish_oldest()
            self._settle(block=True)

    def end_step(self) -> None:
        """After step(): the shards are consumed; the next reduction writes them."""
        self.wait()
        self._reduced = False
        self._written = False
        self._accumulated = False
        self._grad_versions.clear()
        self._last_present = set(self.present)
        self.present.clear()

    def zero_grad(self, set_to_none: bool) -> None:
        """The shards' share of ``optimizer.zero_grad``."""
        self.wait()
        self._written = False
        if set_to_none:
            self.present.clear()
        else:
            for part in self.partitions:
                part.grad_shard.zero_()
            if self.policy.free_grads:  # torch would still hold (now zeroed) .grad tensors for these
                self.present |= self._last_present

    @contextmanager
    def no_sync(self):
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def unreduced_grads(self) -> list[torch.nn.Parameter]:
        """Params holding a ``.grad`` that no round has reduced (reducing in backward)."""
        return [p for p in self.buckets_of if p.grad is not None]

    def buffer_bytes(self) -> int:
        """Bytes of the pool buffers (on the parameters' device)."""
        return sum(t.numel() * t.element_size() for bufs in self._pool.values() for t in bufs)

    # -- internals --------------------------------------------------------
    def _launch(self, key, free_grads: bool, block: bool) -> bool:
        """Pack bucket ``key`` and start its reduce-scatter; False if no buffer is free and not ``block``."""
        pi, k = key
        part = self.partitions[pi]
        b = part.layout.buckets[k]
        segs = self.segments[key]
        if not _trainable(segs):
            return True  # frozen bucket: same decision on every rank
        base = self._acquire(part.reduce_dtype, b.numel, block)
        if base is None:
            return False
        buf = base[: b.numel]
        tensors = []
        for s in segs:
            g = None if s.param is None else s.param.grad
            if g is not None:
                self.present.add(s.param)
                g = g.reshape(-1)[s.start: s.start + s.numel]
            tensors.append(g)
        n = self.comm.world_size
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = ops.pack_plan(tensors, [s.bucket_offset for s in segs], buf,
                                                    numels=[s.numel for s in segs])
        # Pre-divide by the world size as DDP does (SUM then no AVG: portable).
        with label(PACK):
            ops.pack_(tensors, buf, plan=plan, scale=1.0 / n if n > 1 else None)
        dst = part.shard(part.grad_shard, b)
        acc = down = None
        if part.grad_tier is Tier.HOST:  # reduce in place, copy down once reduced
            out = buf[part.own(b)]
            down = dst
            if self._written:
                acc, down = dst, self._scratch_of(base, b.shard_numel)
        else:
            out = dst
            if self._written:
                acc, out = out, torch.empty_like(out)
        with label(REDUCE_SCATTER):
            handle = self.comm.reduce_scatter(out, buf, async_op=True, scratch_input=True)
        self._pending.append(_Inflight(handle, base, out, acc, down))
        if free_grads:
            for p in self.frees[key]:
                p.grad = None
        return True

    def _acquire(self, dtype: torch.dtype, numel: int, block: bool) -> torch.Tensor | None:
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
            busy = {id(f.buffer) for f in self._pending}
            for buf in pool:
                if id(buf) not in busy and buf.numel() >= numel:
                    pool.remove(buf)
                    pool.append(buf)
                    for landing in self._landing:  # host tier: packing into it waits (on the GPU) for its copy down
                        if landing.buffer is buf:
                            landing.ticket.order_before()
                    return buf
            if not block and not self._pending[0].handle.done():
                return None
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        f = self._pending.popleft()
        if f.down is not None:  # host tier: the copy down waits for the reduction, the host does not
            ticket = self._copies.copy(f.down, f.out, after=f.handle)
            self._landing.append(_Landing(ticket, f.buffer, f.down if f.accumulate_into is not None else None,
                                          f.accumulate_into))
            return
        f.handle.wait()
        if f.accumulate_into is not None:
            f.accumulate_into.add_(f.out)

    def _finish_completed(self) -> None:
        """Finish the reductions already complete (host tier: start their copies down) and settle the
        copies already down, without blocking: the hooks call it, so shards go down during backward."""
        while self._pending and self._pending[0].handle.done():
            self._finish_oldest()
        self._settle(block=False)

    def _settle(self, block: bool, buffer: torch.Tensor | None = None) -> None:
        """Settle the copies down (oldest first): every one if ``block``, else those already done; with
        ``buffer``, at least every one that came from that pool buffer."""
        while self._landing:
            first = self._landing[0]
            if not (block or first.ticket.done() or any(x.buffer is buffer for x in self._landing)):
                return
            self._landing.popleft()
            first.ticket.wait()
            if first.accumulate_into is not None:
                first.accumulate_into.add_(first.scratch)

    def _scratch_of(self, base: torch.Tensor, numel: int) -> torch.Tensor:
        """The host scratch of pool buffer ``base`` (its earlier landings settled: it is rewritten)."""
        self._settle(block=False, buffer=base)
        s = self._scratch.get(id(base))
        if s is None:
            size = max(b.shard_numel for part in self.partitions for b in part.layout.buckets)
            s = self._scratch[id(base)] = host_buffer(size, base.dtype, pinned=base.device.type == "cuda")
        return s[:numel]


def _trainable(segs: tuple[_Segment, ...]) -> bool:
    """Whether a bucket holds a trainable parameter (a bucket of frozen ones is never reduced)."""
    return any(s.param is not None and s.param.requires_grad for s in segs)


def _check_grad(p: torch.nn.Parameter) -> None:
    """``p.grad`` is what the flat buffers can take: dense, of ``p``'s shape and dtype (torch's update would
    fail on a wrong shape; read flat here, it would be silently wrong: a ``.grad.data =`` assignment)."""
    g = p.grad
    if g is None:
        return
    if g.layout != torch.strided:
        raise RuntimeError(
            f"ShardedOptimizer does not support sparse gradients (a parameter of shape {tuple(p.shape)} "
            f"got a {g.layout} gradient); use dense gradients, e.g. nn.Embedding(sparse=False)"
        )
    if g.shape != p.shape or g.dtype != p.dtype:
        raise RuntimeError(
            f"a parameter of shape {tuple(p.shape)} and dtype {p.dtype} holds a .grad of shape {tuple(g.shape)} "
            f"and dtype {g.dtype}: a gradient must match its parameter (assign .grad a tensor like the parameter, "
            "not through .grad.data)")
