"""How step() learns the loss scale and the overflow verdict of a torch.amp.GradScaler.

GradScaler passes itself to ``step(grad_scaler=...)`` when ``step`` takes that
argument (``_step_supports_amp_scaling = True``): that is how the optimizer
reaches the scaler's per-optimizer state, to report the overflow verdict every
rank agreed on (``found_inf_per_device``, which ``scaler.update()`` reads).
Without a scaler, the attribute protocol (``optimizer.grad_scale`` and
``optimizer.found_inf``) is honoured as torch's own fused optimizers do.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class ScalerInputs(NamedTuple):
    inv_scale: torch.Tensor | None  # multiply the gradient shards by this before the update
    found_inf: torch.Tensor | None  # an overflow verdict handed in through the attribute protocol
    state: dict | None  # the scaler's per-optimizer state (when the scaler passed itself)


def scaler_inputs(optimizer, grad_scaler, device: torch.device, grads_unscaled_in_place: bool) -> ScalerInputs:
    """What the scaler (or the attributes it set) says about this step.

    ``grads_unscaled_in_place``: the optimizer reduces ``.grad`` itself at step time,
    so a ``scaler.unscale_(opt)`` before step() has already divided the gradients.
    """
    if grad_scaler is None or not grad_scaler.is_enabled():
        scale = getattr(optimizer, "grad_scale", None)
        inv = None if scale is None else scale.double().reciprocal().float()
        return ScalerInputs(inv, getattr(optimizer, "found_inf", None), None)
    from torch.amp.grad_scaler import OptState

    state = grad_scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.UNSCALED and grads_unscaled_in_place:
        return ScalerInputs(None, None, state)
    return ScalerInputs(grad_scaler._scale.double().reciprocal().float().to(device), None, state)
