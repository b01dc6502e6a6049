"""``pack_`` / ``unpack_`` / ``pack_plan``: many tensors <-> one flat bucket.

A ``PackPlan`` validates a bucket layout once. Backends: ``triton``
(``fused_zero.kernels.pack``: one work table per plan kept on the device, the
entries' addresses in a vector beside it, one launch per call) and ``torch``
(the twin in ``pack_twin.py``); both take ``(plan, tensors, bucket, *,
accumulate, scale)`` for pack and ``(plan, bucket, tensors)`` for unpack. The
entry points put the call's addresses in ``plan.state["ptrs"]`` before calling
the triton backend (``_triton_args``), so no address is read twice per call.
"""
from __future__ import annotations

import operator
from typing import NamedTuple

import numpy as np
import torch

from . import _backend
from ._checks import FLOATS, check_bool, check_flat
from .pack_twin import pack_twin, unpack_twin


class PackPlan(NamedTuple):
    """Validated layout of one bucket, reusable by ``pack_`` / ``unpack_``.

    ``offsets`` and ``numels`` are fixed; ``state`` caches what depends on
    the tensors themselves. ``pack_`` and ``unpack_`` compare every tensor's
    (data_ptr, dtype, numel, contiguity) and the bucket's address with the
    ones last validated and validate again when any differs, so the same plan
    serves new grad tensors every step. The Triton work table depends only on
    the layout and the entries' dtypes (rebuilt when a dtype changes); the
    addresses are uploaded again whenever one changed.
    """

    offsets: tuple
    numels: tuple
    bucket_dtype: torch.dtype
    bucket_numel: int
    device: torch.device
    state: dict


_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel
_CONTIGUOUS = torch.Tensor.is_contiguous
_DTYPE = operator.attrgetter("dtype")


def _columns(tensors):
    """(data_ptrs, dtypes, numels, contiguity) of ``tensors`` as four lists (a None entry: address
    0, the rest None); None when an entry is neither a tensor nor None (``_check_entries`` names it).

    One C call per tensor and column (``map`` over the unbound methods): at 1000 tensors this
    check is most of what a ``pack_`` call costs on the host."""
    try:
        return (list(map(_DATA_PTR, tensors)), list(map(_DTYPE, tensors)), list(map(_NUMEL, tensors)),
                list(map(_CONTIGUOUS, tensors)))
    except TypeError:  # a None entry (or not a tensor)
        pass
    if not all(t is None or isinstance(t, torch.Tensor) for t in tensors):
        return None
    return ([0 if t is None else t.data_ptr() for t in tensors],) + tuple(
        [None if t is None else f(t) for t in tensors] for f in (_DTYPE, _NUMEL, _CONTIGUOUS))


def _ints(name, values, count):
    if isinstance(values, torch.Tensor) or not hasattr(values, "__len__"):
        raise TypeError(f"{name} must be a list of ints, got {type(values).__name__}")
    if len(values) != count:
        raise ValueError(
            f"{name} has {len(values)} entries but tensors has {count}; pass one per tensor"
        )
    try:
        out = tuple(operator.index(v) for v in values)
    except TypeError:
        raise TypeError(f"{name} must hold ints, got {[type(v).__name__ for v in values][:4]}...") from None
    if any(v < 0 for v in out):
        raise ValueError(f"{name} must be non-negative, got {min(out)}")
    return out


def _check_entries(plan, tensors, bucket):
    """Check the tensors against the plan and the bucket; return the cache key."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"tensors must be a list of tensors (or None), got {type(tensors).__name__}")
    if len(tensors) != len(plan.offsets):
        raise ValueError(
            f"tensors has {len(tensors)} entries but the plan has {len(plan.offsets)}; "
            "build a new plan with pack_plan"
        )
    if (bucket.dtype, bucket.numel(), bucket.device) != (plan.bucket_dtype, plan.bucket_numel, plan.device):
        raise ValueError(
            f"the plan was built for a {plan.bucket_dtype} bucket of {plan.bucket_numel} elements on "
            f"{plan.device}, got {bucket.dtype}, {bucket.numel()}, {bucket.device}; build a new plan"
        )
    columns = _columns(tensors)
    key = None if columns is None else (bucket.data_ptr(),) + columns
    if key is not None and key == plan.state.get("key"):
        plan.state["ptrs"] = columns[0]
        return key
    spans = []
    for i, t in enumerate(tensors):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] must be a torch.Tensor or None, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"tensors[{i}] must be a dense (strided) tensor, got layout {t.layout}")
        if t.dtype not in FLOATS:
            raise TypeError(f"tensors[{i}] has dtype {t.dtype}; supported: float32, bfloat16, float16")
        if not t.is_contiguous():
            raise ValueError(
                f"tensors[{i}] is not contiguous; pass t.contiguous() (and copy back after unpack_)"
            )
        if t.device != bucket.device:
            raise ValueError(
                f"tensors[{i}] is on {t.device} but bucket is on {bucket.device}; move them to one device"
            )
        if t.numel() != plan.numels[i]:
            raise ValueError(
                f"tensors[{i}] has {t.numel()} elements but its range has {plan.numels[i]}; "
                "build a new plan with pack_plan"
            )
        if t.numel() > 0:
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i))
    b0 = bucket.data_ptr()
    b1 = b0 + bucket.numel() * bucket.element_size()
    for a0, a1, i in spans:
        if a0 < b1 and b0 < a1:
            raise ValueError(f"tensors[{i}] shares memory with bucket; pass a separate bucket")
    spans.sort()
    disjoint = all(spans[j][1] <= spans[j + 1][0] for j in range(len(spans) - 1))
    # The bucket views (pack_twin) and the device table stay; uploaded=None makes _triton_args read
    # the dtypes again (one may have changed at an unchanged address) before it uploads the addresses.
    plan.state.update(key=key, disjoint=disjoint, ptrs=None if key is None else columns[0], uploaded=None)
    return key


def pack_plan(tensors, offsets, bucket, *, numels=None) -> PackPlan:
    """Validate a bucket layout once: a ``PackPlan`` for ``pack_`` / ``unpack_``.

    tensors: list of contiguous fp32/bf16/fp16 tensors (any shape) or None
    (then ``numels[i]`` gives the size of its range). offsets: element offset
    of each tensor in ``bucket``; ranges must lie inside the bucket and must
    not overlap (gaps are fine and left untouched). Keep one plan per tensor
    list: a plan used alternately for grads (pack_) and params (unpack_)
    validates and uploads the addresses again on every switch.
    """
    return _plan(tensors, offsets, bucket, numels, sizeless_none=False)


def _plan(tensors, offsets, bucket, numels, *, sizeless_none):
    check_flat("bucket", bucket, FLOATS)
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(
            f"tensors must be a list of tensors (or None), got {type(tensors).__name__}; "
            "wrap a single tensor in a list"
        )
    offsets = _ints("offsets", offsets, len(tensors))
    sizes = [None if not isinstance(t, torch.Tensor) else t.numel() for t in tensors]
    if numels is not None:
        numels = _ints("numels", numels, len(tensors))
        for i, (n, m) in enumerate(zip(sizes, numels)):
            if n is not None and n != m:
                raise ValueError(f"tensors[{i}] has {n} elements but numels[{i}] is {m}")
    else:
        for i, n in enumerate(sizes):
            if n is None and tensors[i] is None and not sizeless_none:
                raise ValueError(f"tensors[{i}] is None: pass numels= to give the size of its range")
        numels = tuple(0 if n is None else n for n in sizes)
    off = np.asarray(offsets, dtype=np.int64)
    end = off + np.asarray(numels, dtype=np.int64)
    if len(end) and end.max() > bucket.numel():
        i = int(end.argmax())
        raise ValueError(
            f"tensors[{i}] range [{offsets[i]}, {int(end[i])}) ends past the bucket "
            f"({bucket.numel()} elements); make the bucket larger or fix offsets"
        )
    live = np.flatnonzero(end > off)
    order = live[np.argsort(off[live], kind="stable")]
    clash = np.flatnonzero(end[order[:-1]] > off[order[1:]])
    if len(clash):
        i, j = int(order[clash[0]]), int(order[clash[0] + 1])
        raise ValueError(
            f"the ranges of tensors[{i}] [{offsets[i]}, {int(end[i])}) and tensors[{j}] "
            f"[{offsets[j]}, {int(end[j])}) overlap in the bucket; ranges must be disjoint"
        )
    plan = PackPlan(offsets, numels, bucket.dtype, bucket.numel(), bucket.device, {})
    _check_entries(plan, tensors, bucket)
    return plan


def _use_plan(tensors, bucket, offsets, numels, plan, sizeless_none=False):
    if plan is None:
        if offsets is None:
            raise ValueError("pass offsets (one per tensor) or plan=pack_plan(...)")
        return _plan(tensors, offsets, bucket, numels, sizeless_none=sizeless_none)
    if not isinstance(plan, PackPlan):
        raise TypeError(f"plan must be a PackPlan from pack_plan, got {type(plan).__name__}")
    check_flat("bucket", bucket, FLOATS)
    if offsets is not None and tuple(offsets) != plan.offsets:
        raise ValueError("offsets differ from the plan's; build a new plan with pack_plan")
    if numels is not None and tuple(numels) != plan.numels:
        raise ValueError("numels differ from the plan's; build a new plan with pack_plan")
    _check_entries(plan, tensors, bucket)
    return plan




def pack_(tensors, bucket, offsets=None, *, accumulate: bool = False, scale=None, numels=None, plan=None):
    """Copy ``tensors`` into ``bucket`` at element ``offsets``; returns ``bucket``.

    ``bucket[o:o+n] = round(t * scale)`` or, with ``accumulate=True``,
    ``round(t * scale + bucket[o:o+n])``: computed in fp32 and rounded once to
    the bucket's dtype (nearest even). Without scale and accumulate the copy is
    bitwise ``copy_``. A None entry zeroes its range (kept when accumulating).
    ``plan`` (from ``pack_plan``) skips re-validation when the same tensors
    come again and is validated again when they change. Triton: one launch.
    """
    check_bool("accumulate", accumulate)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(
            f"scale must be a Python float or None, got {type(scale).__name__}; pass float(scale)"
        )
    plan = _use_plan(tensors, bucket, offsets, numels, plan)
    impl = _backend.implementation("pack", bucket.device)
    return impl(plan, tensors, bucket, accumulate=accumulate, scale=scale)


def pack_checked_(plan: PackPlan, tensors, bucket, *, scale=None, accumulate: bool = False):
    """``pack_`` for a caller that guarantees on every call what ``pack_`` would check.

    For the optimizer's gradient buckets: every tensor is contiguous (any shape) with the plan's
    numel and device and the dtype it had when this plan last saw its address (``.grad`` was
    checked against its parameter when backward produced it, and sliced flat), the bucket is the
    plan's and shares no memory with them. Nothing is validated here; the Triton backend reads
    each tensor's address (one call per tensor), uploads them again when one changed and
    rebuilds its table only when an entry's dtype (or None-ness) changed with its address.
    """
    impl = _backend.implementation("pack", bucket.device)
    if impl is _pack_triton:
        try:
            plan.state["ptrs"] = list(map(_DATA_PTR, tensors))
        except TypeError:  # a None entry
            plan.state["ptrs"] = [0 if t is None else t.data_ptr() for t in tensors]
    return impl(plan, tensors, bucket, accumulate=accumulate, scale=scale)


def unpack_(bucket, tensors, offsets=None, *, plan=None) -> None:
    """``t[...] = bucket[o:o+t.numel()]`` cast to ``t.dtype`` for every tensor
    (None entries are skipped); the reverse of ``pack_``. Same checks and
    ``plan`` reuse as ``pack_``; the tensors must not share memory."""
    plan = _use_plan(tensors, bucket, offsets, None, plan, sizeless_none=True)
    if not plan.state["disjoint"]:
        raise ValueError("tensors share memory with each other; unpack_ needs separate output tensors")
    _backend.implementation("unpack", bucket.device)(plan, bucket, tensors)


def _triton_args(kpack, plan, tensors, bucket):
    """The plan's device table and address vector for this call's addresses (``plan.state["ptrs"]``,
    set by the entry point). When an address changed: the dtypes are read again (the table is
    rebuilt if one changed) and the addresses are uploaded again. The table never holds an
    address, so a stale one cannot outlive this comparison."""
    state = plan.state
    ptrs = state["ptrs"]
    if ptrs is not state.get("uploaded") and ptrs != state.get("uploaded"):
        try:
            dtypes = tuple(map(_DTYPE, tensors))
        except AttributeError:  # a None entry
            dtypes = tuple(None if t is None else t.dtype for t in tensors)
        if dtypes != state.get("dtypes"):
            state["table"] = kpack.build_table(dtypes, plan.offsets, plan.numels, bucket)
            state["dtypes"] = dtypes
            state["recent"] = {}
        # the address vectors of this table's last few address lists: where backward's allocations come back to
        # addresses an earlier step used, no upload (a vector only ever holds the addresses it is keyed by)
        recent, key = state["recent"], tuple(ptrs)
        addrs = recent.pop(key, None)
        if addrs is None:
            addrs = kpack.upload_addresses(ptrs, state["table"], bucket.device)
            if len(recent) >= _RECENT_ADDRESSES:
                recent.pop(next(iter(recent)))
        recent[key] = addrs  # (most recent last)
        state["addrs"] = addrs
        state["uploaded"] = ptrs
    return state["table"], state["addrs"]


#: address vectors a plan keeps per table (``_triton_args``): 8 bytes an entry each on the device
_RECENT_ADDRESSES = 4


def _pack_triton(plan, tensors, bucket, *, accumulate, scale):
    kpack = _backend.kernels("pack")
    table, addrs = _triton_args(kpack, plan, tensors, bucket)
    return kpack.pack(table, addrs, bucket, accumulate=accumulate, scale=scale)


def _unpack_triton(plan, bucket, tensors) -> None:
    kpack = _backend.kernels("pack")
    kpack.unpack(*_triton_args(kpack, plan, tensors, bucket), bucket)


_backend.register("pack", triton=_pack_triton, torch=pack_twin)
_backend.register("unpack", triton=_unpack_triton, torch=unpack_twin)
