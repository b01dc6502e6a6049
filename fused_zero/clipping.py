"""ShardedOptimizer's gradient clipping: ``clip_grad_norm_`` and ``clip_grad_value_``.

A clip called between the last backward and ``step()`` is not applied at once: the norm is measured
(one all-reduce, shared with the step's checksum) and its factor is applied by the update kernel, as
``PendingClip`` (amp.py). It is applied to the gradients earlier only where torch's in-place clip
would be seen: a backward begins after it (``_apply_clip(during_backward=True)``), a second clip
measures what the first left, or stage 1 keeps ``.grad`` (clipped at the call). ``clip_grad_value_``
clamps each rank's shard in the step (clip_value.py). The methods are ShardedOptimizer's
(``ClipMethods`` is one of its bases), kept here apart from the step.
"""
from __future__ import annotations

import math
import numbers
import warnings
import weakref

import torch

from .amp import PendingClip, ScalerInputs, scaler_in_callers, unscaling_scaler
from .call_guards import reason_left_for_peers
from .clip_value import INSIDE_NO_SYNC, check_clip_value, check_no_value_clip
from .hooks import eager_under_compile
from .habits import CLIP_OVER_DP_ONLY
from .host_read import to_host
from .hyper import agreement_key
from .user_frames import user_stacklevel


def _norm_key(max_norm) -> object:
    """What ranks compare of a clip's max_norm: its value (1 and 1.0 alike; a tensor's read once)."""
    return float(max_norm) if isinstance(max_norm, numbers.Real) else agreement_key(max_norm)


def _check_clip_args(max_norm, norm_type) -> None:
    """clip_grad_norm_'s max_norm is a number (torch would fail dividing by it) and norm_type the 2-norm."""
    if isinstance(max_norm, bool) or not (isinstance(max_norm, numbers.Real) or (
            isinstance(max_norm, torch.Tensor) and max_norm.numel() == 1 and not max_norm.is_complex())):
        raise TypeError(f"max_norm must be a real number, got {type(max_norm).__name__} {max_norm!r}: pass the norm "
                        "to clip to, e.g. clip_grad_norm_(1.0)")
    if norm_type != 2.0:
        raise ValueError(f"only the 2-norm is supported (norm_type=2.0, the default), got norm_type={norm_type}: "
                         "the global norm is summed from every rank's shard in the step's one all-reduce. Clip "
                         "with the 2-norm, or, for another norm at stage 1 (which keeps the local .grad), reduce "
                         "and measure it yourself")


class ClipMethods:
    """ShardedOptimizer's clip methods (a base of ShardedOptimizer; they use its reducer, stats and step state)."""

    @reason_left_for_peers("clip_grad_norm_()")
    @eager_under_compile
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, grad_scaler=None, *,
                        error_if_nonfinite: bool = False, foreach: bool | None = None,
                        _caller_frames: int = 0) -> torch.Tensor:
        """Clip the global gradient norm in the next step(); return the norm.

        Equals ``torch.nn.utils.clip_grad_norm_`` over the full averaged
        gradients (every rank calls it). With a ``torch.amp.GradScaler``, the
        usual ``scaler.unscale_(opt); opt.clip_grad_norm_(m); scaler.step(opt)``
        clips the unscaled gradients at every stage, as DDP does: the shards
        stay scaled, so the norm is unscaled with the scaler's scale. Before any
        ``unscale_`` it measures and clips the scaled gradients, as torch's. Until
        the scaler first steps this optimizer (the very first step, or the first
        after plain steps) it is not known yet: it is looked for in the
        calling frames (``amp.scaler_in_callers``); not found there, the returned
        tensor holds the right value from ``scaler.step(opt)`` on (read it after
        the step), taking an ``unscale_`` the step finds as having come first.
        At stage 1, once the norm is final, the kept ``.grad`` (and the shards
        reduced from it) are clipped at the call, as torch's clips ``.grad``.

        Called again before ``step()``, it measures what the first call left, and a backward after it adds
        unclipped gradients to clipped ones, as torch's. ``error_if_nonfinite=True`` reads the norm on the
        host (one sync) and raises on every rank, as torch's; ``foreach`` is accepted and has no effect (one
        fused pass either way). Only the 2-norm is served.
        """
        self._check_open()
        self._settle_update()
        self._warn_norm_over_dp_only("clip_grad_norm_()")
        # a bad max_norm or norm_type may be on one rank only: raised by the step() that follows, after its
        # collectives; the clip's checksum carries the refusal and max_norm (ranks clipping to different norms
        # would each scale their own shard), so the others skip that step too and raise at their next call
        _, bad_clip = self._refusal(lambda: (_check_clip_args(max_norm, norm_type),
                                             check_no_value_clip(self._clip_values)))
        # (step() raises these: it refuses again there; the clip's checksum carries them to the step that follows,
        # which makes no all-reduce of its own)
        _, edited = self._refusal(self._check_edits)
        _, unfit = self._refusal(lambda: self._stage.check_fit(self.partitions))  # (p.data = t of another shape)
        if not self.grad_sync.sync:  # every rank accumulates alike: raised on all, before any collective
            raise RuntimeError(
                "clip_grad_norm_() inside optimizer.no_sync(), while gradients still accumulate: it clips the global "
                "norm of the whole step's averaged gradients, which exist only after the last micro-batch's "
                "backward. Clip once, after that backward and before step() (with Accelerate: under `if "
                "accelerator.sync_gradients:`); DDP would clip each rank's partial local gradient instead")
        if self._unhooked:
            self._take_unfrozen()
        hand_set = self._reduce_grads()
        refusing = edited is not None or hand_set is not None or bad_clip is not None or unfit is not None
        self._raise_if_disagreed()
        bad_clip = bad_clip or self._clip_refused  # (an earlier clip's this step, applied by a backward since too)
        previous = None
        if self._clip is not None:  # a second clip in this step: it measures what the first one left
            previous = self._apply_clip(during_backward=False)
        grad_scaler, unscaled = self._clip_units(grad_scaler, _caller_frames)
        final = unscaled is not None
        if final and grad_scaler is None and not self.grad_sync.frees_grads:
            self.grad_sync.reduced_scaled = True  # stage 1 reduced the scaled .grad: an unscale_ after misses them
        inv_scale = self._scaler(grad_scaler).inv_scale if grad_scaler is not None else None
        clipped = self._clipped + (None if bad_clip else _norm_key(max_norm),)
        stats = self._stats(with_norm=True, site=("clip_grad_norm_", clipped), refusing=refusing)
        total = stats.total_norm(inv_scale)
        if error_if_nonfinite and not math.isfinite(to_host(total, "clip_grad_norm_(error_if_nonfinite=True)")):
            raise RuntimeError(  # torch's words; the same on every rank (the global norm)
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
                "set `error_if_nonfinite=False`")
        self._clip = PendingClip(math.inf if bad_clip else max_norm, stats, total, resolved=final,
                                 previous=None if previous is None or previous[0].resolved else previous)
        self._clipped, self._clip_refused = clipped, bad_clip  # (bad_clip: step() raises it after its collectives)
        if final and not bad_clip and not self.grad_sync.frees_grads:
            # stage 1 keeps .grad: clipped now, as torch's clip writes .grad at once (a read before step() sees it, a
            # further backward adds to it, an unscale_ after divides it), and the shards reduced from it with it
            self.grad_sync.apply_clip(self._clip.coef(ScalerInputs(None, None, None)), during_backward=False)
            self._clip = self._clip._replace(applied=True)
        return total

    @eager_under_compile
    def clip_grad_value_(self, clip_value: float, foreach: bool | None = None, *, grad_scaler=None) -> None:
        """Clamp every element of the averaged gradients to ``[-clip_value, clip_value]`` in the next step(), as
        ``torch.nn.utils.clip_grad_value_`` over DDP's gradients (every rank calls it, after the step's last
        backward). No collective: each rank clamps its own shard, after the step's overflow check (a GradScaler
        still skips a step with an inf). Called twice, both clamps apply in turn. Not with a norm clip in the same
        step, nor before a further backward (refused by the step on every rank: ``clip_value.py``). At stage 1 the
        kept ``.grad`` are clamped after the step, as torch's clip left them. ``foreach`` has no effect.

        Under a GradScaler it clamps what torch's would: the unscaled gradients after ``scaler.unscale_(opt)``,
        the scaled ones before it. ``grad_scaler``: the clamp is of the gradients unscaled by this scaler (what a
        framework that lets the optimizer unscale means, as Lightning's 16-mixed: ``clip_grad_norm_`` takes it
        alike)."""
        self._check_open()
        if not self.grad_sync.sync:  # every rank accumulates alike: raised on all, before any collective
            raise RuntimeError(INSIDE_NO_SYNC)
        norm_clip = self._clip is not None or self.config.max_grad_norm is not None
        value, bad = self._refusal(lambda: check_clip_value(clip_value, norm_clip))
        if bad is not None:
            self._clip_refused = self._clip_refused or bad  # (the step raises it after its collectives)
            return
        unscaled = self._clip_units(grad_scaler)[1]
        self._clip_values += ((value, unscaled),)
        if not self.grad_sync.frees_grads:  # stage 1: the .grad it clamps (a backward after it adds to them)
            self._clamped = [(p, weakref.ref(p.grad)) for p in self._params if p.grad is not None]

    def _warn_norm_over_dp_only(self, what: str) -> None:
        """Once: ``what`` measures a norm over a data-parallel sub-mesh of a larger mesh, whose other dimensions'
        shares it leaves out (habits.CLIP_OVER_DP_ONLY)."""
        if self.topology.model_parallel and not self._dp_clip_warned:
            self._dp_clip_warned = True
            warnings.warn(CLIP_OVER_DP_ONLY.format(what=what), UserWarning, stacklevel=user_stacklevel())

    def _clip_units(self, grad_scaler, caller_frames: int = 0) -> tuple:
        """In which units a clip called now finds the gradients: torch's measures ``.grad`` as it is, unscaled by a
        ``scaler.unscale_()`` before it or still scaled. ``(the scaler that unscaled them, True)``; ``(None,
        False)``, still as backward left them; ``(None, None)``, not known (``step()`` then takes an ``unscale_`` it
        finds as having come first). ``grad_scaler``: the caller's word that this scaler unscales them. The scaler
        is known from its first step on, before that looked for in the calling frames (``amp.scaler_in_callers``;
        about 8 us a clip), also after steps without one (a scaler first used after plain steps, whose first
        ``unscale_`` would otherwise be taken as not having run). Called by the clip methods only (the frames
        above them are counted)."""
        if grad_scaler is not None:
            return grad_scaler, True
        if self._scaler_ref is not None:
            scaler = unscaling_scaler(self, self._scaler_ref)
            return scaler, scaler is not None
        scaler, unscaled = scaler_in_callers(self, skip=1 + caller_frames)  # (fused_zero.clip_grad_norm_: one more)
        if unscaled is None and self._steps_done:  # none there, and none stepped the steps that finished: a run
            return None, False  # without one (a scaler first used after plain steps is found there, as on the first)
        return scaler, unscaled

    def _apply_clip(self, during_backward: bool) -> tuple[PendingClip, torch.Tensor]:
        """The pending clip_grad_norm_, applied to the gradients now rather than by the update: a backward
        begins, or another clip_grad_norm_ reads the norm (torch clips ``.grad`` in place at once, so a backward
        after it adds unclipped gradients to clipped ones, and a second clip sees the first one's result).
        Device work, no host read; the usual clip-then-step pays nothing (the update applies the factor)."""
        clip, self._clip = self._clip, None
        coef = clip.coef(ScalerInputs(None, None, None))
        if not clip.applied:  # (stage 1's final clips are in .grad and the shards since the call)
            self.grad_sync.apply_clip(coef, during_backward)
        return clip, coef

    def _forget_clips(self) -> None:
        self._clip, self._clipped, self._clip_refused, self._clip_values = None, (), None, ()
        self._clamped = []
