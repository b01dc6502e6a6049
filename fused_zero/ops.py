"""Public kernel entry points: validate arguments, then dispatch.

CUDA tensors run the Triton kernels in ``fused_zero.kernels``; CPU tensors run
the pure-torch twins in ``fused_zero.reference``, except adamw_, which runs
torch's own fused CPU AdamW (``native.py``) unless FUSED_ZERO_BACKEND is set
(see ``_dispatch``).
"""
from __future__ import annotations

from . import native as _native
from ._dispatch import backend_for, forced

# --- adamw and norm ops (below) ---
import math as _math  # noqa: E402
from numbers import Real as _Real  # noqa: E402

import torch  # noqa: E402

from . import reference as _reference  # noqa: E402
from ._checks import check_flat, check_no_overlap, check_same_device, check_same_numel  # noqa: E402
from .reference import NormStats  # noqa: E402,F401  (public: the result of norm_stats)

_AN_F32 = (torch.float32,)
_AN_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _an_check_real(name: str, value, lo: float, hi: float | None = None) -> None:
    """``value`` must be a real number in [lo, hi) (or [lo, inf) without hi)."""
    if isinstance(value, bool) or not isinstance(value, _Real):
        raise TypeError(f"{name} must be a Python number, got {type(value).__name__}")
    value = float(value)
    if hi is None and not value >= lo:  # also rejects NaN
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and not lo <= value < hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}), got {value}")


def _an_check_scalar_tensor(name: str, t: torch.Tensor, dtypes, device: torch.device) -> None:
    if t.numel() != 1:
        raise ValueError(f"{name} must hold one element (a 0-d tensor), got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {names}; got {str(t.dtype).replace('torch.', '')}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but param is on {device}; move it to {device}")


def _an_host_scalar(name: str, value, device: torch.device):
    """A CPU scalar tensor for a non-CPU op is read on the host (no device sync)."""
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and device.type != "cpu":
        if value.numel() != 1:
            raise ValueError(f"{name} must hold one element (a 0-d tensor), got shape "
                             f"{tuple(value.shape)}")
        return value.item()
    return value


def _an_check_step(step, device: torch.device):
    if isinstance(step, torch.Tensor):
        _an_check_scalar_tensor("step", step, (torch.float32, torch.float64, torch.int32, torch.int64),
                             device)
        return step
    if isinstance(step, bool) or not isinstance(step, _Real):
        raise TypeError(f"step must be an int or a 0-d tensor, got {type(step).__name__}")
    if not _math.isfinite(float(step)) or float(step) != int(step):
        raise ValueError(f"step must be a whole number (the count after increment), got {step}")
    if step < 1:
        raise ValueError(f"step must be >= 1 (1 on the first update: increment before calling), "
                         f"got {step}")
    return int(step)


def _an_kernels(module: str):
    import importlib  # lazy: CPU-only users never import triton through ops

    return importlib.import_module(f"fused_zero.kernels.{module}")


def adamw_(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
           adam_w_mode=True, maximize=False, param_out=None, grad_scale=None,
           found_inf=None) -> None:
    """One in-place Adam (``adam_w_mode=False``, L2) / AdamW step over flat buffers.

    ``param``, ``exp_avg``, ``exp_avg_sq``: fp32, updated in place. ``grad``: fp32,
    bf16 or fp16, read only. ``param_out`` (bf16/fp16/fp32) receives the new param,
    rounded to nearest even, in the same pass. ``grad_scale`` (number or 0-d fp32
    tensor) multiplies the gradient first. ``found_inf`` (0-d fp32 tensor): nonzero
    makes the call a no-op, decided on device. ``step`` (the count after increment,
    1 on the first update) and ``lr`` may be numbers or 0-d tensors on the params'
    device (no host sync: the bias corrections are then computed on device; a
    tensor step must hold a value >= 1, which is not checked). Numerics follow
    ``torch.optim.AdamW`` / ``Adam`` (foreach=False). CUDA: one Triton launch;
    CPU: torch's fused CPU AdamW (``fused_zero.native``), or the pure-torch twin
    ``fused_zero.reference.adamw_`` when FUSED_ZERO_BACKEND is set.
    """
    check_flat("param", param, _AN_F32)
    check_flat("grad", grad, _AN_FLOATS)
    check_flat("exp_avg", exp_avg, _AN_F32)
    check_flat("exp_avg_sq", exp_avg_sq, _AN_F32)
    if param_out is not None:
        check_flat("param_out", param_out, _AN_FLOATS)
    check_same_numel("param", param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                     param_out=param_out)
    check_same_device("param", param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                      param_out=param_out)
    check_no_overlap(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                     param_out=param_out)
    device = param.device
    lr = _an_host_scalar("lr", lr, device)
    step = _an_check_step(_an_host_scalar("step", step, device), device)
    if isinstance(lr, torch.Tensor):
        _an_check_scalar_tensor("lr", lr, (torch.float32, torch.float64), device)
    else:
        _an_check_real("lr", lr, 0.0)
        lr = float(lr)
    _an_check_real("beta1", beta1, 0.0, 1.0)
    _an_check_real("beta2", beta2, 0.0, 1.0)
    _an_check_real("eps", eps, 0.0)
    _an_check_real("weight_decay", weight_decay, 0.0)
    if isinstance(grad_scale, torch.Tensor):
        _an_check_scalar_tensor("grad_scale", grad_scale, _AN_F32, device)
    elif grad_scale is not None:
        if isinstance(grad_scale, bool) or not isinstance(grad_scale, _Real):
            raise TypeError("grad_scale must be None, a number or a 0-d fp32 tensor, "
                            f"got {type(grad_scale).__name__}")
        grad_scale = float(grad_scale)
    if found_inf is not None:
        if not isinstance(found_inf, torch.Tensor):
            raise TypeError(f"found_inf must be None or a 0-d fp32 tensor, got {type(found_inf).__name__}")
        _an_check_scalar_tensor("found_inf", found_inf, _AN_F32, device)
    if param.numel() == 0:
        return
    if backend_for(device) == "triton":
        impl = _an_kernels("adamw").adamw_
    elif device.type == "cpu" and not forced():
        impl = _native.adamw_
    else:
        impl = _reference.adamw_
    impl(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=float(beta1),
         beta2=float(beta2), eps=float(eps), weight_decay=float(weight_decay),
         adam_w_mode=bool(adam_w_mode), maximize=bool(maximize), param_out=param_out,
         grad_scale=grad_scale, found_inf=found_inf)


def _an_check_norm_out(out, device: torch.device) -> None:
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError("out must be a NormStats(sq_sum, nonfinite) of 0-d fp32 tensors")
    for name, t in zip(("out.sq_sum", "out.nonfinite"), out):
        if not isinstance(t, torch.Tensor) or t.dim() != 0 or t.dtype != torch.float32:
            raise TypeError(f"{name} must be a 0-d fp32 tensor; allocate torch.empty((), "
                            "dtype=torch.float32)")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the input is on {device}; "
                             f"allocate it on {device}")
    check_no_overlap(**{"out.sq_sum": out[0], "out.nonfinite": out[1]})


def norm_stats_many(tensors, *, out: NormStats | None = None) -> NormStats:
    """Sum of squares (fp32 accumulation) and a non-finite flag over flat buffers.

    ``tensors``: fp32/bf16/fp16 1-D contiguous buffers on one device. Returns
    NormStats(sq_sum, nonfinite) as 0-d fp32 tensors on that device (written into
    ``out`` when given). One read of each buffer, a fixed-order two-stage
    reduction: bitwise the same on every run.
    """
    if isinstance(tensors, torch.Tensor):
        raise TypeError("norm_stats_many takes a list of flat buffers; use norm_stats(x) for one")
    tensors = list(tensors)
    if not tensors and out is None:
        raise ValueError("norm_stats_many needs at least one tensor, or out= to write zeros into")
    for i, x in enumerate(tensors):
        check_flat(f"tensors[{i}]", x, _AN_FLOATS)
        check_same_device("tensors[0]", tensors[0], **{f"tensors[{i}]": x})
    device = tensors[0].device if tensors else out[0].device
    if out is None:
        out = NormStats(torch.empty((), dtype=torch.float32, device=device),
                        torch.empty((), dtype=torch.float32, device=device))
    else:
        _an_check_norm_out(out, device)
        out = NormStats(*out)
    if backend_for(device) == "triton":
        _an_kernels("norm").norm_stats_into(tensors, out.sq_sum, out.nonfinite)
    else:
        _reference.norm_stats_many(tensors, out=out)
    return out


def norm_stats(x, *, out: NormStats | None = None) -> NormStats:
    """``norm_stats_many([x])``: squared L2 norm and non-finite flag of one flat buffer."""
    check_flat("x", x, _AN_FLOATS)
    return norm_stats_many([x], out=out)


# --- cast and pack ops (below) ---
import operator as _operator  # noqa: E402
from typing import NamedTuple as _NamedTuple  # noqa: E402

import numpy as _np  # noqa: E402
import torch as _torch  # noqa: E402

from . import reference as _reference  # noqa: E402
from ._checks import check_flat, check_no_overlap, check_same_device, check_same_numel  # noqa: E402

_FLOATS = (_torch.float32, _torch.bfloat16, _torch.float16)


def cast_(src, dst, *, stochastic: bool = False, seed: int = 0):
    """``dst[:] = src`` rounded to ``dst.dtype``; returns ``dst``.

    src: fp32, flat and contiguous. dst: bf16, fp16 or fp32 (a plain copy), as
    many elements, same device. Round to nearest even (bitwise equal to
    ``src.to(dst.dtype)``; NaN stays NaN), or with ``stochastic=True`` (bf16
    only) round up with probability equal to the distance from the lower bf16
    neighbour, drawing bits from Philox with the integer ``seed``:
    deterministic per seed, unbiased in expectation.
    """
    check_flat("src", src, (_torch.float32,))
    check_flat("dst", dst, _FLOATS)
    check_same_numel("src", src, dst=dst)
    check_same_device("src", src, dst=dst)
    check_no_overlap(src=src, dst=dst)
    if not isinstance(stochastic, bool):
        raise TypeError(f"stochastic must be True or False, got {stochastic!r}")
    if stochastic and dst.dtype != _torch.bfloat16:
        raise ValueError(
            f"stochastic rounding supports a bfloat16 dst only, got {dst.dtype}; "
            "pass stochastic=False for round-to-nearest-even"
        )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    if backend_for(src.device) == "torch":
        return _reference.cast_(src, dst, stochastic=stochastic, seed=seed)
    from .kernels import cast as _kcast

    return _kcast.cast(src, dst, stochastic=stochastic, seed=seed)


class PackPlan(_NamedTuple):
    """Validated layout of one bucket, reusable by ``pack_`` / ``unpack_``.

    ``offsets`` and ``numels`` are fixed; ``state`` caches what depends on
    the tensors themselves (their addresses: the Triton work tables). Each
    call compares the tensors' (data_ptr, dtype, numel, contiguity) and the
    bucket's address with the cached ones and rebuilds the tables when any
    differs, so the same plan serves new grad tensors every step.
    """

    offsets: tuple
    numels: tuple
    bucket_dtype: _torch.dtype
    bucket_numel: int
    device: _torch.device
    state: dict


def _pack_key(tensors, bucket):
    # Equal data_ptrs imply equal devices: CUDA's unified virtual addressing
    # gives host and every device disjoint addresses.
    try:
        return (bucket.data_ptr(),) + tuple(
            None if t is None else (t.data_ptr(), t.dtype, t.numel(), t.is_contiguous()) for t in tensors
        )
    except (AttributeError, TypeError, RuntimeError):
        return None  # not all tensors: _pack_entries names the culprit


def _pack_ints(name, values, count):
    if isinstance(values, _torch.Tensor) or not hasattr(values, "__len__"):
        raise TypeError(f"{name} must be a list of ints, got {type(values).__name__}")
    if len(values) != count:
        raise ValueError(
            f"{name} has {len(values)} entries but tensors has {count}; pass one per tensor"
        )
    try:
        out = tuple(_operator.index(v) for v in values)
    except TypeError:
        raise TypeError(f"{name} must hold ints, got {[type(v).__name__ for v in values][:4]}...") from None
    if any(v < 0 for v in out):
        raise ValueError(f"{name} must be non-negative, got {min(out)}")
    return out


def _pack_entries(plan, tensors, bucket):
    """Check the tensors against the plan and the bucket; return the cache key."""
    if isinstance(tensors, _torch.Tensor) or not isinstance(tensors, (list, tuple)):
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
    key = _pack_key(tensors, bucket)
    if key is not None and key == plan.state.get("key"):
        return key
    spans = []
    for i, t in enumerate(tensors):
        if t is None:
            continue
        if not isinstance(t, _torch.Tensor):
            raise TypeError(f"tensors[{i}] must be a torch.Tensor or None, got {type(t).__name__}")
        if t.layout != _torch.strided:
            raise TypeError(f"tensors[{i}] must be a dense (strided) tensor, got layout {t.layout}")
        if t.dtype not in _FLOATS:
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
    plan.state.clear()
    plan.state.update(key=key, disjoint=disjoint, launches=None)
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
    return _pack_plan(tensors, offsets, bucket, numels, sizeless_none=False)


def _pack_plan(tensors, offsets, bucket, numels, *, sizeless_none):
    check_flat("bucket", bucket, _FLOATS)
    if isinstance(tensors, _torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(
            f"tensors must be a list of tensors (or None), got {type(tensors).__name__}; "
            "wrap a single tensor in a list"
        )
    offsets = _pack_ints("offsets", offsets, len(tensors))
    sizes = [None if not isinstance(t, _torch.Tensor) else t.numel() for t in tensors]
    if numels is not None:
        numels = _pack_ints("numels", numels, len(tensors))
        for i, (n, m) in enumerate(zip(sizes, numels)):
            if n is not None and n != m:
                raise ValueError(f"tensors[{i}] has {n} elements but numels[{i}] is {m}")
    else:
        for i, n in enumerate(sizes):
            if n is None and tensors[i] is None and not sizeless_none:
                raise ValueError(f"tensors[{i}] is None: pass numels= to give the size of its range")
        numels = tuple(0 if n is None else n for n in sizes)
    off = _np.asarray(offsets, dtype=_np.int64)
    end = off + _np.asarray(numels, dtype=_np.int64)
    if len(end) and end.max() > bucket.numel():
        i = int(end.argmax())
        raise ValueError(
            f"tensors[{i}] range [{offsets[i]}, {int(end[i])}) ends past the bucket "
            f"({bucket.numel()} elements); make the bucket larger or fix offsets"
        )
    live = _np.flatnonzero(end > off)
    order = live[_np.argsort(off[live], kind="stable")]
    clash = _np.flatnonzero(end[order[:-1]] > off[order[1:]])
    if len(clash):
        i, j = int(order[clash[0]]), int(order[clash[0] + 1])
        raise ValueError(
            f"the ranges of tensors[{i}] [{offsets[i]}, {int(end[i])}) and tensors[{j}] "
            f"[{offsets[j]}, {int(end[j])}) overlap in the bucket; ranges must be disjoint"
        )
    plan = PackPlan(offsets, numels, bucket.dtype, bucket.numel(), bucket.device, {})
    _pack_entries(plan, tensors, bucket)
    return plan


def _pack_use_plan(tensors, bucket, offsets, numels, plan, sizeless_none=False):
    if plan is None:
        if offsets is None:
            raise ValueError("pass offsets (one per tensor) or plan=pack_plan(...)")
        return _pack_plan(tensors, offsets, bucket, numels, sizeless_none=sizeless_none)
    if not isinstance(plan, PackPlan):
        raise TypeError(f"plan must be a PackPlan from pack_plan, got {type(plan).__name__}")
    check_flat("bucket", bucket, _FLOATS)
    if offsets is not None and tuple(offsets) != plan.offsets:
        raise ValueError("offsets differ from the plan's; build a new plan with pack_plan")
    if numels is not None and tuple(numels) != plan.numels:
        raise ValueError("numels differ from the plan's; build a new plan with pack_plan")
    _pack_entries(plan, tensors, bucket)
    return plan


def _pack_launches(plan, tensors, bucket):
    from .kernels import pack as _kpack

    if plan.state["launches"] is None:
        plan.state["launches"] = _kpack.build_launches(tensors, plan.offsets, plan.numels, bucket)
    return _kpack, plan.state["launches"]


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
    if not isinstance(accumulate, bool):
        raise TypeError(f"accumulate must be True or False, got {accumulate!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(
            f"scale must be a Python float or None, got {type(scale).__name__}; pass float(scale)"
        )
    plan = _pack_use_plan(tensors, bucket, offsets, numels, plan)
    if backend_for(bucket.device) == "torch":
        return _reference.pack_(tensors, bucket, plan.offsets, accumulate=accumulate, scale=scale,
                                numels=plan.numels)
    kpack, launches = _pack_launches(plan, tensors, bucket)
    return kpack.pack(launches, bucket, accumulate=accumulate, scale=scale)


def unpack_(bucket, tensors, offsets=None, *, plan=None) -> None:
    """``t[...] = bucket[o:o+t.numel()]`` cast to ``t.dtype`` for every tensor
    (None entries are skipped); the reverse of ``pack_``. Same checks and
    ``plan`` reuse as ``pack_``; the tensors must not share memory."""
    plan = _pack_use_plan(tensors, bucket, offsets, None, plan, sizeless_none=True)
    if not plan.state["disjoint"]:
        raise ValueError("tensors share memory with each other; unpack_ needs separate output tensors")
    if backend_for(bucket.device) == "torch":
        _reference.unpack_(bucket, tensors, plan.offsets)
        return
    kpack, launches = _pack_launches(plan, tensors, bucket)
    kpack.unpack(launches, bucket)
