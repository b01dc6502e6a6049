"""One rank: several buckets' gradients packed by one launch (what ``grad_sync.py`` starts where nothing is reduced).

Where nothing is reduced (one rank, no replicas, no codec: ``BucketPipe.direct``) each bucket's pack is a copy
straight into the gradient shard, and on a GPU most of its cost is the host's: a Triton launch and, when backward
put the gradients at new addresses, their upload (about 220 us a pack on an H100 or H200 host, against tens of us
of copying). A ``DirectRun`` packs buckets of one partition that come one after another in the launch order and
lie side by side in its gradient shard with one plan and one launch over their span.

How many buckets a run takes (``direct_runs``):
- reducing at step (stage 1: ``.grad`` is kept until the step anyway), every run is as long as it can be: one
  launch per partition;
- reducing in backward (stages 2-3), a run starts once its last bucket is complete, so the gradients of its
  earlier buckets stay in ``.grad`` until then. A run holds at most the bytes that the pool buffers would take
  with more than one rank (``MAX_INFLIGHT`` buffers of the largest bucket in the reduce dtype), which one rank
  never allocates: its gradient memory stays under what the same model takes on several ranks. Two buckets for
  fp32 or bf16 gradients reduced in their own dtype, four for bf16 reduced in fp32.

Every element is packed as the bucket's own pack would (a copy, or a rounded sum when a backward adds to the
shard), so the shards are bitwise the same either way (tests/test_grad_pack_direct.py).
"""
from __future__ import annotations

from .. import ops
from ..config import MAX_INFLIGHT
from ..profiling import PACK, label
from .grad_buckets import BucketPipe, GradBucket


class DirectRun:
    """Buckets of one partition, consecutive in the launch order and adjacent in its gradient shard, packed
    straight into the shard by one launch."""

    def __init__(self, buckets: list[GradBucket]) -> None:
        self.buckets = buckets
        self.part = buckets[0].part
        self.lo = min(b.bucket.shard_offset for b in buckets)
        self.hi = max(b.bucket.shard_offset + b.bucket.shard_numel for b in buckets)
        self.offsets = [b.bucket.shard_offset - self.lo + s.bucket_offset for b in buckets for s in b.segments]
        self.numels = [s.numel for b in buckets for s in b.segments]
        self._plan = None

    def start(self, present, accumulate: bool, free_grads: bool) -> None:
        """Pack every bucket's gradients (added to the shard when ``accumulate``), mark their parameters in
        ``present`` and, with ``free_grads``, free each ``.grad`` as its last bucket's pack would."""
        buf = self.part.grad_shard[self.lo:self.hi]
        tensors = [g for b in self.buckets for g in b.gradients(present)]
        if self._plan is None:
            self._plan = ops.pack_plan(tensors, self.offsets, buf, numels=self.numels)
        with label(PACK):  # the gradients were checked when backward produced them (grad_sync._check_grad)
            ops.pack_checked_(self._plan, tensors, buf, accumulate=accumulate)
        for b in self.buckets:  # in the launch order: a parameter's earlier buckets hold it, its last frees it
            b._free(free_grads)


def direct_runs(buckets: list[GradBucket], pipe: BucketPipe, bounded: bool) -> dict[int, DirectRun]:
    """The runs of two buckets or more, by the launch-order position of their first bucket (the buckets between
    them pack one by one). ``bounded``: each run's gradients within the pool buffers' bytes (see above)."""
    runs: dict[int, DirectRun] = {}
    k = 0
    while k < len(buckets):
        first = buckets[k]
        if not (first.trainable and pipe.direct(first.part)):
            k += 1
            continue
        part = first.part
        budget = MAX_INFLIGHT * max(b.numel for b in part.layout.buckets) * part.grad_shard.element_size()
        held = first.bucket.numel * part.dtype.itemsize
        lo, hi = first.bucket.shard_offset, first.bucket.shard_offset + first.bucket.shard_numel
        end = k + 1
        while end < len(buckets):
            b = buckets[end]
            size = b.bucket.numel * part.dtype.itemsize
            start, stop = b.bucket.shard_offset, b.bucket.shard_offset + b.bucket.shard_numel
            if b.part is not part or not b.trainable or (bounded and held + size > budget) or \
                    not (stop == lo or start == hi):
                break
            held += size
            lo, hi = min(lo, start), max(hi, stop)
            end += 1
        if end - k > 1:
            runs[k] = DirectRun(buckets[k:end])
        k = end
    return runs
