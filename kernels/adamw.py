"""Fused Adam / AdamW step over flat buffers: each element read once, written once.

One launch updates ``param``, ``exp_avg`` and ``exp_avg_sq`` (and with amsgrad
``max_exp_avg_sq``; all fp32) from ``grad`` (fp32, bf16 or fp16) and optionally
writes the new param, rounded to nearest even, into ``param_out`` (bf16, fp16 or
fp32). Arguments are validated by
``fused_zero.ops.adamw_``; the launcher here trusts them.

Numerics follow torch's single-tensor Adam (non-capturable branch), in fp32:

    g = grad * grad_scale; g = -g if maximize
    p = p * (1 - lr*wd)                       (AdamW)   or   g = g + wd*p   (Adam, L2)
    m = m + (1-b1)*(g - m)                    (torch.lerp, small weight; else its other form)
    v = v*b2 + (1-b2)*g*g
    s = max(vmax, v) (amsgrad: stored as vmax; NaN propagates as in torch.maximum)   or   s = v
    p = p + (-step_size*m) / (sqrt(s)/sqrt(bc2) + eps),   step_size = lr/bc1

with correctly rounded ``sqrt_rn`` / ``div_rn`` and no mul+add contraction
(``enable_fp_fusion=False``): each op rounds once, so the GPU kernel, the
interpreter and the torch twin agree bit for bit. Scalars that depend on lr and
step are computed in double: on the host when both are numbers (as torch does),
in the kernel (fp64; beta**step by repeated squaring, step read as an integer)
when either is a 0-d device tensor, so a CUDA graph can capture the step
without a host sync. ``found_inf`` empties the index range on device: a nonzero
(or NaN) value leaves all buffers untouched and moves no bytes.

One fixed launch configuration (in-place: no autotuning), int64 offsets; full
tiles run unmasked so that loads stay 16-byte vectors for any ``numel``.
"""
from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from .rounding import to_bf16_rne

BLOCK = 2048
NUM_WARPS = 8  # 8 elements per thread: 74 registers on sm_90, no spills (ptxas)

_WD_NONE, _WD_DECOUPLED, _WD_L2 = 0, 1, 2
_SCALE_NONE, _SCALE_ARG, _SCALE_PTR = 0, 1, 2
_OUT_KIND = {None: 0, torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


@triton.jit
def _f64_from_bits(bits):
    """The float64 whose IEEE bits are the integer ``bits`` (Triton float args are fp32)."""
    return bits.to(tl.int64).to(tl.float64, bitcast=True)


@triton.jit
def _powi_f64(base, e):
    """``base ** e`` in float64 for an integer ``e >= 0``, by repeated squaring."""
    result = tl.full([], 1.0, tl.float64)
    while e > 0:
        result = tl.where((e & 1) == 1, result * base, result)
        base = base * base
        e = e >> 1
    return result


@triton.jit
def _load(ptr, offs, n, other, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr + offs, mask=offs < n, other=other)
    else:
        return tl.load(ptr + offs)


@triton.jit
def _store(ptr, offs, n, value, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, value, mask=offs < n)
    else:
        tl.store(ptr + offs, value)


@triton.jit
def _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, out_ptr, scale_ptr, offs, n,
                scale, decay, neg_step_size, bc2_sqrt, w1, b2, w2, wd, eps,
                WD_MODE: tl.constexpr, MAXIMIZE: tl.constexpr, LERP_SMALL: tl.constexpr,
                SCALE_MODE: tl.constexpr, OUT_KIND: tl.constexpr, AMSGRAD: tl.constexpr,
                MASKED: tl.constexpr):
    g = _load(g_ptr, offs, n, 0.0, MASKED).to(tl.float32)
    p = _load(p_ptr, offs, n, 0.0, MASKED)
    m = _load(m_ptr, offs, n, 0.0, MASKED)
    v = _load(v_ptr, offs, n, 1.0, MASKED)  # idle lanes: no 0/0 when eps=0
    if AMSGRAD:
        vmax = _load(vmax_ptr, offs, n, 1.0, MASKED)

    if SCALE_MODE == 1:
        g = g * scale
    elif SCALE_MODE == 2:
        g = g * tl.load(scale_ptr)
    if MAXIMIZE:
        g = -g
    if WD_MODE == 1:
        p = p * decay
    elif WD_MODE == 2:
        g = g + wd * p
    if LERP_SMALL:
        m = m + w1 * (g - m)
    else:
        m = g - (g - m) * (1.0 - w1)
    v = v * b2 + w2 * g * g
    if AMSGRAD:
        vmax = tl.where((v > vmax) | (v != v), v, vmax)  # torch.maximum
        denom = tl.math.div_rn(tl.sqrt_rn(vmax), bc2_sqrt) + eps
    else:
        denom = tl.math.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + tl.math.div_rn(neg_step_size * m, denom)

    _store(p_ptr, offs, n, p, MASKED)
    _store(m_ptr, offs, n, m, MASKED)
    _store(v_ptr, offs, n, v, MASKED)
    if AMSGRAD:
        _store(vmax_ptr, offs, n, vmax, MASKED)
    if OUT_KIND == 1:
        _store(out_ptr, offs, n, p, MASKED)
    elif OUT_KIND == 2:
        _store(out_ptr, offs, n, to_bf16_rne(p), MASKED)
    elif OUT_KIND == 3:
        _store(out_ptr, offs, n, p.to(tl.float16), MASKED)


@triton.jit(do_not_specialize=["lr_bits", "wd_bits", "b1_bits", "b2_bits", "step_num"])
def _adamw_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, out_ptr,
    scale_ptr, found_ptr, lr_ptr, step_ptr,
    n,
    scale, decay, neg_step_size, bc2_sqrt,  # fp32, used when scalars come from the host
    w1, b2, w2, wd, eps,  # fp32: 1-beta1, beta2, 1-beta2, weight decay, eps
    lr_bits, wd_bits, b1_bits, b2_bits, step_num,  # float64 bits / int, device-scalar path
    WD_MODE: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    LERP_SMALL: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    HAS_FOUND: tl.constexpr,
    OUT_KIND: tl.constexpr,
    AMSGRAD: tl.constexpr,
    LR_ON_DEVICE: tl.constexpr,
    STEP_ON_DEVICE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if LR_ON_DEVICE or STEP_ON_DEVICE:
        # Same formulas as the host path, in float64, then rounded to fp32 once.
        if LR_ON_DEVICE:
            lr = tl.load(lr_ptr).to(tl.float64)
        else:
            lr = _f64_from_bits(lr_bits)
        if STEP_ON_DEVICE:
            step = tl.load(step_ptr).to(tl.int64)
        else:
            step = step_num.to(tl.int64)
        bc1 = 1.0 - _powi_f64(_f64_from_bits(b1_bits), step)
        bc2 = 1.0 - _powi_f64(_f64_from_bits(b2_bits), step)
        neg_step_size = (-(lr / bc1)).to(tl.float32)
        bc2_sqrt = tl.sqrt(bc2).to(tl.float32)
        decay = (1.0 - lr * _f64_from_bits(wd_bits)).to(tl.float32)

    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if HAS_FOUND:
        # found_inf != 0 (or NaN) empties the range: no lane loads or stores, so a
        # skipped step moves no bytes. (A scalar where(): the interpreter cannot
        # broadcast `block_mask & scalar_bool`.)
        n = tl.where(tl.load(found_ptr) == 0, n, 0)
    # Full tiles go without a mask: an `offs < n` mask with n not a multiple of 16
    # turns every vector load into scalar ones.
    if pid * BLOCK + BLOCK <= n:
        _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, out_ptr, scale_ptr, offs, n,
                    scale, decay, neg_step_size, bc2_sqrt, w1, b2, w2, wd, eps,
                    WD_MODE, MAXIMIZE, LERP_SMALL, SCALE_MODE, OUT_KIND, AMSGRAD, False)
    else:
        _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, out_ptr, scale_ptr, offs, n,
                    scale, decay, neg_step_size, bc2_sqrt, w1, b2, w2, wd, eps,
                    WD_MODE, MAXIMIZE, LERP_SMALL, SCALE_MODE, OUT_KIND, AMSGRAD, True)


def _f32(x: float) -> float:
    """``x`` rounded to fp32, as torch rounds a scalar for an fp32 op."""
    return struct.unpack("<f", struct.pack("<f", float(x)))[0]


def _bits(x: float) -> int:
    """IEEE float64 bits of ``x`` as a signed int64 (kernel args cannot be fp64)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def host_scalars(step, lr, beta1, beta2, weight_decay):
    """(-step_size, sqrt(bc2), 1 - lr*wd) in Python double, exactly as torch's Adam."""
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    return -(lr / bc1), math.sqrt(bc2), 1.0 - lr * weight_decay


def adamw_(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
           adam_w_mode=True, maximize=False, param_out=None, grad_scale=None, found_inf=None,
           amsgrad=False, max_exp_avg_sq=None):
    """Launch one fused step; arguments already checked by ``fused_zero.ops.adamw_``."""
    n = param.numel()
    if n == 0:
        return
    lr_dev = isinstance(lr, torch.Tensor)
    step_dev = isinstance(step, torch.Tensor)
    if lr_dev and not step_dev and 2**31 <= int(step) < 2**32:
        # Triton's interpreter holds such an int argument as a uint32 array under an int64 type and reads a
        # negative step (compiled kernels take it as int64). From the device it is read as int64 on both (a step
        # count no real run reaches: one small copy)
        step, step_dev = torch.tensor(int(step), dtype=torch.int64, device=param.device), True
    if lr_dev or step_dev:
        neg_step_size, bc2_sqrt, decay = 0.0, 1.0, 1.0  # computed in the kernel
    else:
        neg_step_size, bc2_sqrt, decay = host_scalars(step, lr, beta1, beta2, weight_decay)

    if weight_decay == 0:
        wd_mode = _WD_NONE
    else:
        wd_mode = _WD_DECOUPLED if adam_w_mode else _WD_L2
    if grad_scale is None:
        scale_mode, scale = _SCALE_NONE, 1.0
    elif isinstance(grad_scale, torch.Tensor):
        scale_mode, scale = _SCALE_PTR, 1.0
    else:
        scale_mode, scale = _SCALE_ARG, float(grad_scale)

    w1 = 1.0 - beta1
    grid = (triton.cdiv(n, BLOCK),)
    _adamw_kernel[grid](
        param, grad, exp_avg, exp_avg_sq,
        max_exp_avg_sq if amsgrad else param,
        param_out if param_out is not None else param,
        grad_scale if scale_mode == _SCALE_PTR else param,
        found_inf if found_inf is not None else param,
        lr if lr_dev else param,
        step if step_dev else param,
        n,
        scale, float(decay), float(neg_step_size), float(bc2_sqrt),
        float(w1), float(beta2), float(1.0 - beta2), float(weight_decay), float(eps),
        _bits(0.0 if lr_dev else lr), _bits(weight_decay), _bits(beta1), _bits(beta2),
        0 if step_dev else int(step),
        WD_MODE=wd_mode,
        MAXIMIZE=bool(maximize),
        LERP_SMALL=abs(_f32(w1)) < 0.5,  # torch.lerp's test, on the fp32 weight
        SCALE_MODE=scale_mode,
        HAS_FOUND=found_inf is not None,
        OUT_KIND=_OUT_KIND[None if param_out is None else param_out.dtype],
        AMSGRAD=bool(amsgrad),
        LR_ON_DEVICE=lr_dev,
        STEP_ON_DEVICE=step_dev,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
        # No mul+add contraction: every op rounds as in torch's op-by-op order, so the
        # GPU kernel, the interpreter and the twin give the same bits (and a grad_scale
        # equals a pre-scaled grad). Memory-bound: the extra instructions are free.
        enable_fp_fusion=False,
    )
