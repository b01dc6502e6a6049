"""The pure-torch twins of the packing kernels (``fused_zero.kernels.pack``).

They run under ``FUSED_ZERO_BACKEND=torch`` and on CPU; the plan they get is
checked by ``fused_zero.ops.pack`` (disjoint ranges inside the bucket, sizes
that match the tensors).
"""
from __future__ import annotations

import numpy as np
import torch


def _bucket_views(bucket: torch.Tensor, offsets, sizes) -> list:
    """``bucket[o:o+n]`` for every (o, n), cut with one ``split`` (ranges disjoint)."""
    off = np.asarray(offsets, dtype=np.int64).reshape(-1)
    num = np.asarray(sizes, dtype=np.int64).reshape(-1)
    live = np.flatnonzero(num > 0)
    order = live[np.argsort(off[live], kind="stable")]
    starts, lens = off[order], num[order]
    ends = starts + lens
    gaps = starts - np.concatenate(([0], ends[:-1]))
    cuts = np.empty(2 * len(order) + 1, dtype=np.int64)
    cuts[0:-1:2], cuts[1::2] = gaps, lens
    cuts[-1] = bucket.numel() - (ends[-1] if len(ends) else 0)
    pieces = bucket.split(cuts.tolist())  # host tensor: the CPU twin's plan
    views = [bucket[:0]] * len(num)
    for k, i in enumerate(order.tolist()):  # host tensor
        views[i] = pieces[2 * k + 1]
    return views


#: bucket buffers whose views a plan keeps (the optimizer's pool buffers, used in turn)
_VIEW_CACHE = 4


def _cached(plan, bucket: torch.Tensor, kind: str, make) -> list:
    """``make(bucket)`` (views of ``bucket``), kept in the plan under ``kind`` for the next call on the same memory.

    Keyed by the bucket's address and checked against a one-element view of it taken with the views
    (a storage resized since then has moved, and its old address may hold another buffer). At
    most ``_VIEW_CACHE`` buffers per plan and kind."""
    cache = plan.state.setdefault(kind, {})
    ptr = bucket.data_ptr()
    entry = cache.get(ptr)
    if entry is None or entry[0].data_ptr() != ptr:
        if len(cache) >= _VIEW_CACHE:
            cache.pop(next(iter(cache)))
        entry = cache[ptr] = (bucket[:1], make(bucket))
    return entry[1]


def _cached_views(plan, bucket: torch.Tensor) -> list:
    """``_bucket_views`` of ``bucket`` (cached)."""
    return _cached(plan, bucket, "views", lambda b: _bucket_views(b, plan.offsets, plan.numels))


def _runs(plan, bucket: torch.Tensor) -> list:
    """Views of ``bucket`` over the maximal runs of adjacent ranges of ``plan`` (cached): what one scale of every
    packed range touches, in a few ranges rather than one per tensor (800 small gradients scaled one view each
    cost 1.7 ms a step on a 2-core CPU; their ranges mostly lie end to end)."""
    def make(b: torch.Tensor) -> list:
        merged: list = []
        for lo, hi in sorted((o, o + n) for o, n in zip(plan.offsets, plan.numels) if n > 0):
            if merged and merged[-1][1] == lo:
                merged[-1][1] = hi
            else:
                merged.append([lo, hi])
        return [b[lo:hi] for lo, hi in merged]
    return _cached(plan, bucket, "runs", make)


def _scale_(views: list, scale: float) -> None:
    """``v.mul_(scale)`` for every view: fp32 math rounded once, as the kernel's. One ``_foreach_mul_`` for fp32;
    bf16 and fp16 one by one (torch's CPU ``_foreach_mul_`` rounds the scalar to the tensors' dtype first: 1/3
    gave another bf16 value for a third of the elements)."""
    if all(v.dtype == torch.float32 for v in views):
        torch._foreach_mul_(views, scale)
        return
    for v in views:
        v.mul_(scale)


def _copy_shaped(plan, bucket: torch.Tensor, views: list, tensors) -> None:
    """``views[i].copy_(tensors[i])`` for all i in one ``_foreach_copy_``, through views of the bucket shaped like
    the tensors (made once per plan and bucket: reshaping 800 gradients flat costs more than copying them).

    A tensor whose shape changed makes the copy raise (the same number of elements broadcasts only where the
    order of elements is the same): the shaped views are then made again."""
    key = ("shaped", bucket.data_ptr())
    shaped = plan.state.get(key)
    if shaped is not None and shaped[0] is views:
        try:
            torch._foreach_copy_(shaped[1], list(tensors))
            return
        except RuntimeError:
            pass
    shaped = (views, [v.view(t.shape) for v, t in zip(views, tensors)])
    plan.state[key] = shaped
    torch._foreach_copy_(shaped[1], list(tensors))


def pack_twin(plan, tensors, bucket: torch.Tensor, *, accumulate: bool = False,
              scale=None) -> torch.Tensor:
    """Twin of kernels.pack: ``bucket[o:o+n] = round(t * scale [+ bucket[o:o+n]])``.

    Values go through fp32 and are rounded once into the bucket's dtype; a
    plain copy (no scale, no accumulate) is ``copy_`` (bitwise, torch's RNE
    casts). A None entry zeroes its range (``plan.numels[i]`` elements), or
    keeps it when accumulating. ``plan`` (a checked ``PackPlan``) gives the
    offsets and sizes.
    """
    views = _cached_views(plan, bucket)
    if not accumulate:
        # One copy of every tensor, then one scale of every range it landed in: bitwise the
        # per-tensor round(t * scale) wherever t widens into the bucket exactly (the same dtype,
        # or an fp32 bucket), since the copy then rounds nothing and the scale rounds once.
        exact = scale is None or bucket.dtype == torch.float32 or all(
            t is None or t.dtype == bucket.dtype for t in tensors)
        if exact and tensors and not any(t is None for t in tensors):
            _copy_shaped(plan, bucket, views, tensors)
            if scale is not None:  # (elementwise: the same bits as scaling each tensor's range)
                _scale_(_runs(plan, bucket), scale)
            return bucket
        if exact:
            dsts, srcs, zeros = [], [], []
            for t, dst in zip(tensors, views):
                if t is None:
                    zeros.append(dst)
                else:
                    dsts.append(dst)
                    srcs.append(t if t.dim() == 1 else t.reshape(-1))
            if zeros:
                torch._foreach_zero_(zeros)
            if dsts:
                torch._foreach_copy_(dsts, srcs)
            if scale is not None and dsts:
                _scale_(dsts, scale)
            return bucket
    dsts, srcs = [], []
    for t, dst in zip(tensors, views):
        if t is None:
            if not accumulate and dst.numel():
                dst.zero_()
            continue
        src = t if t.dim() == 1 else t.reshape(-1)
        if not accumulate and scale is None:
            dsts.append(dst)
            srcs.append(src)
            continue
        val = src.float()
        if scale is not None:
            val = val * scale
        if accumulate:
            val = val + dst.float()
        dst.copy_(val)
    if dsts:
        torch._foreach_copy_(dsts, srcs)
    return bucket


def unpack_twin(plan, bucket: torch.Tensor, tensors) -> None:
    """Twin of kernels.pack.unpack: ``t[...] = bucket[o:o+t.numel()]`` cast to t.dtype."""
    views = _cached_views(plan, bucket)
    dsts, srcs = [], []
    for t, src in zip(tensors, views):
        if t is not None and t.numel() > 0:
            dsts.append(t if t.dim() == 1 else t.view(-1))
            srcs.append(src)
    if dsts:
        torch._foreach_copy_(dsts, srcs)
