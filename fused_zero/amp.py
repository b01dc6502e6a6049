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


def scaler_unscaled(scaler: ScalerInputs) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` ran this step (it divides a kept .grad in place)."""
    if scaler.state is None:
        return False
    from torch.amp.grad_scaler import OptState

    return scaler.state["stage"] is OptState.UNSCALED


def unscaling_scaler(optimizer, scaler_ref):
    """The GradScaler that last stepped ``optimizer``, if ``scaler.unscale_(optimizer)`` ran since."""
    scaler = scaler_ref() if scaler_ref is not None else None
    if scaler is None or not scaler.is_enabled():
        return None
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states.get(id(optimizer))
    return scaler if state is not None and state["stage"] is OptState.UNSCALED else None


class PendingClip(NamedTuple):
    """clip_grad_norm_ before step(): the norm it returned and what step() needs to clip."""

    max_norm: float
    sq_norm: torch.Tensor  # of the gradient shards as they were (scaled, under a GradScaler)
    total: torch.Tensor  # the tensor returned to the user
    resolved: bool  # total is already the norm of unscaled gradients

    def coef(self, scaler: ScalerInputs) -> torch.Tensor:
        """The clip factor; unscales the returned norm in place if a scaler turned up at step()."""
        from torch.amp.grad_scaler import OptState

        if not self.resolved and scaler.inv_scale is not None and scaler.state is not None \
                and scaler.state["stage"] is OptState.UNSCALED:
            self.total.copy_(self.sq_norm.sqrt() * scaler.inv_scale)
        return torch.clamp(self.max_norm / (self.total + 1e-6), max=1.0)
