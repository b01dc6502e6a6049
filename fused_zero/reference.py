"""Pure-torch twins of every Triton kernel: the CPU path and the test oracle.

Each twin computes the same function as its kernel, in the same order of
operations, with torch ops only.
"""
from __future__ import annotations

import torch  # noqa: F401

# --- adamw and norm twins (below) ---
import math  # noqa: E402
from typing import NamedTuple  # noqa: E402


def _adam_scalars(step, lr, beta1, beta2, weight_decay, device):
    """(-step_size, sqrt(bc2), 1 - lr*wd) in double: numbers, or fp32 0-d tensors.

    With lr and step numbers this is torch's host math; with either a tensor it
    stays on ``device`` in float64 (no host sync) and is rounded to fp32 once.
    """
    if not isinstance(lr, torch.Tensor) and not isinstance(step, torch.Tensor):
        bc1 = 1.0 - beta1 ** step
        bc2 = 1.0 - beta2 ** step
        return -(lr / bc1), math.sqrt(bc2), 1.0 - lr * weight_decay
    f64 = torch.float64
    lr64 = (lr.reshape(()).to(f64) if isinstance(lr, torch.Tensor)
            else torch.full((), float(lr), dtype=f64, device=device))
    s64 = (step.reshape(()).to(f64) if isinstance(step, torch.Tensor)
           else torch.full((), float(step), dtype=f64, device=device))
    bc1 = 1.0 - torch.pow(float(beta1), s64)
    bc2 = 1.0 - torch.pow(float(beta2), s64)
    f32 = torch.float32
    return (-(lr64 / bc1)).to(f32), bc2.sqrt().to(f32), (1.0 - lr64 * weight_decay).to(f32)


def _adam_f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def _adam_sqrt_rn(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # torch's CPU fp32 sqrt is not correctly rounded (AVX512 build, torch 2.13: ~17% of
    # values 1 ulp off); sqrt in double then one rounding to fp32 is exact, like sqrt_rn.
    if x.device.type != "cpu":
        return torch.sqrt(x, out=out)
    chunk = 1 << 16  # keeps the float64 scratch in cache
    scratch = torch.empty(min(chunk, x.numel()), dtype=torch.float64)
    for start in range(0, x.numel(), chunk):
        xs = x[start:start + chunk]
        d = scratch[: xs.numel()]
        d.copy_(xs).sqrt_()
        out[start:start + chunk].copy_(d)
    return out


def adamw_(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
           adam_w_mode=True, maximize=False, param_out=None, grad_scale=None, found_inf=None):
    """Twin of ``fused_zero.kernels.adamw.adamw_``: one Adam/AdamW step, plain torch ops.

    Why not ``torch._fused_adamw_`` on CPU: it needs grads in the param dtype, has no
    param_out, and evaluates in another order, so it could be neither the CPU path
    for bf16 grads nor a bitwise oracle for the kernel. Plain elementwise ops in the
    kernel's order (no lerp/addcmul/addcdiv, which fuse multiply-adds on CPU) give
    the kernel's fp32 results bit for bit under the Triton interpreter.
    Arguments are assumed checked by ``fused_zero.ops.adamw_``.
    """
    if param.numel() == 0:
        return
    neg_step, bc2_sqrt, decay = _adam_scalars(step, lr, beta1, beta2, weight_decay, param.device)
    if param.device.type != "cpu" and not isinstance(bc2_sqrt, torch.Tensor):
        # CUDA divides by a host scalar as a * (1/b): divide by a device tensor instead.
        bc2_sqrt = torch.full((), bc2_sqrt, dtype=torch.float32, device=param.device)
    skip = found_inf is not None
    g = grad.to(torch.float32, copy=True)
    p = param.clone() if skip else param
    m = exp_avg.clone() if skip else exp_avg
    v = exp_avg_sq.clone() if skip else exp_avg_sq

    # Two fp32 temporaries (g, t) reused throughout: fresh large CPU tensors cost page faults.
    if grad_scale is not None:
        g.mul_(grad_scale)
    if maximize:
        g.neg_()
    t = torch.empty_like(g)
    if weight_decay != 0:
        if adam_w_mode:
            p.mul_(decay)
        else:
            g.add_(torch.mul(p, weight_decay, out=t))
    w1 = _adam_f32(1.0 - beta1)
    torch.sub(g, m, out=t)
    if abs(w1) < 0.5:  # torch.lerp's two forms, chosen on the fp32 weight
        m.add_(t.mul_(w1))
    else:
        torch.sub(g, t.mul_(_adam_f32(1.0 - w1)), out=m)
    v.mul_(beta2).add_(torch.mul(g, 1.0 - beta2, out=t).mul_(g))
    denom = _adam_sqrt_rn(v, out=t).div_(bc2_sqrt).add_(eps)
    p.add_(torch.mul(m, neg_step, out=g).div_(denom))

    if skip:
        # Decided on device: where() keeps the old bits when found_inf != 0 (or NaN).
        skipped = found_inf.reshape(()) != 0
        if param_out is not None:
            param_out.copy_(torch.where(skipped, param_out, p.to(param_out.dtype)))
        param.copy_(torch.where(skipped, param, p))
        exp_avg.copy_(torch.where(skipped, exp_avg, m))
        exp_avg_sq.copy_(torch.where(skipped, exp_avg_sq, v))
    elif param_out is not None:
        param_out.copy_(p)  # torch's fp32 -> bf16/fp16 conversion rounds to nearest even


class NormStats(NamedTuple):
    """Squared L2 norm (fp32 accumulation) and a non-finite flag (1.0 / 0.0).

    Both are 0-d fp32 tensors on the input's device. ``sq_sum`` may be inf for
    finite inputs whose squares overflow; ``nonfinite`` is 1.0 only when an
    element itself is inf or NaN.
    """

    sq_sum: torch.Tensor
    nonfinite: torch.Tensor


def norm_stats_many(tensors, *, out=None) -> NormStats:
    """Twin of ``fused_zero.kernels.norm``: sum of squares and non-finite flag over buffers."""
    tensors = list(tensors)
    if out is None:
        device = tensors[0].device
        out = NormStats(torch.empty((), dtype=torch.float32, device=device),
                        torch.empty((), dtype=torch.float32, device=device))
    sq = torch.zeros((), dtype=torch.float32, device=out.sq_sum.device)
    bad = torch.zeros((), dtype=torch.bool, device=out.sq_sum.device)
    for x in tensors:
        if x.numel() == 0:
            continue
        x32 = x.to(torch.float32)
        sq = sq + torch.sum(x32 * x32)  # torch's cascade sum: fp32, accurate, deterministic
        bad = bad | ~torch.isfinite(x).all()
    out.sq_sum.copy_(sq)
    out.nonfinite.copy_(bad)
    return out


def norm_stats(x, *, out=None) -> NormStats:
    """Twin of the single-buffer norm kernel."""
    return norm_stats_many([x], out=out)

# --- cast and pack twins (below) ---


def cast_(src: torch.Tensor, dst: torch.Tensor, *, stochastic: bool = False, seed: int = 0) -> torch.Tensor:
    """Twin of kernels.cast: ``dst[:] = src`` rounded to nearest even, or
    stochastically to bf16 (torch's generator, not the kernel's Philox bits)."""
    if not stochastic:
        return dst.copy_(src)
    gen = torch.Generator(device=src.device)
    gen.manual_seed(seed)
    rand = torch.randint(0, 1 << 16, src.shape, generator=gen, device=src.device, dtype=torch.int32)
    bits = src.view(torch.int32)
    # Add 16 random bits below the kept mantissa of the magnitude of finite
    # values, then cut: rounds up with probability (distance to the lower
    # neighbour) / ulp. int32 cannot overflow: finite magnitudes are < 0x7F800000.
    mag = bits & 0x7FFFFFFF
    rand.masked_fill_(mag >= 0x7F800000, 0)  # inf and NaN: no random carry
    mag.add_(rand).bitwise_right_shift_(16)
    out = torch.where(bits < 0, mag - 0x8000, mag)  # sign bit set, as an int16
    out.masked_fill_(mag > 0x7F80, -1)  # NaN -> 0xFFFF, as the kernel writes it
    dst.view(torch.int16).copy_(out)
    return dst


def _bucket_views(bucket: torch.Tensor, offsets, sizes) -> list:
    """``bucket[o:o+n]`` for every (o, n), cut with one ``split`` (ranges disjoint)."""
    import numpy as np

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
    pieces = bucket.split(cuts.tolist())
    views = [bucket[:0]] * len(num)
    for k, i in enumerate(order.tolist()):
        views[i] = pieces[2 * k + 1]
    return views


def pack_(tensors, bucket: torch.Tensor, offsets, *, accumulate: bool = False, scale=None,
          numels=None) -> torch.Tensor:
    """Twin of kernels.pack: ``bucket[o:o+n] = round(t * scale [+ bucket[o:o+n]])``.

    Values go through fp32 and are rounded once into the bucket's dtype; a
    plain copy (no scale, no accumulate) is ``copy_`` (bitwise, torch's RNE
    casts). A None entry zeroes its range (``numels[i]`` elements), or keeps
    it when accumulating. Ranges must be disjoint (ops checks).
    """
    sizes = [numels[i] if t is None else t.numel() for i, t in enumerate(tensors)]
    views = _bucket_views(bucket, offsets, sizes)
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


def unpack_(bucket: torch.Tensor, tensors, offsets) -> None:
    """Twin of kernels.unpack: ``t[...] = bucket[o:o+t.numel()]`` cast to t.dtype."""
    sizes = [0 if t is None else t.numel() for t in tensors]
    views = _bucket_views(bucket, offsets, sizes)
    dsts, srcs = [], []
    for t, src in zip(tensors, views):
        if t is not None and t.numel() > 0:
            dsts.append(t if t.dim() == 1 else t.view(-1))
            srcs.append(src)
    if dsts:
        torch._foreach_copy_(dsts, srcs)
