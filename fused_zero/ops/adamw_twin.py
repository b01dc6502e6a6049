"""The pure-torch twin of the AdamW kernel: ``FUSED_ZERO_BACKEND=torch`` runs it, and
tests compare the Triton kernel with it bit for bit under the interpreter.

It computes the kernel's function in the kernel's order of operations, with torch
ops only (see ``fused_zero/kernels/adamw.py`` for the formulas).
"""
from __future__ import annotations

import math

import numpy
import torch


def _scalars(step, lr, beta1, beta2, weight_decay, device):
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


def _f32(x: float) -> float:
    """``x`` rounded to fp32 (to nearest even), on the host without a tensor (so no op a graph would record)."""
    return float(numpy.float32(x))


def _sqrt_rn(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
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
           adam_w_mode=True, maximize=False, param_out=None, grad_scale=None, found_inf=None,
           amsgrad=False, max_exp_avg_sq=None):
    """Twin of ``fused_zero.kernels.adamw.adamw_``: one Adam/AdamW step, plain torch ops.

    Why not ``torch._fused_adamw_`` (the faster ``native`` CPU backend in ``adamw.py``):
    it evaluates in another order, so it cannot be a bitwise oracle for the kernel.
    Plain elementwise ops in the kernel's order (no lerp/addcmul/addcdiv, which fuse
    multiply-adds on CPU) give the kernel's fp32 results bit for bit under the Triton
    interpreter.
    Arguments are checked by ``fused_zero.ops.adamw_``.
    """
    if param.numel() == 0:
        return
    neg_step, bc2_sqrt, decay = _scalars(step, lr, beta1, beta2, weight_decay, param.device)
    if param.device.type != "cpu" and not isinstance(bc2_sqrt, torch.Tensor):
        # CUDA divides by a host scalar as a * (1/b): divide by a device tensor instead.
        bc2_sqrt = torch.full((), bc2_sqrt, dtype=torch.float32, device=param.device)
    skip = found_inf is not None
    g = grad.to(torch.float32, copy=True)
    state = [param, exp_avg, exp_avg_sq] + ([max_exp_avg_sq] if amsgrad else [])
    new = [x.clone() for x in state] if skip else state  # a skip decides on device, at the end
    p, m, v = new[:3]

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
    w1 = _f32(1.0 - beta1)
    torch.sub(g, m, out=t)
    if abs(w1) < 0.5:  # torch.lerp's two forms, chosen on the fp32 weight
        m.add_(t.mul_(w1))
    else:
        torch.sub(g, t.mul_(_f32(1.0 - w1)), out=m)
    v.mul_(beta2).add_(torch.mul(g, 1.0 - beta2, out=t).mul_(g))
    if amsgrad:
        v = torch.maximum(new[3], v, out=new[3])  # NaN propagates, as in torch
    denom = _sqrt_rn(v, out=t).div_(bc2_sqrt).add_(eps)
    p.add_(torch.mul(m, neg_step, out=g).div_(denom))

    if skip:
        # Decided on device: where() keeps the old bits when found_inf != 0 (or NaN).
        skipped = found_inf.reshape(()) != 0
        if param_out is not None:
            param_out.copy_(torch.where(skipped, param_out, p.to(param_out.dtype)))
        for old, updated in zip(state, new):
            old.copy_(torch.where(skipped, old, updated))
    elif param_out is not None:
        param_out.copy_(p)  # torch's fp32 -> bf16/fp16 conversion rounds to nearest even
