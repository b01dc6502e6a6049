"""The default CPU path of ``ops.adamw_``: torch's own fused CPU AdamW.

``torch._fused_adamw_`` / ``torch._fused_adam_`` update fp32 buffers in one
vectorised pass on CPU, several times faster than the op-by-op twin in
``reference.py``. They read fp32 gradients and *divide* by a loss scale, so a
narrow gradient is widened first and ``grad_scale`` (a multiplier) is passed
as its reciprocal; ``param_out`` is a separate rounding pass (torch's RNE).
The twin stays the oracle of the Triton kernel and runs whenever
``FUSED_ZERO_BACKEND=torch`` is set; this path is checked against
torch.optim.AdamW / Adam in tests/test_native.py.
"""
from __future__ import annotations

import torch


def adamw_(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
           adam_w_mode=True, maximize=False, param_out=None, grad_scale=None, found_inf=None) -> None:
    """Same contract as ``fused_zero.ops.adamw_`` (arguments already validated)."""
    if found_inf is not None and found_inf.item() != 0:
        return
    if grad.dtype != torch.float32:
        grad = grad.float()
    if isinstance(step, torch.Tensor):
        step = step.to(device=param.device, dtype=torch.float32)
    else:
        step = torch.tensor(float(step))
    inv_scale = None
    if grad_scale is not None:
        inv_scale = torch.as_tensor(grad_scale, dtype=torch.float64).reciprocal().float()
    fused = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    fused([param], [grad], [exp_avg], [exp_avg_sq], [], [step], lr=lr, beta1=beta1, beta2=beta2,
          weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=maximize,
          grad_scale=inv_scale, found_inf=None)
    if param_out is not None:
        param_out.copy_(param)
