"""How step() learns the loss scale and the overflow verdict of a torch.amp.GradScaler.

With ``_step_supports_amp_scaling = True`` the scaler's ``step(optimizer)`` sets
``optimizer.grad_scale`` and ``optimizer.found_inf`` and calls ``optimizer.step()``
(torch's current protocol; a ``grad_scaler=`` argument of step() is deprecated and
makes torch warn). The optimizer still needs the scaler itself: the verdict every
rank agreed on (this rank's ``.grad`` is None at stages 2-3, so the scaler's own
check finds nothing) goes into the scaler's per-optimizer ``found_inf_per_device``,
which ``scaler.update()`` reads, and a ``scaler.unscale_(opt)`` before step() is
known only from that state. ``calling_scaler`` finds the GradScaler whose ``step``
is on the stack (it is the caller, through the step wrappers of torch.optim).
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from .stats import StepStats


class ScalerInputs(NamedTuple):
    inv_scale: torch.Tensor | None  # multiply the gradient shards by this before the update
    found_inf: torch.Tensor | None  # an overflow verdict handed in through the attribute protocol
    state: dict | None  # the scaler's per-optimizer state (when the scaler passed itself)
    # the inverse scale a scaler.unscale_(opt) before step() divided the kept .grad by, where the optimizer reduces
    # them at step() (stage 1; inv_scale is None then, unless a clip_grad_norm_ reduced them before that unscale_):
    # a clip_grad_value_ before that unscale_ clamped them scaled, and the kept .grad owes no more unscaling
    unscaled_by: torch.Tensor | None = None


def scaler_inputs(optimizer, grad_scaler, device: torch.device, grads_unscaled_in_place: bool,
                  reduced_before_unscale: bool = False) -> ScalerInputs:
    """What the scaler (or the attributes it set) says about this step.

    ``grads_unscaled_in_place``: the optimizer reduces ``.grad`` itself at step time,
    so a ``scaler.unscale_(opt)`` before step() has already divided the gradients;
    ``reduced_before_unscale``: unless a ``clip_grad_norm_`` before that ``unscale_``
    reduced them while still scaled (the shards then still need the inverse scale).
    """
    if grad_scaler is None or not grad_scaler.is_enabled():
        scale = _one_element(optimizer, "grad_scale")
        inv = None if scale is None else scale.double().reciprocal().float()
        return ScalerInputs(inv, _one_element(optimizer, "found_inf"), None)
    from torch.amp.grad_scaler import OptState

    state = grad_scaler._per_optimizer_states[id(optimizer)]
    inv = grad_scaler._scale.double().reciprocal().float().to(device).reshape(())  # (a scale of shape (1,) too)
    if state["stage"] is OptState.UNSCALED and grads_unscaled_in_place:
        return ScalerInputs(inv if reduced_before_unscale else None, None, state, inv)
    return ScalerInputs(inv, None, state)


def _one_element(optimizer, name: str) -> torch.Tensor | None:
    """``optimizer.<name>`` (``grad_scale`` or ``found_inf``, torch's fused-optimizer AMP attributes) as a 0-dim tensor:
    torch's fused AdamW takes one element of any shape (an older GradScaler's scale had shape (1,))."""
    t = getattr(optimizer, name, None)
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.numel() != 1:
        raise TypeError(f"optimizer.{name} must be a one-element tensor (what torch.amp.GradScaler sets), got "
                        f"{type(t).__name__}{tuple(t.shape) if isinstance(t, torch.Tensor) else ''}: set it to the "
                        "scale's (or the overflow flag's) tensor, or None")
    return t.reshape(())


_CALLER_DEPTH = 12  # frames above calling_scaler: _step, step, its no_grad and torch.optim wrappers (a subclass's
# override adds its own), the scaler


def calling_scaler(optimizer):
    """The enabled torch.amp.GradScaler stepping ``optimizer`` right now (its ``step`` called ours), or None.

    Looked for only when the scaler set ``optimizer.grad_scale`` or ``found_inf`` (the attribute
    protocol), so a step without AMP reads no frame.
    """
    if getattr(optimizer, "grad_scale", None) is None and getattr(optimizer, "found_inf", None) is None:
        return None
    from torch.amp import GradScaler

    frame = sys._getframe(1)
    for _ in range(_CALLER_DEPTH):
        frame = frame.f_back
        if frame is None:
            return None
        if frame.f_code.co_name == "step" and "self" in frame.f_code.co_varnames:
            scaler = frame.f_locals.get("self")  # the scaler's own frame: it ends with this call
            if isinstance(scaler, GradScaler) and scaler.is_enabled() \
                    and id(optimizer) in scaler._per_optimizer_states:
                return scaler
    return None


def scaler_unscaled(scaler: ScalerInputs) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` ran this step (it divides a kept .grad in place)."""
    if scaler.state is None:
        return False
    from torch.amp.grad_scaler import OptState

    return scaler.state["stage"] is OptState.UNSCALED


_CLIP_CALLER_DEPTH = 4  # frames above clip_grad_value_ / clip_grad_norm_: their decorators' wrappers, the training
# loop (or a framework's clip method), the loop that called that
_HELD = 8  # the longest list or tuple of a frame looked into


def scaler_in_callers(optimizer, skip: int = 0):
    """Before ``optimizer``'s first ``scaler.step`` (the scaler is not known yet), what a GradScaler in the calling
    frames (a local of the training loop, in a list or tuple there, or an attribute of its ``self``) says of its
    gradients: ``(scaler, True)``, an enabled one ran ``unscale_(optimizer)`` this step; ``(None, False)``, one
    there has not, or is disabled (the gradients are as backward left them); ``(None, None)``, no scaler there
    (``step()`` then takes an ``unscale_`` it finds as having come first). ``skip``: frames of fused_zero's own
    between the clip call and this one's caller."""
    from torch.amp import GradScaler
    from torch.amp.grad_scaler import OptState

    found = None
    frame = sys._getframe(1 + skip)
    for _ in range(_CLIP_CALLER_DEPTH + 1):
        frame = frame.f_back
        if frame is None:
            break
        names = frame.f_locals
        candidates = list(names.values())
        try:
            candidates += list(vars(names["self"]).values())
        except (KeyError, TypeError, AttributeError):  # no self, or one without a __dict__
            pass
        for held in tuple(candidates):  # one level into a list or tuple of them (one scaler per model)
            if isinstance(held, (list, tuple)) and len(held) <= _HELD:
                candidates += held
        for scaler in candidates:
            if not isinstance(scaler, GradScaler):
                continue
            state = scaler._per_optimizer_states.get(id(optimizer)) if scaler.is_enabled() else None
            if state is not None and state["stage"] is OptState.UNSCALED:
                return scaler, True
            found = False  # one that has not unscaled it (the gradients are still scaled), or a disabled one (none is)
    return None, found


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
    stats: StepStats  # the clip's all-reduce (stats.py): its sq_norm is of the shards as they were (scaled,
    # under a GradScaler); step() acts on all of it, one all-reduce for both calls
    total: torch.Tensor  # the tensor returned to the user
    # total is final: the norm of the unscaled gradients (a scaler.unscale_ came first), or of the scaled ones (a
    # clip before it, or with none: torch's measures .grad as it is); False: no scaler was known then, and one that
    # step() finds has unscaled is taken as having come first (unscales_at_step)
    resolved: bool
    # (no backward begins while a clip is pending: the optimizer applies it to the gradients first, so its
    # stats always serve the step that follows)
    # a clip this step before this one, not resolved, and the factor it was applied to the shards with (from a
    # norm that a GradScaler found at step() may show to be scaled): (that clip, the factor)
    previous: tuple[PendingClip, torch.Tensor] | None = None
    # its factor is already in the gradients (stage 1 clips .grad and the shards at the call when the norm is final,
    # as torch's clips .grad at once): the update applies none of it
    applied: bool = False

    def unscales_at_step(self, scaler: ScalerInputs) -> bool:
        """Whether ``coef`` unscales the returned norm in place: a scaler turned up only at step() (the usual
        ``unscale_(opt)`` before the first step's clip: the scaler is not known yet)."""
        from torch.amp.grad_scaler import OptState

        return not self.resolved and scaler.inv_scale is not None and scaler.state is not None \
            and scaler.state["stage"] is OptState.UNSCALED

    def coef(self, scaler: ScalerInputs) -> torch.Tensor:
        """The factor the shards still need; unscales the returned norm in place if a scaler turned up at step()
        (``unscales_at_step``)."""
        if self.unscales_at_step(scaler):
            norm, owed = self._unscaled(scaler.inv_scale)
            return torch.clamp(self.max_norm / (norm + 1e-6), max=1.0) * owed
        return torch.clamp(self.max_norm / (self.total + 1e-6), max=1.0)

    def _unscaled(self, inv_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(This clip's norm of the unscaled gradients, written into the returned tensor; the factor the shards
        still owe to the clips before it). A clip that followed another on this step measured shards the first
        had scaled by a factor from a scaled norm: torch's norm then is the first's true factor times the
        first's true norm, and the shards owe the ratio of the true factor to the applied one."""
        if self.previous is None:
            self.total.copy_(self.stats.sq_norm.sqrt() * inv_scale)
            return self.total, torch.ones_like(self.total)
        clip, applied = self.previous
        norm, owed = clip._unscaled(inv_scale)
        true = torch.clamp(clip.max_norm / (norm + 1e-6), max=1.0)
        self.total.copy_(norm * true)
        # max_norm=0 zeroed the shards: both factors are 0, and so is what is owed
        return self.total, owed * torch.where(applied == 0, torch.zeros_like(true), true / applied)


def update_scalars(stats: StepStats, scaler: ScalerInputs, clip: PendingClip | None,
                   max_grad_norm: float | None) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                         torch.Tensor | None]:
    """What the update multiplies the gradient shards by, and its skip verdict, both on the device.

    ``stats``: the step's all-reduce (or the clip's); ``clip``: clip_grad_norm_ called before the step;
    ``max_grad_norm``: clip to it here when no clip_grad_norm_ came first (the config's, or None). Under a GradScaler (``scaler``:
    its state, or the attribute protocol's ``found_inf``) a non-finite gradient on any rank skips the step,
    and the verdict goes into the scaler's ``found_inf_per_device`` for ``scaler.update()``; ranks that
    disagree (``stats.disagree``) skip it too. The factor is the scaler's inverse scale times the clip
    coefficient (None: neither); the clip coefficient alone comes third (None: no clip)."""
    skip = stats.disagree
    if scaler.state is not None or scaler.found_inf is not None:
        found = (stats.nonfinite > 0).float()
        if scaler.found_inf is not None:
            found = torch.maximum(found, scaler.found_inf.to(found))
        if scaler.state is not None:  # no gradient on any rank (a forgotten backward): none, as torch's fused
            # AdamW records none, so scaler.update() raises "No inf checks were recorded prior to update."
            scaler.state["found_inf_per_device"] = {found.device: found} if any(map(any, stats.has_grad)) else {}
        skip = found if skip is None else torch.maximum(found, skip)
    coef = None
    if clip is not None:
        coef = None if clip.applied else clip.coef(scaler)
        if max_grad_norm is not None:  # the config's clip, every step, of what clip_grad_norm_ left
            left = clip.total * torch.clamp(clip.max_norm / (clip.total + 1e-6), max=1.0)
            config = torch.clamp(max_grad_norm / (left + 1e-6), max=1.0)
            coef = config if coef is None else coef * config
    elif max_grad_norm is not None:
        total = stats.total_norm(scaler.inv_scale)
        coef = torch.clamp(max_grad_norm / (total + 1e-6), max=1.0)
    grad_scale = scaler.inv_scale
    if coef is not None:
        grad_scale = coef if grad_scale is None else grad_scale * coef
    return grad_scale, skip, coef


def kept_factor(clip_coef: torch.Tensor | None, inv_scale: torch.Tensor | None,
                skip: torch.Tensor | None) -> torch.Tensor | None:
    """What a kept ``.grad`` (stage 1) is multiplied by after the step, on the device: the clip factor (torch's clip
    scales ``.grad`` in place) times the inverse scale of a GradScaler whose ``unscale_`` did not run, unless the
    step was skipped (torch's fused AdamW, which reads the scale on the device as this optimizer does, writes the
    unscaled gradients back, and leaves them scaled on an overflow). None: nothing to do."""
    if inv_scale is not None and skip is not None:
        inv_scale = torch.where(skip > 0, torch.ones_like(inv_scale), inv_scale)
    if clip_coef is None or inv_scale is None:
        return clip_coef if inv_scale is None else inv_scale
    return clip_coef * inv_scale
