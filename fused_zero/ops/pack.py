"""``pack_`` / ``unpack_`` / ``pack_plan``: many tensors <-> one flat bucket.

A ``PackPlan`` validates a bucket layout once. Backends: ``triton``
(``fused_zero.kernels.pack``: work tables cached in the plan, one launch per
tensor dtype) and ``torch`` (the twin in ``pack_twin.py``); both take
``(plan, tensors, bucket, *, accumulate, scale)`` for pack and
``(plan, bucket, tensors)`` for unpack.
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
    the tensors themselves (their addresses: the Triton work tables). Each
    call compares the tensors' (data_ptr, dtype, numel, contiguity) and the
    bucket's address with the cached ones and rebuilds the tables when any
    differs, so the same plan serves new grad tensors every step.
    """

    offsets: tuple
    numels: tuple
    bucket_dtype: torch.dtype
    bucket_numel: int
    device: torch.device
    state: dict


def _key(tensors, bucket):
    # Equal data_ptrs imply equal devices: CUDA's unified virtual addressing
    # gives host and every device disjoint addresses.
    try:
        return (bucket.data_ptr(),) + tuple(
            None if t is None else (t.data_ptr(), t.dtype, t.numel(), t.is_contiguous()) for t in tensors
        )
    except (AttributeError, TypeError, RuntimeError):
        return None  # not all tensors: _check_entries names the culprit


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
    key = _key(tensors, bucket)
    if key is not None and key == plan.state.get("key"):
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
    plan.state.update(key=key, disjoint=disjoint, launches=None)  # the bucket views (pack_twin) stay
    return key


def pack_plan(tensors, offsets, bucket, *, numels=None) -> PackPlan:
    """Validate a bucket layout once: a ``PackPlan`` for ``pack_`` / ``unpack_``.

    tensors: list of contiguous fp32/bf16/fp16 tensors (any shape) or None
    (then ``numels[i]`` gives the size of its range). offsets: element offset
    of each tensor in ``bucket``; ranges must lie inside the bucket and must
    not overlap (gaps are fine and left untouched). Keep one plan per tensor
    list: a plan used alternately for grads (pack_) and params (unpack_)
    rebuilds its tables on every switch.
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
    come again and is rebuilt in place when they change. Triton: one launch
    per tensor dtype.
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
    numel, dtype and device (``.grad`` was checked against its parameter when backward produced
    it, and sliced flat), the bucket is the plan's and shares no memory with them. Nothing is
    validated here; the Triton work tables are rebuilt only when an address changed.
    """
    if plan.device.type != "cpu" or _backend.forced() == "triton":
        key = (bucket.data_ptr(),) + tuple(None if t is None else t.data_ptr() for t in tensors)
        if key != plan.state.get("checked_key"):
            plan.state.update(checked_key=key, launches=None)
    return _backend.implementation("pack", bucket.device)(plan, tensors, bucket, accumulate=accumulate, scale=scale)


def unpack_(bucket, tensors, offsets=None, *, plan=None) -> None:
    """``t[...] = bucket[o:o+t.numel()]`` cast to ``t.dtype`` for every tensor
    (None entries are skipped); the reverse of ``pack_``. Same checks and
    ``plan`` reuse as ``pack_``; the tensors must not share memory."""
    plan = _use_plan(tensors, bucket, offsets, None, plan, sizeless_none=True)
    if not plan.state["disjoint"]:
        raise ValueError("tensors share memory with each other; unpack_ needs separate output tensors")
    _backend.implementation("unpack", bucket.device)(plan, bucket, tensors)


def _launches(kpack, plan, tensors, bucket):
    """The plan's work tables, built when the tensors changed (``_check_entries`` clears them)."""
    if plan.state["launches"] is None:
        plan.state["launches"] = kpack.build_launches(tensors, plan.offsets, plan.numels, bucket)
    return plan.state["launches"]


def _pack_triton(plan, tensors, bucket, *, accumulate, scale):
    kpack = _backend.kernels("pack")
    return kpack.pack(_launches(kpack, plan, tensors, bucket), bucket, accumulate=accumulate, scale=scale)


def _unpack_triton(plan, bucket, tensors) -> None:
    kpack = _backend.kernels("pack")
    kpack.unpack(_launches(kpack, plan, tensors, bucket), bucket)


_backend.register("pack", triton=_pack_triton, torch=pack_twin)
_backend.register("unpack", triton=_unpack_triton, torch=unpack_twin)
