"""``optimizer.clip_grad_value_(v)``: torch.nn.utils.clip_grad_value_ over the averaged gradients.

torch's own function clamps every ``.grad`` in place; here stages 2-3 keep no ``.grad`` after backward and stage 1
keeps each rank's local one, so torch's fails (stages 2-3: no gradient to clamp) or clamps the wrong values
(stage 1). Clamping is elementwise, so each rank clamps its own shard of the averaged gradient, with no
collective: the call records the clip value and ``step()`` clamps the reduced gradient shards right before the
update, after the step's statistics. A GradScaler's overflow verdict is therefore taken from the unclamped
gradients, as ``scaler.unscale_`` takes it before the user's clip; the shards stay scaled, so the bound is
``v / inv_scale`` (GradScaler's scales are powers of two: the clamped values are then exactly ``v``). A clip
before any ``unscale_`` clamps the scaled values to ``v``, as torch's clamps the scaled ``.grad`` then (an inf
still skips the step here, where torch's clamp made it finite first).

Served as torch's on DDP: after the last backward of the step, before ``step()``, on every rank; called twice,
both clamps apply in turn. Refused (on every rank, by the step, after its collectives where it may be one rank's):
a clip value that is not a real number, a call inside ``no_sync()`` (the averaged gradients exist only after the
last micro-batch), a backward between the call and ``step()`` (torch would add unclamped gradients to clamped
ones: call it after the last backward), and together with a norm clip in the same step (``clip_grad_norm_`` or
``max_grad_norm=``: which applies first would decide the result).
"""
from __future__ import annotations

import numbers

import torch


def check_clip_value(clip_value, norm_clip: bool) -> float:
    """``clip_value`` as a float, or TypeError naming the fix; ValueError where the step clips by norm too
    (``norm_clip``)."""
    if norm_clip:
        raise ValueError(WITH_NORM_CLIP)
    if isinstance(clip_value, bool) or not (isinstance(clip_value, numbers.Real) or (
            isinstance(clip_value, torch.Tensor) and clip_value.numel() == 1 and not clip_value.is_complex())):
        raise TypeError(f"clip_value must be a real number, got {type(clip_value).__name__} {clip_value!r}: pass the "
                        "value to clamp each gradient element to, e.g. clip_grad_value_(1.0)")
    return float(clip_value)


def check_no_value_clip(values: tuple) -> None:
    """clip_grad_norm_() after clip_grad_value_() in one step: ValueError."""
    if values:
        raise ValueError(WITH_NORM_CLIP)


INSIDE_NO_SYNC = ("clip_grad_value_() inside optimizer.no_sync(), while gradients still accumulate: it clamps the "
                  "averaged gradients, which exist only after the last micro-batch's backward. Clip once, after that "
                  "backward and before step() (with Accelerate: under `if accelerator.sync_gradients:`)")

WITH_NORM_CLIP = ("clip_grad_value_() and a norm clip (clip_grad_norm_() or max_grad_norm=) in one step are not "
                  "served: the result depends on which applies first. Clip by value or by norm")

BACKWARD_AFTER = ("a backward ran after clip_grad_value_() and before step(): torch would add its unclamped "
                  "gradients to the clamped ones, which the averaged gradients here cannot reproduce. Call "
                  "clip_grad_value_() once, after the step's last backward; this step changed nothing")


def clamp_shards_(partitions, values: tuple, grad_scale: torch.Tensor | None, unscaled_now: bool) -> None:
    """Clamp every trained partition's reduced gradient shard to each of ``values`` in turn: ``(v, unscaled)``,
    ``unscaled`` whether ``scaler.unscale_()`` came before that call (None: not known then; ``unscaled_now``, whether
    it ran this step, decides). The shards stay scaled and the update multiplies them by ``grad_scale`` (the
    GradScaler's inverse scale, or None): after an unscale_ the bound is ``v`` in the true gradient's units, as
    torch's clamps the unscaled ``.grad``; without one, ``v`` in the scaled units, as torch's clamps the scaled
    ``.grad``."""
    bounds: dict = {}
    for part in partitions:
        g = part.grad_shard
        if g is None or g.numel() == 0:
            continue
        for v, unscaled in values:
            if grad_scale is None or not (unscaled_now if unscaled is None else unscaled):
                g.clamp_(-v, v)
                continue
            key = (g.device, v)
            bound = bounds.get(key)
            if bound is None:  # (a host shard with a GPU scale: one copy per value, as the host update reads it too)
                bound = bounds[key] = (v / grad_scale).to(g.device)
            g.clamp_(min=-bound, max=bound)


def clamp_grads_(grads: list[torch.Tensor], values: tuple[float, ...]) -> None:
    """Stage 1's kept ``.grad`` after the step: clamped as torch's clip left them (a read after step() or a backward
    without zero_grad() sees clamped gradients)."""
    for g in grads:
        for v in values:
            g.clamp_(-v, v)
