"""What ShardedOptimizer does while backward runs: one hook per trainable parameter, one callback per backward.

The first gradient of a backward opens a round (``_begin_backward``: it queues the end-of-backward
callback, and applies a clip called before this backward, as torch's in-place clip would have been);
each gradient goes to the reducer (``_reduce_grad``: comm/grad_sync.py) and to the stage (stage 3
releases the unit); the callback closes the round (``_end_backward``). A backward that raised leaves
its callback unrun: the next call finishes it (``_recover_if_dropped``). Gradients that reached a
parameter without the hook (a tensor swapped in, a parameter unfrozen after the build) are reduced
at the step or clip. The methods are ShardedOptimizer's (``BackwardEvents`` is one of its bases).
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from .amp import unscaling_scaler
from .clip_value import BACKWARD_AFTER
from .habits import ddp_reduced, ddp_wrapping, left_unreduced
from .hooks import EndOfBackward, queue_end_of_backward


class BackwardEvents:
    """ShardedOptimizer's backward-time methods (a base of ShardedOptimizer; they use its reducer and hooks)."""

    def _on_grad(self, p: nn.Parameter, entry) -> None:
        """The gradient hook of every trainable parameter (``entry``: its ``grad_sync.GradEntry``)."""
        if self._backward_dropped:  # (the attribute read inline: this hook runs once per parameter)
            self._recover_if_dropped()
        if not self._in_backward:
            if not self._habits_checked:
                self._check_habits()
            self._begin_backward()
        self._reduce_grad(p, entry)  # reduce first: the gatherer may then release p's unit
        stage_on_grad = self._stage_on_grad
        if stage_on_grad is not None:
            stage_on_grad(p)

    def _begin_backward(self) -> None:
        if not self._in_backward:
            self._settle_update()  # the reductions land in the gradient shards the update reads
            # the callback first: a backward marked begun always has its end queued (a KeyboardInterrupt landing
            # between the two left it 'in backward' for good); queue_end_of_backward raises outside a backward
            queue_end_of_backward(EndOfBackward(self._hooks.relay(self._end_backward),
                                                self._hooks.relay(self._note_dropped_backward)))
            self._in_backward = True
            self._backwards_begun += 1
            if self._clip is not None:  # clip_grad_norm_ came before this backward: torch clipped .grad then
                self._apply_clip(during_backward=True)
            if self._clip_values:  # clip_grad_value_ came before it: refused by the step (clip_value.py), unless
                # what it clamped is gone (stage 1's model.zero_grad() sets .grad None; stages 2-3's forgets the clip)
                clamped = self._clamped
                if self.grad_sync.frees_grads or any(p.grad is not None and p.grad is g() for p, g in clamped):
                    self._clip_refused = self._clip_refused or RuntimeError(BACKWARD_AFTER)
                self._clip_values = ()

    def _take_swapped(self, stale: list) -> None:
        """Stages 2-3, at the step or clip, ``stale`` holding a .grad no hook saw: those whose tensor user code
        swapped for another (``HookSet.rehook_swapped``) are hooked again and what their gradient got unseen is
        reduced now, as a frozen parameter's that trains again (among ranks: refused). Their values are taken in
        as any assigned tensor's (``before_update``); the others are refused as set by hand."""
        swapped = {id(p) for p in self._hooks.rehook_swapped()}
        unseen = [p for p in stale if id(p) in swapped]
        # the others are refused as set by hand; their hooks are attached again all the same, so that a swap the
        # comparison missed (two between checks, an address reused) costs this one step, not every step after
        self._hooks.reattach([p for p in stale if id(p) not in swapped])
        if not unseen:
            return
        if self.topology.world_size == 1:
            self._reduce_unseen(unseen)
            return
        # among ranks, reducing them now would launch collectives the ranks that swapped nothing do not make:
        # this step is refused (on every rank, through the step's checksum), nothing changed
        for p in unseen:
            p.grad = None
        self.grad_sync.refused = self.grad_sync.refused or RuntimeError(
            f"{len(unseen)} parameters were swapped for other tensors (torch.utils.swap_tensors: load_state_dict "
            "under torch.__future__.set_swap_module_params_on_conversion(True)) after zero_grad(), so the backward "
            "since reached them without the optimizer's gradient hooks and their gradients were not reduced: this "
            "step is skipped on every rank. They are hooked again from now on; load (or swap) before zero_grad()")

    def _take_unfrozen(self) -> None:
        """Parameters laid out while frozen (a rebuild by add_param_group after peft's set_adapter froze them) that
        require a gradient again: hooked from now on, and what they got in the last backward reduced now."""
        now = [p for p in self._unhooked if p.requires_grad]
        if not now:
            return
        self._unhooked = [p for p in self._unhooked if not p.requires_grad]
        if self.grad_sync.frees_grads:  # (stage 1 hooks one parameter per bucket only to see a backward)
            for p in now:
                self._hooks.grad(p, self._on_grad, self.grad_sync.entries[p])
            self._reduce_unseen(now)

    def _reduce_unseen(self, params: list) -> None:
        """Stages 2-3: the .grad of ``params`` that no hook saw, reduced now as late gradients of this round."""
        scaler = unscaling_scaler(self, self._scaler_ref)
        if scaler is not None:  # its unscale_ divided their kept .grad in place; the shards it never saw are
            kept = [p.grad for p in params if p.grad is not None]  # still scaled, and step() unscales them all
            if kept:
                torch._foreach_mul_(kept, scaler._scale.to(kept[0].device).reshape(()))  # (a power of 2: exact)
        self.grad_sync.reduce_unhooked(params)

    @torch.no_grad()  # (a backward(create_graph=True) runs its callbacks and hooks with grad mode on)
    def _end_backward(self) -> None:
        self._in_backward = False
        self._stage.end_backward()  # every gather this rank owes is issued before GradSync may wait
        self.grad_sync.close_round()

    def _note_dropped_backward(self) -> None:
        """The backward raised (its end-of-backward callback was dropped unrun): noted, finished at the next call."""
        self._backward_dropped = True

    def _recover_if_dropped(self) -> None:
        """A backward raised, and a loop caught it and goes on (as torch.optim allows): end that backward as
        its callback would have, so what it produced stays as torch leaves it (the gradients that came in are
        reduced as a finished backward's: ``zero_grad()`` drops them) and the next backward opens a round. On
        every rank that raised alike; a rank raising alone leaves the others in their collectives, as DDP. A
        no-op unless the last backward raised."""
        if not self._backward_dropped:
            return
        self._backward_dropped = False
        self._end_backward()  # (each part ends only what is still open: also where the callback itself was cut short)

    def _check_habits(self) -> None:
        """Once, at the first gradient: refuse a model that DDP wraps (every rank wraps it alike)."""
        self._habits_checked = True
        if self.topology.world_size == 1:
            return
        reduced = ddp_reduced()
        message = ddp_wrapping(list(self._params), reduced)
        if message is not None:
            raise RuntimeError(message)
        if self.module is not None and not self.config.needs_module:  # (stage 3 refuses them when built)
            left = left_unreduced(self.module, reduced)
            if left is not None:
                warnings.warn(left, UserWarning, stacklevel=2)
