"""``optimizer.clip_grad_value_(v)``: torch.nn.utils.clip_grad_value_ over the averaged gradients.

torch's own function clamps every ``.grad`` in place; here stages 2-3 keep no ``.grad`` after backward and stage 1
keeps each rank's local one, so torch's fails (stages 2-3: no gradient to clamp) or clamps the wrong values
(stage 1). Clamping is elementwise, so each rank clamps its own shard of the averaged gradient, with no
collective: the call records the clip value and ``step()`` clamps the reduced gradient shards right before the
update, after the step's statistics. A GradScaler's overflow verdict is therefore taken from the unclamped
gradients, as ``scaler.unscale_`` takes it before the user's clip; the shards stay scaled, so the bound is
``v / inv_scale`` (GradScaler's scales are powers of two: the clamped values are then exactly ``v``). A clip
before any ``unscale_`` clamps the scaled values to ``v``, as torch's clamps the scaled ``.grad`` then (an inf
still skips the step here, where torch's clamp made it finite first); an ``unscale_`` after it (stage 1 reduces
the ``.grad`` it divided) makes the bound ``v * inv_scale``: ``clamp_bounds``. Whether the call came after an
``unscale_`` is known from the scaler the optimizer last stepped with, and before its first step from one in the
calling frames (``ShardedOptimizer._clip_units``).

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


def clamp_bounds(values: tuple, scaler, grad_scale: torch.Tensor | None, unscaled_now: bool) -> tuple:
    """Each of ``values`` (``(v, unscaled)``: ``unscaled``, whether ``scaler.unscale_()`` came before that call;
    None: not known then, ``unscaled_now``, whether it ran this step, decides) as the bound in the units of the
    gradient shards: a float, or a device tensor.

    The shards are scaled where the update multiplies them by ``grad_scale`` (the GradScaler's inverse scale):
    a clip after ``unscale_`` clamps the true gradients, so its bound is ``v / inv_scale``, as torch's clamps the
    unscaled ``.grad``. Where ``unscale_`` divided the gradients in place before they were reduced (stage 1:
    ``scaler.unscaled_by``) a clip before it clamped the scaled ones, as torch's: the bound is ``v * inv_scale``
    (torch's ``clamp(g, v) / scale``: scales are powers of two, so the same values). Otherwise the clip and the
    shards share their units: ``v``."""
    bounds = []
    for v, unscaled in values:
        clip_unscaled = unscaled_now if unscaled is None else unscaled
        if clip_unscaled and grad_scale is not None:
            bounds.append(v / grad_scale)
        elif not clip_unscaled and grad_scale is None and scaler.unscaled_by is not None:
            bounds.append(v * scaler.unscaled_by)
        else:
            bounds.append(v)
    return tuple(bounds)


def clamp_(tensors, bounds: tuple) -> None:
    """Clamp each of ``tensors`` to ``[-b, b]`` for each of ``bounds`` in turn (a tensor bound copied once per
    device: a host shard with a GPU scale)."""
    on_device: dict = {}
    for g in tensors:
        if g is None or g.numel() == 0:
            continue
        for i, b in enumerate(bounds):
            if not isinstance(b, torch.Tensor):
                g.clamp_(-b, b)
                continue
            key = (g.device, i)
            bound = on_device.get(key)
            if bound is None:
                bound = on_device[key] = b.to(g.device)
            g.clamp_(min=-bound, max=bound)
