"""The gradient reducers: one per policy, over the buckets of ``grad_buckets.py``.

Every rank launches the buckets in one fixed order (by the position of their
last parameter, descending: backward reaches late parameters first), so the
collectives pair up across ranks whatever order the gradients arrive in.

``ReduceInBackward`` (stages 2 and 3): the optimizer's gradient hook calls
``on_grad``, which counts the parameters of each bucket; a bucket is started
once it and every bucket before it in the order are complete, overlapping the
rest of backward, and the full-size ``.grad`` of a parameter is freed once its
last bucket is packed. A hook never waits for a reduction: when every pool
buffer is still in flight, the start is deferred to the next hook (the
gradients stay in ``.grad`` until then). ``close_round``, which the optimizer
calls at the end of backward, starts whatever is left (parameters that got
no gradient count as zeros) and may wait for buffers, so each backward is one
complete round on every rank. ``ReduceAtStep`` (stage 1): ``.grad`` is kept and
every bucket is started from it by ``prepare_step``.

What the shards hold is a ``RoundState``: ``EMPTY`` after a step, ``OPEN`` while
a backward reduces into them, ``REDUCED`` once a round closed (or stage 1 reduced
at step), ``ADDING`` while a further backward of the same step adds to them.

Which parameters hold a gradient (``present``) follows torch's ``.grad``.
Reducing at step, ``.grad`` itself is reduced afresh every step. Reducing in
backward, ``.grad`` was freed and the shards stand in for it: a round adds to
what earlier rounds of the same step left (several backwards accumulate), and
``step()`` consumes them, as if ``.grad`` were then set to None (a loop setting
``p.grad = None`` itself leaves nothing to see, so it never carries gradients across
steps); ``model.zero_grad()`` reaches them (``module_zero_grad.py``, ``forget_some``).
``zero_grad(set_to_none=False)`` makes the parameters that held a gradient
hold zeros, as torch does: they stay present, and step with zero gradients.

Where a quantized gradient codec plugs in: ``GradBucket.start`` packs into the
wire buffer (today a cast to the partition's reduce dtype and a 1/N scale) and
``GradBucket.finish`` lands the result in the shard.
"""
from __future__ import annotations

import enum
from typing import NamedTuple

import torch

from ..clip_value import clamp_
from ..host_read import to_host
from ..lifecycle import expect, setting
from ..sharding.partition import Partition
from .collectives import Comm
from .direct_runs import DirectRun, direct_runs
from .grad_buckets import BucketPipe, GradBucket


class RoundState(enum.Enum):
    """What the gradient shards hold between two steps."""

    EMPTY = "empty"  # nothing reduced since the last step (or zero_grad): the next reduction writes them
    OPEN = "open"  # a backward is reducing into them
    ADDING = "adding"  # a further backward of the same step is adding to them
    REDUCED = "reduced"  # this step's reductions (a round closed, or stage 1 reduced at step)


class Presence:
    """Which parameters hold a gradient: a flag per parameter of every partition, by position (the hot
    paths mark ``flags[partition][index]``; no tensor is hashed)."""

    __slots__ = ("flags",)

    def __init__(self, sizes: list[int]) -> None:
        self.flags = [[False] * n for n in sizes]

    def clear(self) -> None:
        for f in self.flags:
            f[:] = [False] * len(f)

    def copy(self) -> "Presence":
        other = Presence([])
        other.flags = [list(f) for f in self.flags]
        return other

    def update(self, other: "Presence") -> None:
        for mine, theirs in zip(self.flags, other.flags):
            mine[:] = [a or b for a, b in zip(mine, theirs)]

    def flat(self) -> list[bool]:
        """Every flag, partition after partition (the stats all-reduce's order)."""
        return [v for f in self.flags for v in f]


class GradEntry(NamedTuple):
    """What a trainable parameter's gradient hook needs, found once when the hooks are made."""

    part: Partition
    pi: int  # the partition's position
    index: int  # the parameter's position in it
    buckets: tuple  # the GradBuckets holding its elements, in the launch order (empty: zero elements)
    shape: tuple  # the parameter's shape at the build: a .grad of another shape, dtype, layout or device
    dtype: torch.dtype  # (the partition's) goes to _check_grad for its refusal (grad_ok)
    device: torch.device


class GradSync:
    """What both reducers share: the buckets in their one order, ``present``, the pipe, the verbs around a step."""

    #: the refusal ``prepare_step`` keeps for the rest of its round, or None (stage 1: what it refused in the
    #: round's .grad, it reduced the rest; the step after a clip_grad_norm_ gets it again rather than reducing a
    #: second time, as its peers reduced once)
    refused: RuntimeError | None = None
    #: whether ``.grad`` is freed once packed (the shards stand in for it)
    frees_grads = False
    #: stage 1: the shards were reduced from ``.grad`` still scaled by a GradScaler (a ``clip_grad_norm_`` before
    #: ``scaler.unscale_()``, which then divides ``.grad`` and not them), until ``.grad`` is reduced again
    reduced_scaled = False

    def __init__(self, partitions: list[Partition], positions: list[list[int]], comm: Comm, overlap: bool) -> None:
        self.names: dict = {}  # parameter -> its name, for messages (the optimizer sets it)
        # stages 2-3: called with the parameters holding a .grad no hook saw, before they are refused as set by
        # hand (the optimizer's: those whose tensor was swapped, their hooks lost, are taken in or refused)
        self.on_unseen = None
        self.partitions = partitions
        self.comm = comm
        self.overlap = overlap
        self.sync = True
        self.pipe = BucketPipe(partitions, comm)
        self._reduced_since_step = False  # stages 2-3: a round opened since the last step (its reductions made)
        #: stages 2-3: no gradient reduced (or all forgotten by zero_grad) when this step began: in the step's
        #: checksum, so that a rank without the backward its peers ran makes them all skip the step and raise
        self.empty_at_step = False
        keys = [(pi, k) for pi, part in enumerate(partitions) for k in range(len(part.layout.buckets))]
        last = {key: max(positions[key[0]][j] for j in partitions[key[0]].bucket_params[key[1]])
                for key in keys}
        self.buckets = [GradBucket(self.pipe, partitions[pi], k, pi)
                        for pi, k in sorted(keys, key=lambda key: (-last[key], key))]
        self.buckets_of: dict[torch.nn.Parameter, list[GradBucket]] = {}
        for bucket in self.buckets:
            self.pipe.count(bucket)
            for p in bucket.params:
                self.buckets_of.setdefault(p, []).append(bucket)
        for k, bucket in enumerate(self.buckets):
            bucket.order = k
        for p, buckets in self.buckets_of.items():
            buckets[-1].frees.append(p)  # its .grad can go once its last bucket in the order is packed
            for bucket in buckets[:-1]:
                bucket.partial.append(p)
        self.entries = {p: GradEntry(part, pi, j, tuple(self.buckets_of.get(p, ())), tuple(part.shapes[j]), part.dtype,
                                     part.device)
                        for pi, part in enumerate(partitions) for j, p in enumerate(part.params)}
        # zero-element parameters: in no bucket; they only count as having a gradient (torch steps them)
        self._empty = [e for e in self.entries.values() if not e.buckets]
        self.present = Presence([len(part.params) for part in partitions])  # whose gradient is not None
        # present at the last step, less what a zero_grad(set_to_none=True) cleared since: where torch's .grad
        # still exists (stale here: each step consumes the gradients), for zero_grad(set_to_none=False) to zero
        self._last_present = self.present.copy()
        self._zeroed_since_step = True  # a zero_grad() (the optimizer's or a module's) since the last step
        self.state = RoundState.EMPTY
        self._accumulated = False  # a backward ran under no_sync() since the last step
        self._runs: dict[int, DirectRun] | None = None  # one rank: buckets packed together (direct_runs.py)

    #: whether a direct run's gradients are bounded by the pool's bytes (they wait in .grad for its last bucket)
    bounded_runs = True

    def direct_runs(self) -> dict[int, DirectRun]:
        """One rank: the runs of buckets packed by one launch, by the launch-order position of their first (found
        at the first pack: the pipe's codec and replicas are set after the build)."""
        if self._runs is None:
            self._runs = direct_runs(self.buckets, self.pipe, self.bounded_runs)
        return self._runs

    # -- backward ---------------------------------------------------------
    def hooked(self, params) -> list[torch.nn.Parameter]:
        """The parameters whose gradient hook the optimizer registers (every trainable one by default)."""
        return [p for p in params if p.requires_grad]

    def on_grad(self, p: torch.nn.Parameter, entry: GradEntry) -> None:
        """``p``'s gradient was accumulated (the optimizer's hook; ``entry`` is ``self.entries[p]``). Under
        ``no_sync()`` (``sync`` False) it sets ``_accumulated``: that backward's .grad waits for a synced one."""
        raise NotImplementedError

    def close_round(self) -> None:
        """The end of a backward (the optimizer's callback)."""

    # -- step -------------------------------------------------------------
    def prepare_step(self) -> Exception | None:
        """Every reduction of this step started and finished. Returns the error this rank found in its gradients
        before any of them (a ``.grad`` the step cannot take), which only this rank may have found: its reductions
        still ran, without that gradient, so no rank waits in a collective this one left (the optimizer skips the
        step and raises it: ``ShardedOptimizer._refusal``)."""
        raise NotImplementedError

    def grads_edited(self) -> bool:
        """Whether user code wrote a kept ``.grad`` in place after backward produced it."""
        return False

    def wait(self) -> None:
        """Wait for every started reduction and apply accumulation (host tier: every shard is down)."""
        self.pipe.wait()

    def end_step(self) -> None:
        """After step(): the shards are consumed; the next reduction writes them."""
        self.wait()
        self.refused = None
        self.state = RoundState.OPEN if self.state in (RoundState.OPEN, RoundState.ADDING) else RoundState.EMPTY
        self._reduced_since_step = self.state is RoundState.OPEN  # (a round open: the next step's)
        self.empty_at_step = False
        self._accumulated = False
        self._last_present = self.present.copy()
        self.present.clear()
        self._zeroed_since_step = False

    def zero_grad(self, set_to_none: bool) -> None:
        """The shards' share of ``optimizer.zero_grad``."""
        self.wait()
        self._zeroed_since_step = True
        self._forget()
        if set_to_none:
            self.present.clear()
            self._last_present.clear()  # torch's .grad are None now: a later zero_grad(set_to_none=False) finds none
        else:
            for part in self.partitions:
                part.grad_shard.zero_()
            if self.frees_grads:  # torch would still hold (now zeroed) .grad tensors for these
                self.present.update(self._last_present)

    def consumed_unzeroed(self) -> bool:
        """Stages 2-3: the last step consumed gradients and no zero_grad() ran since, where torch's .grad would still
        hold them (the optimizer warns once: each step consumes its gradients here). Scans the flags only then."""
        return self.frees_grads and not self._zeroed_since_step and any(any(f) for f in self._last_present.flags)

    def holds_reduced_grads(self) -> bool:
        """Whether the shards hold gradients a backward reduced since the last step or zero_grad (stages 2-3; stage
        1 keeps them on ``.grad``)."""
        return self.frees_grads and self.state is not RoundState.EMPTY

    def zeroed_grads(self) -> list[torch.nn.Parameter]:
        """The parameters whose ``.grad`` torch would hold as zeros (``zero_grad(set_to_none=False)``; stages 2-3),
        for a reducer that replaces this one (``keep_zeroed_grads``): the next step gives them a zero-gradient
        step, as torch's."""
        if not self.frees_grads:
            return []
        return [part.params[i] for part, flags in zip(self.partitions, self.present.flags)
                for i, flag in enumerate(flags) if flag]

    def keep_zeroed_grads(self, params: list[torch.nn.Parameter]) -> None:
        """``zeroed_grads`` of the reducer this one replaces (add_param_group's rebuild; a new optimizer over the
        parameters of one it closes): they hold zeros here too. Stage 1 keeps ``.grad``: it gets torch's zeros."""
        if not params:
            return
        if not self.frees_grads:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            return
        where = {id(p): (k, i) for k, part in enumerate(self.partitions) for i, p in enumerate(part.params)}
        for p in params:
            if id(p) in where:
                k, i = where[id(p)]
                self.present.flags[k][i] = True
                self._last_present.flags[k][i] = True

    def _forget(self) -> None:
        """zero_grad: what the shards hold is no longer a gradient to add to."""

    def forget_some(self, params, set_to_none: bool) -> None:
        """``model.zero_grad()`` over some of the parameters (``module_zero_grad.py``): stage 1 keeps ``.grad``,
        which torch's cleared already."""

    def apply_clip(self, coef: torch.Tensor, during_backward: bool) -> None:
        """A clip factor (0-d, on the device) applied to the gradients so far, as torch's clip_grad_norm_
        scales ``.grad`` in place: here the reduced shards (stages 2-3: a backward's round adds to them)."""
        self.wait()
        for part in self.partitions:
            part.grad_shard.mul_(coef.to(part.grad_shard.device))

    def _unfit_grad(self, p: torch.nn.Parameter, entry: GradEntry) -> torch.Tensor | None:
        """``p.grad`` cannot be packed (``_check_grad`` says why: ``p`` converted or moved since the build, a sparse
        gradient). Alone: raise now. Among ranks this may be the only rank that found it: its reductions go on
        without that gradient (``.grad`` dropped, as a parameter that got none) and ``prepare_step`` returns the
        refusal, so the step is skipped and raised on this rank and no peer waits in a reduction it left."""
        try:
            _check_grad(p, entry, self.names)
        except RuntimeError as error:
            p.grad = None  # (alone too: left, the end of this backward would pack it)
            if self.pipe.divisor == 1:  # (every rank that trains divides: one is alone)
                raise
            self.refused = self.refused or error
        return p.grad

    def reduce_unhooked(self, params) -> None:
        """``params`` were laid out while frozen (no hook) and now hold a gradient that no hook saw (stages 2-3
        reduce it here; stage 1 reduces every .grad at step() anyway)."""

    def scale_kept_grads(self, factor: torch.Tensor) -> None:
        """A step's update applied ``factor`` (a clip's, a GradScaler's inverse scale) to the reduced gradients: the
        ``.grad`` this stage keeps past step() (stage 1) gets it too, as torch's clip_grad_norm_ and fused AdamW
        scale ``.grad`` in place (stages 2-3 keep none)."""

    def clamp_kept_grads(self, bounds: tuple) -> None:
        """A step clamped the gradient shards (``clip_grad_value_``) to ``bounds`` (in their units): the kept ``.grad``
        (stage 1, reduced at step() into those shards: the same units) are clamped too."""

    def clear_if_empty(self) -> None:
        """Nothing reduced since the last step or zero_grad(): the shards hold the last step's values, which a
        norm must not see (stages 2-3; stage 1 reduces ``.grad`` afresh)."""

    def no_sync(self):
        return setting(self, "sync", False)

    def unreduced_grads(self) -> list[torch.nn.Parameter]:
        """Params holding a ``.grad`` that no round has reduced (reducing in backward)."""
        return [p for p in self.buckets_of if p.grad is not None]

    def buffer_bytes(self) -> int:
        """Bytes of the pool buffers (on the parameters' device)."""
        return self.pipe.buffer_bytes()


class ReduceAtStep(GradSync):
    """Stage 1: ``.grad`` is kept through backward, and every bucket is reduced from it at step()."""

    bounded_runs = False  # .grad is kept until the step: one rank packs each partition in one launch

    def __init__(self, partitions, positions, comm, overlap) -> None:
        super().__init__(partitions, positions, comm, overlap)
        # .grad's version counter when backward left it, per partition and position (None: not seen)
        self._grad_versions = [[None] * len(part.params) for part in partitions]
        self._carry: list[torch.Tensor] | None = None  # per partition: a clip's share, added after the reduction

    def hooked(self, params) -> list[torch.nn.Parameter]:
        """One hook per bucket: nothing is reduced in backward, a hook only has to see that a backward runs
        (the optimizer's end-of-backward callback, close_round, then records every .grad at once), not 800
        Python calls for 800 parameters. (If no hooked parameter gets a gradient, the versions stay unknown
        and grads_edited() cannot warn; the step is the same.)"""
        chosen = {}
        for bucket in self.buckets:
            p = next((q for q in bucket.params if q.requires_grad), None)
            if p is not None:
                chosen.setdefault(id(p), p)
        return list(chosen.values())

    def on_grad(self, p: torch.nn.Parameter, entry: GradEntry) -> None:
        if not self.sync:  # .grad is kept; checked where it is packed, at step (prepare_step)
            self._accumulated = True

    def close_round(self) -> None:
        """The end of a backward: remember each kept .grad's version counter (see grads_edited). A reduction
        made since the last step (clip_grad_norm_, or a step that failed) no longer holds what .grad does."""
        for part, versions in zip(self.partitions, self._grad_versions):
            versions[:] = [None if p.grad is None else p.grad._version for p in part.params]
        self._forget()

    def _forget(self) -> None:
        """.grad changed or was zeroed: the shards are reduced from it again at the next step."""
        self.refused = None
        self.reduced_scaled = False
        if self.state is RoundState.REDUCED:
            self.state = RoundState.EMPTY

    def apply_clip(self, coef: torch.Tensor, during_backward: bool) -> None:
        """Stage 1 keeps ``.grad`` and reduces it again at step() after a further backward. Between backwards the
        shards and ``.grad`` are both scaled (as torch scales ``.grad``). When a backward begins, some ``.grad``
        already hold its gradients (this hook runs after accumulation), so ``.grad`` stays as it is and the
        shards keep ``(coef - 1)`` times what they hold now: added after the next reduction, it turns
        ``avg(g1 + g2)`` into ``coef * avg(g1) + avg(g2)``."""
        self.wait()
        if during_backward:
            if self.state is RoundState.REDUCED:  # (else nothing reduced to clip: the clip saw no gradient)
                carry = [part.grad_shard * (coef.to(part.grad_shard.device) - 1) for part in self.partitions]
                self._carry = carry if self._carry is None else [a + b for a, b in zip(self._carry, carry)]
            return
        super().apply_clip(coef, during_backward)
        for part, versions in zip(self.partitions, self._grad_versions):
            for j, p in enumerate(part.params):
                if p.grad is not None:
                    p.grad.mul_(coef.to(p.grad.device))
                    if versions[j] is not None:
                        versions[j] = p.grad._version  # the optimizer's own edit: not the user's (grads_edited)

    def scale_kept_grads(self, factor: torch.Tensor) -> None:
        """One pass over the kept ``.grad`` (the update applied ``factor`` to their reduction, not to them): a next
        backward without zero_grad() adds to clipped, unscaled gradients, and a read after step() sees them, as
        torch's."""
        grads: dict = {}
        for p in self.entries:
            if p.grad is not None:
                grads.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        for (device, _), gs in grads.items():
            torch._foreach_mul_(gs, factor.to(device))

    def clamp_kept_grads(self, bounds: tuple) -> None:
        clamp_([p.grad for p in self.entries], bounds)

    def prepare_step(self) -> Exception | None:
        if self.refused is not None:
            return self.refused
        if self.state is not RoundState.REDUCED:
            refused, kept = self._check_kept()
            self.present.clear()
            runs = self.direct_runs() if kept is None else {}
            k = 0
            while k < len(self.buckets):
                run = runs.get(k)
                if run is not None:  # one rank: the partition's buckets in one launch
                    run.start(self.present, accumulate=False, free_grads=False)
                    k += len(run.buckets)
                    continue
                self.buckets[k].start(self.present, accumulate=False, free_grads=False, block=True, late=kept)
                k += 1
            for e in self._empty:
                if e.part.params[e.index].grad is not None:
                    self.present.flags[e.pi][e.index] = True
            if refused is not None:  # reduced without the refused gradients; .grad is reduced again at the next step
                self.wait()
                self.refused = refused
                return refused
            self.state = RoundState.REDUCED
            if self._carry is not None:  # a clip before the last backward (apply_clip)
                self.wait()
                for part, c in zip(self.partitions, self._carry):
                    part.grad_shard.add_(c)
                self._carry = None
        self.wait()
        return None

    def _check_kept(self) -> tuple[RuntimeError | None, dict | None]:
        """The kept ``.grad`` is packed flat: each must be like its parameter. ``(None, None)`` when all are, else
        the first refusal (``_check_grad``'s words) and the gradients to pack instead (by parameter id: the
        others, the refused ones packed as zeros)."""
        refused = None
        bad = set()
        for p, entry in self.entries.items():
            g = p.grad
            if g is not None and entry.buckets and not grad_ok(g, entry):
                try:
                    _check_grad(p, entry, self.names)
                except RuntimeError as error:
                    refused = refused or error
                    bad.add(id(p))
        if refused is None:
            return None, None
        return refused, {id(p): p.grad for p in self.entries if p.grad is not None and id(p) not in bad}

    def grads_edited(self) -> bool:
        """Whether user code wrote a kept ``.grad`` in place after backward produced it.

        The local, not yet averaged gradient: a norm clipped from it (torch.nn.utils.clip_grad_norm_)
        is each rank's own, not the global one.
        """
        for part, versions in zip(self.partitions, self._grad_versions):
            for p, v in zip(part.params, versions):
                if v is not None and p.grad is not None and p.grad._version != v:
                    return True
        return False

    def end_step(self) -> None:
        super().end_step()
        self.state = RoundState.EMPTY
        self._start_afresh()

    def zero_grad(self, set_to_none: bool) -> None:
        super().zero_grad(set_to_none)
        self._start_afresh()  # the optimizer's zero_grad zeroes .grad: not an edit (grads_edited)

    def _start_afresh(self) -> None:
        """No clip share to add, no refusal, and no .grad version to compare (grads_edited) until the next
        backward."""
        self._carry = None
        self.refused = None
        self.reduced_scaled = False
        for versions in self._grad_versions:
            versions[:] = [None] * len(versions)


class ReduceInBackward(GradSync):
    """Stages 2 and 3: each bucket is reduced during backward as soon as its gradients are in; ``.grad`` freed."""

    frees_grads = True
    reduces_empty_round = True  # a step with no reduction since the last one reduces zeros (prepare_step)

    def __init__(self, partitions, positions, comm, overlap) -> None:
        super().__init__(partitions, positions, comm, overlap)
        self._seen = Presence([len(part.params) for part in partitions])  # got a gradient this round
        # late gradients (by parameter id): a parameter's gradient accumulated again after its buckets were counted
        # complete this round (reentrant activation checkpointing that runs its module in two checkpointed
        # segments: each segment's backward accumulates into .grad); reduced again at the end of the round
        self._late: dict[int, torch.Tensor] = {}
        self._late_buckets: dict[int, GradBucket] = {}
        # late gradients whose .grad is taken at the next hook (or the end of backward), not in their own: the user's
        # hooks registered after the optimizer's run between, and see (and may edit) it, as for any gradient
        self._late_pending: list[tuple[torch.nn.Parameter, GradEntry]] = []
        # per bucket (launch order), its trainable parameters: what each round counts down (GradBucket.remaining)
        # (one that requires no gradient now, frozen after it was laid out, has no hook to count it: its bucket waits
        # for the end of backward, which packs whatever .grad it holds then, one unfrozen since included)
        self._trainable = [len(bucket.params) for bucket in self.buckets]
        self._next = 0

    def on_grad(self, p: torch.nn.Parameter, entry: GradEntry) -> None:
        # every parameter's hook: the checks a .grad passes before it is packed (by a later hook), then one count
        # down per bucket; a bucket starts at the first hook after its count reached 0 (and those before it
        # started), or at the end of backward. Not in the hook that completed it: hooks the user registered on
        # that parameter after this one run next, and must see (and may edit) its .grad, which the pack frees.
        g = p.grad
        if g is not None and not grad_ok(g, entry):
            g = self._unfit_grad(p, entry)
        if not self.sync:
            self._accumulated = True
            return
        if self._late_pending:  # taken out of .grad before anything is packed (p's own stays: its .grad holds
            self._take_late(keep=p)  # the pending gradient and this one, for the user's hooks to see)
        seen = self._seen.flags[entry.pi]
        if self.state is not RoundState.OPEN and self.state is not RoundState.ADDING:
            self._open_round()
        else:
            again = seen[entry.index]
            if again and g is not None and any(b.remaining <= 0 for b in entry.buckets):
                if not any(q is p for q, _ in self._late_pending):
                    self._late_pending.append((p, entry))  # its .grad is taken at the next hook, before any pack
            if not self._late_pending and self.overlap and self._next < len(self.buckets) and \
                    self.buckets[self._next].remaining <= 0:
                self._start_ready(flush=False)  # (also retried here after a start found no free pool buffer)
            if again:
                return
        seen[entry.index] = True
        if not entry.buckets:  # zero elements: in no bucket, nothing to reduce; it still got a gradient
            self.present.flags[entry.pi][entry.index] = True
            p.grad = None
            return
        for bucket in entry.buckets:
            bucket.remaining -= 1

    def reduce_unhooked(self, params) -> None:
        """Their gradients, reduced now as late ones of this round: after its own reductions, or from zero shards
        where no hooked gradient came (a backward through them alone). Every rank alike (requires_grad is)."""
        late = {id(p): p.grad for p in params if p.grad is not None}
        if not late or self._accumulated or self.state not in (RoundState.EMPTY, RoundState.REDUCED):
            return  # (under no_sync, their .grad waits for the synced backward, as every .grad there)
        self.wait()
        self.clear_if_empty()  # (no hooked gradient this round: the shards hold the last step's values)
        buckets = {b.order: b for p in params if id(p) in late for b in self.buckets_of.get(p, ())}
        for p in params:
            if id(p) in late:
                p.grad = None
        for k in sorted(buckets):
            buckets[k].start(self.present, accumulate=True, free_grads=False, block=True, late=late)
        self.state = RoundState.REDUCED
        self._reduced_since_step = True

    def _take_zero_grads(self, params) -> None:
        """``.grad = zeros`` set by hand on parameters with no backward since the last step (what torch's
        ``distributed.checkpoint.state_dict`` does to a fresh optimizer, with lr 0, to create its state): a step
        with zero gradients for them, as torch's, nothing to reduce."""
        self.wait()
        self.clear_if_empty()
        for p in params:
            e = self.entries[p]
            self.present.flags[e.pi][e.index] = True
            p.grad = None
        self.state = RoundState.REDUCED

    def _take_late(self, keep: torch.nn.Parameter | None = None) -> None:
        pending = self._late_pending
        self._late_pending = [(p, entry) for p, entry in pending if p is keep]
        for p, entry in pending:
            if p is not keep and p.grad is not None:  # (a user hook may have set it to None: nothing late then)
                self._late_grad(p, p.grad, entry)

    def _late_grad(self, p: torch.nn.Parameter, g: torch.Tensor, entry: GradEntry) -> None:
        """``p``'s gradient was accumulated again after a bucket holding it was counted complete: the bucket may
        have been packed already (that decision is the same on every rank that runs the same model; whether it
        was packed yet depends on timing). What ``.grad`` holds now, and everything that comes after, is reduced
        by a second reduction of each of ``p``'s buckets at the end of the round (every other parameter counting
        as zeros there); a bucket not packed yet packs no ``.grad`` of ``p``, which is gone."""
        p.grad = None
        key = id(p)
        prev = self._late.get(key)
        self._late[key] = g if prev is None else prev.add_(g)
        for bucket in entry.buckets:
            self._late_buckets[bucket.order] = bucket

    def _open_round(self) -> None:
        expect(self.state, RoundState.EMPTY, RoundState.REDUCED, what="the gradient shards, as a backward starts,")
        self._reduced_since_step = True
        self.state = RoundState.ADDING if self.state is RoundState.REDUCED else RoundState.OPEN
        self._next = 0
        self._seen.clear()
        for bucket, n in zip(self.buckets, self._trainable):
            bucket.remaining = n

    def close_round(self) -> None:
        """The end of a backward: start every bucket this round has left."""
        if self.state not in (RoundState.OPEN, RoundState.ADDING):
            return
        if self._late_pending:
            self._take_late()
        self._start_ready(flush=True)
        if self._late:  # in the launch order, after every bucket's first reduction (on every rank alike)
            late, buckets = self._late, self._late_buckets
            self._late, self._late_buckets = {}, {}
            for k in sorted(buckets):
                buckets[k].start(self.present, accumulate=True, free_grads=False, block=True, late=late)
        self.state = RoundState.REDUCED
        self._seen.clear()

    def _start_ready(self, flush: bool) -> None:
        runs = self.direct_runs()
        while self._next < len(self.buckets):
            run = runs.get(self._next)
            if run is not None:  # one rank: started once its last bucket is complete
                if not flush and any(b.remaining > 0 for b in run.buckets):
                    return
                run.start(self.present, accumulate=self.state is RoundState.ADDING, free_grads=True)
                self._next += len(run.buckets)
                continue
            bucket = self.buckets[self._next]
            if not flush and bucket.remaining > 0:
                return
            if not bucket.start(self.present, accumulate=self.state is RoundState.ADDING, free_grads=True,
                                block=flush):
                return  # no free buffer: the next hook (or the end of backward) starts it
            self._next += 1
            self.pipe.finish_completed()

    def forget_some(self, params, set_to_none: bool) -> None:
        """``model.zero_grad()`` over some of the parameters: their share of the reduced gradients is zeros (this
        rank's pieces of them in the shards), and they hold a gradient only where torch's zeroed ``.grad`` would
        (``set_to_none=False``, a gradient since the last step)."""
        self.wait()
        self._zeroed_since_step = True
        for p in params:
            e = self.entries[p]
            self._late.pop(id(p), None)
            for pc in e.part.pieces_of(e.index):
                e.part.grad_shard[pc.shard_offset: pc.shard_offset + pc.numel].zero_()
            self.present.flags[e.pi][e.index] = not set_to_none and (
                self.present.flags[e.pi][e.index] or self._last_present.flags[e.pi][e.index])
            if set_to_none:
                self._last_present.flags[e.pi][e.index] = False

    def _forget(self) -> None:
        if self.state is RoundState.ADDING:
            self.state = RoundState.OPEN
        elif self.state is RoundState.REDUCED:
            self.state = RoundState.EMPTY

    def clear_if_empty(self) -> None:
        if self.state is RoundState.EMPTY:
            for part in self.partitions:
                part.grad_shard.zero_()

    def prepare_step(self) -> Exception | None:
        self.empty_at_step = self.state is RoundState.EMPTY
        stale = self.unreduced_grads()
        if stale and self.on_unseen is not None:
            self.on_unseen(stale)
            stale = self.unreduced_grads()
        if stale and self._accumulated:
            raise RuntimeError(
                f"{len(stale)} parameters hold gradients that were never reduced (accumulated under "
                "no_sync() without a final backward outside it); run the last micro-batch's backward "
                "outside opt.no_sync()")
        if stale and self.state is RoundState.EMPTY and _all_zero([p.grad for p in stale]):
            self._take_zero_grads(stale)  # a step with zero gradients (torch.distributed.checkpoint's state init)
            stale = []
        if not self._reduced_since_step and self.reduces_empty_round and self.pipe.divisor > 1:
            # no backward reached this rank's gradients since the last step (it skipped its backward, or called
            # step() twice) while its peers' backwards may have reduced theirs: it makes the same reductions from
            # zeros (and any .grad set by hand), so that no rank meets another collective than its own, and the
            # step's all-reduce finds the ranks disagreeing (empty_at_step is in its checksum): the step is skipped
            # and raised on every rank. (A round of zeros on every rank where no rank had a backward.)
            self._open_round()
            self.close_round()
        self.wait()
        if self.refused is not None:  # an unfit .grad in backward (_unfit_grad): reduced without it
            return self.refused
        if stale:  # (among ranks this rank goes on through the step, skipped: its reductions are finished; kept
            # for the step() after a clip_grad_norm_, since the round of zeros above took those .grad)
            self.refused = HandSetGrads(
                f"{len(stale)} parameters hold a .grad that no backward produced through the optimizer "
                "(assigned by hand? or their tensors swapped twice by torch.utils.swap_tensors since zero_grad(), "
                "which hides the swap: they are hooked again for the next step): stages 2 and 3 reduce gradients "
                "during backward and free .grad; compute gradients with backward(), or use stage=1, which reduces "
                ".grad at step()")
            return self.refused
        return None


class ReduceAmongGathers(ReduceInBackward):
    """Stage 3: as stage 2, but a backward also gathers each unit again between its reductions: a rank with no
    backward cannot make up that sequence of collectives, so its step reduces nothing (a rank skipping the
    backward its peers run is not served there: README, "Not done yet")."""

    reduces_empty_round = False


class HandSetGrads(RuntimeError):
    """Stages 2-3: a ``.grad`` no backward produced (assigned by hand), found before any of the step's collectives
    (``prepare_step`` returns it)."""


def _all_zero(grads: list[torch.Tensor]) -> bool:
    """Whether every one of ``grads`` is all zeros (one host read; stage 3's zeros_like of a placeholder is empty)."""
    sums = [g.detach().abs().sum().float() for g in grads if g.numel()]
    return not sums or to_host(torch.stack([s.to(sums[0].device) for s in sums]).sum(), "hand-set zero grads") == 0


def grad_ok(g: torch.Tensor, entry: GradEntry) -> bool:
    """Whether ``g`` (a parameter's ``.grad``) is what its parameter had when built: the hot path's check,
    on attributes found once (a parameter converted or moved since then gets a .grad of its new dtype or
    device, so it fails here too and ``_check_grad`` says why)."""
    return (g.dtype is entry.dtype and g.layout is _STRIDED and g.shape == entry.shape
            and g.device == entry.device)


_STRIDED = torch.strided


def _check_grad(p: torch.nn.Parameter, entry: GradEntry, names: dict) -> None:
    """``p.grad`` is what the flat buffers can take: dense, of ``p``'s shape and dtype (torch's update would
    fail on a wrong shape; read flat here, it would be silently wrong: a ``.grad.data =`` assignment), and
    ``p`` is still of its partition's dtype and device (a model converted or moved since the build gets
    the partition's clear refusal, not a packing error). Packing checks nothing more (``ops.pack_checked_``)."""
    g, part = p.grad, entry.part
    if g is None:
        return
    if p.dtype != part.dtype or p.device != part.device:
        part.check_kind(p, p.shape, names)
    if tuple(p.shape) != entry.shape:  # resized in place (resize_token_embeddings)
        part._check_compatible(p, torch.Size(entry.shape), names)
    if g.layout != torch.strided:
        raise RuntimeError(
            f"ShardedOptimizer does not support sparse gradients ({_which(p, names)} got a {g.layout} gradient); "
            "use dense gradients, e.g. nn.Embedding(sparse=False)"
        )
    if g.dtype != p.dtype and getattr(p, "grad_dtype", p.dtype) == g.dtype:
        raise RuntimeError(
            f"{_which(p, names)} of dtype {p.dtype} was given grad_dtype {g.dtype} after the "
            "optimizer was built: ShardedOptimizer takes gradients of the parameter's own dtype (it keeps the fp32 "
            "master itself); leave grad_dtype unset")
    if g.shape != p.shape or g.dtype != p.dtype:
        raise RuntimeError(
            f"{_which(p, names)} of dtype {p.dtype} holds a .grad of shape {tuple(g.shape)} "
            f"and dtype {g.dtype}: a gradient must match its parameter (assign .grad a tensor like the parameter, "
            "not through .grad.data)")


def _which(p: torch.nn.Parameter, names: dict) -> str:
    """A parameter as a refusal names it: its name where the optimizer knows it, else its shape."""
    return f"{names[p]!r} (shape {tuple(p.shape)})" if p in names else f"a parameter of shape {tuple(p.shape)}"
