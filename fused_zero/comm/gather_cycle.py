"""Stage 3: how one unit is gathered and released, and how the gatherer walks its schedule (no hooks here).

A unit is ``RELEASED`` (0 bytes, its parameters on placeholders), ``GATHERING`` (its all-gathers in flight
into the materialized buffers) or ``GATHERED`` (its parameters view the full buffers). ``_issue`` starts a
unit's gathers (from the primary shards through ParamSync, or during backward with hpZ from the node-local
copies), ``_wait`` lands them, ``_release`` gives the storage back (keeping hpZ's copy in a training
forward); the running totals of gathered bytes and units are kept here. The schedule: ``_require`` issues
the schedule up to a unit and waits for it, ``_prefetch`` issues ahead while fewer than ``max_live_units``
are gathered, ``_drain`` issues and waits for what the schedule has left. When each of these runs is
comm/gatherer.py's (its module and autograd hooks).
"""
from __future__ import annotations

import enum
import warnings

from torch import nn

from .works import Handle
from ..lifecycle import expect
from ..profiling import ALL_GATHER, label
from ..sharding.partition import Partition
from ..user_frames import user_stacklevel


class TrainingState(enum.Enum):
    """Where the model is in its cycle, as the gatherer sees it."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class UnitState(enum.Enum):
    """Where a unit's full buffers are in the gather cycle."""

    RELEASED = "released"  # 0 bytes; the parameters point at empty placeholders
    GATHERING = "gathering"  # all-gathers in flight into the materialized buffers (``handles``)
    GATHERED = "gathered"  # the parameters view the full buffers


class _Unit:
    """One unit's partitions and where it is in the gather cycle."""

    def __init__(self, index: int, modules: tuple[nn.Module, ...], parts: list[Partition]) -> None:
        self.index = index
        self.modules = modules  # one, or several consecutive ones merged (sharding/units.py)
        self.last = modules[-1]  # a forward releases the unit after this one's: model order, then as recorded
        self.ran_last: int | None = None  # the recording forward: which of ``modules`` ran last
        self.parts = parts
        self.trainable = {p for part in parts for p in part.params if p.requires_grad}
        # frozen weights are read by backward but get no gradient: such a unit is released once the gradient of
        # its inputs is in as well (nothing of its backward is left then); without grad-requiring inputs, at the end
        self.frozen = any(part.frozen for part in parts)
        self.inputs_done = False
        self.pre_backward = None  # the gatherer's pre-backward hook for this unit (made once)
        self.nbytes = sum(part.flat.numel() * part.flat.element_size() for part in parts)
        self.state = UnitState.RELEASED
        self.handles: list[Handle] | None = None  # the all-gathers in flight while GATHERING
        self.releasing = False  # a release began and has not ended (cut short by a KeyboardInterrupt: _mend ends it)
        self.grads_seen: set[int] = set()  # ids of the trainable parameters whose gradient is in
        self.backward_started = False
        self.entered = -1  # the forward (ParamGatherer._forwards) this unit's first module last ran in
        self.running = 0  # the first training forward: how many of its modules are inside their forward now

    @property
    def gathered(self) -> bool:
        return self.state is UnitState.GATHERED

    @property
    def released(self) -> bool:
        return self.state is UnitState.RELEASED


class GatherCycle:
    """``ParamGatherer``'s gathers and releases of its units and its walk of the schedule (a mixin: it reads the
    gatherer's units, sync, secondary copies, placeholders, update behind and where the model is in its cycle)."""

    def _issue(self, u: _Unit) -> None:
        if u.releasing:
            self._mend(u)
        if u.state is not UnitState.RELEASED:
            return
        if self.behind is not None:
            self.behind.wait(u.index)  # its shards are the new ones (raises if some rank's update failed)
        handles, copies = [], self._copies(u)
        for part in u.parts if copies is None else ():  # an offloaded param shard: start every read first
            self._fetch(part)
        for k, part in enumerate(u.parts):
            self._adopt_assigned(part)  # p.data = t since the last gather
            part.materialize()
            if copies is None and part.reads_params:
                self._read_shard(part)
            handles += self.sync.gather(part) if copies is None else self.secondary.gather(part, copies[k])
        u.handles, u.state = handles, UnitState.GATHERING
        self.live_bytes += u.nbytes
        self._live_units += u.index > 0
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _adopt_assigned(self, part: Partition) -> None:
        """Take in what user code assigned to ``part``'s released parameters. What cannot be taken in (another shape
        or dtype, a write in place) raises alone; among ranks, where it may be this rank's alone, the parameters go
        back to their placeholders (the gather serves the shards' values) and the step raises it after its
        collectives, so no rank waits in a gather this one left."""
        if self._kept_refusal(lambda: part.adopt_assigned(self.names, self._placeholder)):
            part.put_back(self._placeholder(part.flat))

    def _fetch(self, part: Partition) -> None:
        """Start reading an offloaded param shard ahead of its gather. A failure to (re)write a lost shard raises
        alone; among ranks it is found again when the gather reads the shard (``_read_shard``)."""
        try:
            part.fetch_params()
        except OSError:
            if self.alone:
                raise

    def _read_shard(self, part: Partition) -> None:
        """Wait for the read of ``part``'s offloaded param shard before its gather. A failed read (an I/O error on
        ``offload_params="nvme"``) raises alone, naming the file; among ranks, where it is this rank's alone, the
        gather serves the fp32 master's values instead (NaN where those cannot be read either), so that no rank
        waits in a gather this one left, and the step raises the error after its collectives, changing nothing on
        any rank (the other ranks raise at their next step)."""
        if self._kept_refusal(part.stage_params, (OSError,)):
            part.stage_substitute()

    def _kept_refusal(self, check, errors: tuple = (RuntimeError,)) -> bool:
        """Run ``check``; what it raises (``errors``) raises alone, and among ranks, where it may be this rank's
        alone, is kept for the step to raise after its collectives (``refused``, ``Stage3.before_update``): True."""
        try:
            check()
        except errors as error:
            if self.alone:
                raise
            if self.refused is None:
                # said now too: this forward goes on, where the user's own code may fail first (inputs converted
                # with the model meet the dtype the optimizer holds: torch's dtype error); pointed at the user's line
                phase = {TrainingState.FORWARD: "forward", TrainingState.BACKWARD: "backward"}.get(self.state, "gather")
                warnings.warn(f"{error} (refused: a step raises it once every rank has been through its "
                              f"collectives; this {phase} goes on meanwhile)", RuntimeWarning,
                              stacklevel=user_stacklevel())
                error.add_note(f"fused_zero: found by a stage-3 {phase} since the last step (its gathers served the "
                               "optimizer's values); this step changes nothing on any rank whatever the model holds "
                               "now, and the next one trains again")
            self.refused = self.refused or error
            return True
        return False

    def _issue_exact(self, u: _Unit) -> None:
        """``_issue``, the parameters as the shards hold them whatever ``param_comm`` says (a unit gathered
        quantized, such as an eval forward's root, is gathered again)."""
        with self.sync.exact():
            if self.sync.codec is not None:
                self._release(u)
            self._issue(u)

    def _wait(self, u: _Unit) -> None:
        if u.state is not UnitState.GATHERING:
            return
        with label(ALL_GATHER):
            for h in u.handles or ():  # (None: a wait cut short after its handles, by a KeyboardInterrupt: again)
                h.wait()
        u.handles = None
        if self.secondary is not None and self.state is TrainingState.BACKWARD:
            self.secondary.drop(u.index)  # hpZ: the node-local copy served its one backward gather
        for part in u.parts:
            part.drop_fetched()  # an offloaded param shard's staged copy
            part.point_params()
            part.mark_synced()
        u.state = UnitState.GATHERED

    def _release(self, u: _Unit, force: bool = False) -> None:
        self._wait(u)  # never free a buffer a collective still writes into
        if u.releasing:
            self._mend(u)
        if self._holding or (u.state is UnitState.RELEASED and not force):
            return  # (released: its parameters are placeholders, or what user code assigned since, taken in later)
        expect(u.state, UnitState.GATHERED, UnitState.RELEASED, what=f"stage-3 unit {u.index}")
        if u.state is UnitState.GATHERED:
            for part in u.parts:  # written in place while gathered (Embedding(max_norm=...)): into the masters
                part.take_in_written(self.names)
        if self.secondary is not None and self.state is TrainingState.FORWARD and self._grad_forward \
                and u.state is UnitState.GATHERED:
            self.secondary.keep(u.index, u.parts)  # hpZ: this rank's slice within its node, for the backward
        u.releasing = True
        self._free(u)
        u.releasing = False

    def _free(self, u: _Unit) -> None:
        for part in u.parts:
            placeholder = self._placeholder(part.params[0]) if part.params else None
            part.release(lambda p: placeholder)  # a partition's parameters share dtype and device
        self._mark_released(u)

    def _mend(self, u: _Unit) -> None:
        """End a release that a KeyboardInterrupt cut short (a loop caught it and goes on): its parameters may point
        at the buffer or at placeholders, the buffer be freed or not; released whole now, as the release would have."""
        self._free(u)
        u.releasing = False

    def _drop_writes(self, u: _Unit) -> None:
        """The release that follows does not take in what was written to ``u``'s gathered parameters (leaving
        ``full_parameters()``, whose writeback decides; after a step, whose shards are newer)."""
        if u.state is UnitState.GATHERED:
            for part in u.parts:
                part.mark_synced()

    def _copies(self, u: _Unit) -> list | None:
        """hpZ: the node-local copy backward gathers ``u`` from (None: gather from the primary shards)."""
        if self.secondary is None or self.state is not TrainingState.BACKWARD:
            return None
        return self.secondary.copies(u.index)

    def _mark_released(self, u: _Unit) -> None:
        if u.state is not UnitState.RELEASED:
            self.live_bytes -= u.nbytes
            self._live_units -= u.index > 0
        u.state = UnitState.RELEASED

    # -- schedule ---------------------------------------------------------
    def _start(self, state: TrainingState, order: list[int]) -> None:
        self.state, self._order, self._cursor = state, order, 0
        self._place = {index: k for k, index in enumerate(order)}
        self._forwards += state is TrainingState.FORWARD

    def _require(self, u: _Unit) -> None:
        """Issue the schedule up to and past ``u`` (or ``u`` alone if it is not ahead), then wait for it.

        The cursor moves past ``u`` even when ``u`` is already gathered (the schedule's last unit, kept from the
        forward into backward): a rank whose data skipped that unit never requires it and passes it while
        issuing the next one, so every rank must pass it there, or one rank would gather it again later and
        its gathers would pair with another rank's gathers of other units."""
        place = self._place.get(u.index, -1)
        if place >= self._cursor:
            while self._cursor <= place:
                self._issue(self.units[self._order[self._cursor]])
                self._cursor += 1
        else:
            self._issue(u)
        self._wait(u)
        expect(u.state, UnitState.GATHERED, what=f"stage-3 unit {u.index} about to run")

    def _prefetch(self) -> None:
        behind = self.behind
        while self._cursor < len(self._order) and self._live_units < self.max_live_units:
            if behind is not None and not behind.ready(self._order[self._cursor]):
                return  # its update is still running behind the step: gathered when needed, not waited for here
            self._issue(self.units[self._order[self._cursor]])
            self._cursor += 1
        ahead = self.units[self._order[self._cursor]] if self._cursor < len(self._order) else None
        if ahead is not None and (behind is None or behind.ready(ahead.index)) and self._copies(ahead) is None:
            for part in ahead.parts:  # offloaded param shards: read ahead
                self._fetch(part)

    def _drain(self) -> None:
        """Issue what the schedule has left (units this rank skipped) and wait for it."""
        rest = [self.units[i] for i in self._order[self._cursor:]]
        self._cursor = len(self._order)
        for u in rest:
            self._issue(u)
        for u in rest:
            self._wait(u)
