"""``adamw_``: one in-place Adam / AdamW step over flat buffers.

Backends: ``triton`` (``fused_zero.kernels.adamw``, one launch), ``native``
(torch's fused CPU AdamW, below: the default on CPU) and ``torch`` (the twin in
``adamw_twin.py``, the oracle of the kernel).
"""
from __future__ import annotations

import math
from numbers import Real

import torch

from . import _backend
from ._checks import (F32, FLOATS, check_bool, check_flat, check_no_overlap, check_real, check_same_device,
                      check_same_numel, check_scalar_tensor)
from .adamw_twin import adamw_ as _twin


def adamw_(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
           adam_w_mode=True, maximize=False, param_out=None, grad_scale=None,
           found_inf=None, amsgrad=False, max_exp_avg_sq=None) -> None:
    """One in-place Adam (``adam_w_mode=False``, L2) / AdamW step over flat buffers.

    ``param``, ``exp_avg``, ``exp_avg_sq``: fp32, updated in place. ``grad``: fp32,
    bf16 or fp16, read only. ``param_out`` (bf16/fp16/fp32) receives the new param,
    rounded to nearest even, in the same pass. ``grad_scale`` (number or 0-d fp32
    tensor) multiplies the gradient first. ``found_inf`` (0-d fp32 tensor): nonzero
    makes the call a no-op, decided on device. ``step`` (the count after increment,
    1 on the first update) and ``lr`` may be numbers or 0-d tensors on the params'
    device (no host sync: the bias corrections are then computed on device; a
    tensor step must hold a value >= 1 and a tensor lr one >= 0, checked only where
    the tensor is on the CPU). ``amsgrad=True``
    needs ``max_exp_avg_sq`` (fp32, zeros at the start, updated in place): it
    becomes max(max_exp_avg_sq, exp_avg_sq) after exp_avg_sq's update and replaces
    it in the denominator. The arithmetic is ``torch.optim.AdamW`` / ``Adam``'s,
    amsgrad included; the rounding is that of the path taken: CUDA, one Triton
    launch; CPU, torch's fused CPU AdamW over the flat buffer (``AdamW(fused=True)``'s kernel,
    which differs from the for-loop and foreach implementations in the last bits; that
    kernel's vectorised body and its scalar tail round ``exp_avg_sq`` differently, and
    torch runs it per tensor, so an element that falls in a tensor's tail there and in
    the body here, or the reverse, may differ by an ulp: parameters seen bitwise equal,
    moments within 1 ulp), or
    the pure-torch twin (``fused_zero.ops.adamw_twin.adamw_``) when
    FUSED_ZERO_BACKEND is set.
    """
    check_flat("param", param, F32)
    check_flat("grad", grad, FLOATS)
    check_flat("exp_avg", exp_avg, F32)
    check_flat("exp_avg_sq", exp_avg_sq, F32)
    if param_out is not None:
        check_flat("param_out", param_out, FLOATS)
    _check_amsgrad(amsgrad, max_exp_avg_sq)
    buffers = dict(grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, max_exp_avg_sq=max_exp_avg_sq,
                   param_out=param_out)
    check_same_numel("param", param, **buffers)
    check_same_device("param", param, **buffers)
    check_no_overlap(param=param, **buffers)
    device = param.device
    lr = check_hyper(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, device=device)
    step = _check_step(_host_scalar("step", step, device), device)
    if isinstance(grad_scale, torch.Tensor):
        check_scalar_tensor("grad_scale", grad_scale, F32, device)
    elif grad_scale is not None:
        if isinstance(grad_scale, bool) or not isinstance(grad_scale, Real):
            raise TypeError("grad_scale must be None, a number or a 0-d fp32 tensor, "
                            f"got {type(grad_scale).__name__}")
        grad_scale = float(grad_scale)
    if found_inf is not None:
        if not isinstance(found_inf, torch.Tensor):
            raise TypeError(f"found_inf must be None or a 0-d fp32 tensor, got {type(found_inf).__name__}")
        check_scalar_tensor("found_inf", found_inf, F32, device)
    if param.numel() == 0:
        return
    impl = _backend.implementation("adamw", device)
    impl(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=float(beta1),
         beta2=float(beta2), eps=float(eps), weight_decay=float(weight_decay),
         adam_w_mode=bool(adam_w_mode), maximize=bool(maximize), param_out=param_out,
         grad_scale=grad_scale, found_inf=found_inf, amsgrad=amsgrad, max_exp_avg_sq=max_exp_avg_sq)


def check_hyper(*, lr, beta1, beta2, eps, weight_decay, device: torch.device):
    """``adamw_``'s checks of the hyperparameters; returns lr as the backends take it (a float, or a 0-d tensor
    on ``device``). For a caller of ``adamw_checked_``: once per step, not per chunk."""
    lr = _host_scalar("lr", lr, device)
    if isinstance(lr, torch.Tensor):
        check_scalar_tensor("lr", lr, (torch.float32, torch.float64), device)
        if lr.device.type == "cpu":  # read for free on the host; a device lr is not read (no sync), as step
            check_real("lr", lr.item(), 0.0)  # host tensor
    else:
        check_real("lr", lr, 0.0)
        lr = float(lr)
    check_real("beta1", beta1, 0.0, 1.0)
    check_real("beta2", beta2, 0.0, 1.0)
    check_real("eps", eps, 0.0)
    check_real("weight_decay", weight_decay, 0.0)
    return lr


def adamw_checked_(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
                   adam_w_mode=True, maximize=False, param_out=None, grad_scale=None, found_inf=None,
                   amsgrad=False, max_exp_avg_sq=None) -> None:
    """``adamw_`` for a caller that guarantees on every call what ``adamw_`` would check.

    For the optimizer's update, chunk by chunk: the buffers are the store's and the shards' (flat, contiguous,
    one numel, one device, disjoint: fixed when they were built), ``step`` is a tensor of the step counts on
    their device or a whole number >= 1, ``grad_scale`` / ``found_inf`` 0-d fp32 tensors there (or None), and
    the hyperparameters passed ``check_hyper`` for this step. Nothing is validated here: at a million elements
    a chunk ``adamw_``'s checks were about 5% of the host update (bench/bench_host_update.py on 2 cores: 921
    against 873 us per chunk), and checking the hyperparameters once, before any partition runs, refuses a
    bad value before anything changed (a later group's, checked inside its first chunk, left the earlier
    groups updated at stage 3, where device stores cannot roll back).
    """
    if param.numel() == 0:
        return
    _backend.implementation("adamw", param.device)(
        param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=float(beta1), beta2=float(beta2), eps=float(eps),
        weight_decay=float(weight_decay), adam_w_mode=bool(adam_w_mode), maximize=bool(maximize),
        param_out=param_out, grad_scale=grad_scale, found_inf=found_inf, amsgrad=amsgrad,
        max_exp_avg_sq=max_exp_avg_sq)


def _check_amsgrad(amsgrad, max_exp_avg_sq) -> None:
    check_bool("amsgrad", amsgrad)
    if amsgrad and max_exp_avg_sq is None:
        raise ValueError("amsgrad=True needs max_exp_avg_sq, an fp32 buffer like exp_avg_sq that starts "
                         "at zero (torch.zeros_like(exp_avg_sq)) and is kept between steps")
    if not amsgrad and max_exp_avg_sq is not None:
        raise ValueError("max_exp_avg_sq is only used with amsgrad=True; pass amsgrad=True, or drop "
                         "max_exp_avg_sq")
    if max_exp_avg_sq is not None:
        check_flat("max_exp_avg_sq", max_exp_avg_sq, F32)


def _host_scalar(name: str, value, device: torch.device):
    """A CPU scalar tensor for a non-CPU op is read on the host (no device sync)."""
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and device.type != "cpu":
        if value.numel() != 1:
            raise ValueError(f"{name} must hold one element (a 0-d tensor), got shape "
                             f"{tuple(value.shape)}")
        return value.item()  # host tensor
    return value


def _check_step(step, device: torch.device):
    if isinstance(step, torch.Tensor):
        check_scalar_tensor("step", step, (torch.float32, torch.float64, torch.int32, torch.int64),
                            device)
        return step
    if isinstance(step, bool) or not isinstance(step, Real):
        raise TypeError(f"step must be an int or a 0-d tensor, got {type(step).__name__}")
    if not math.isfinite(float(step)) or float(step) != int(step):
        raise ValueError(f"step must be a whole number (the count after increment), got {step}")
    if step < 1:
        raise ValueError(f"step must be >= 1 (1 on the first update: increment before calling), "
                         f"got {step}")
    return int(step)


def _native(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
            adam_w_mode=True, maximize=False, param_out=None, grad_scale=None,
            found_inf=None, amsgrad=False, max_exp_avg_sq=None) -> None:
    """The default CPU backend: torch's own fused CPU AdamW.

    ``torch._fused_adamw_`` / ``torch._fused_adam_`` update fp32 buffers in one
    vectorised pass on CPU, several times faster than the op-by-op twin. They read
    fp32 gradients, so a narrow gradient is widened first; ``grad_scale`` multiplies
    it here, as in the kernel (torch's own ``grad_scale`` argument divides, and
    divides the caller's fp32 grad in place); ``param_out`` is a separate rounding
    pass (torch's RNE). Where exp_avg_sq is NaN, torch's fused CPU amsgrad keeps the
    old max_exp_avg_sq (torch.maximum, in the other backends, makes it NaN). Checked
    against torch.optim.AdamW / Adam in tests/test_adamw_native.py and
    tests/test_adamw_amsgrad.py.
    """
    if found_inf is not None and found_inf.item() != 0:  # host tensor: the CPU backend
        return
    if grad_scale is not None:  # a new fp32 tensor: the caller's grad stays as it is
        grad = grad * grad_scale if grad.dtype == torch.float32 else grad.float().mul_(grad_scale)
    elif grad.dtype != torch.float32:
        grad = grad.float()
    if isinstance(step, torch.Tensor):
        step = step.to(device=param.device, dtype=torch.float32)
    else:
        step = torch.tensor(float(step), dtype=torch.float32)
    fused = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    fused([param], [grad], [exp_avg], [exp_avg_sq], [max_exp_avg_sq] if amsgrad else [], [step], lr=lr,
          beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad,
          maximize=maximize, grad_scale=None, found_inf=None)
    if param_out is not None:
        param_out.copy_(param)


_backend.register("adamw", triton=_backend.kernel("adamw", "adamw_"), native=_native, torch=_twin)
