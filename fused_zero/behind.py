"""UpdateBehind: stage 3's host update (offloaded optimizer states) overlapped with the next forward.

Once ``step()`` has the step's verdicts (the global norm for clipping, a GradScaler's overflow, the
ranks' agreement) and has planned the update on its own thread (``update.plan_update``: step counts,
new states, the param groups' hyperparameters as they are now), nothing is left to decide: the host
update of each unit's partitions can run while the next forward already goes on. ``start`` hands
the jobs, keyed by unit in the order the next forward gathers them, to one worker thread and
returns; the gatherer waits for a unit's key before it reads the unit's shards (``wait(key)``), and
its prefetch goes no further than the first unit not ready (``ready(key)``), so no unit is gathered
before its own update ended and the forward starts as soon as the root's did.

Everything else that reads or writes the shards between steps waits for the whole update first
(``wait()``): the next ``step()``, ``clip_grad_norm_``, the start of backward (its reductions land
in the gradient shards the update reads), ``zero_grad(set_to_none=False)``, ``state_dict()``,
``optimizer.state``, checkpoints, ``full_parameters()``, ``model.load_state_dict``, ``close()``.
Stage 3's parameters are placeholders between steps, so no read of a parameter escapes these
waits; at stages 1-2 (below) the parameters waiting for their bucket are placeholders too, until
their module's next forward or one of these waits.

Failures (a full disk, an I/O error): with more than one rank, the ranks agree after each unit
whether every rank's update of it succeeded (one host number over a gloo group of the worker's
own), so every rank learns of a failure at the same unit, stops there, and raises at its next
wait: the failing rank its own error, the others a RuntimeError. The update is then rolled back
(``update.rollback``: states, step counts and narrow param shards as before the step) on the
waiting thread, and only an update every rank finished is committed. A forward that already
gathered earlier units with the new values raises before it ends (its root's hook releases them).

Stages 1-2 (``behind_buckets.BucketsBehind``) key the update by bucket and give a ``land``: after every rank's
update of a key succeeded, the worker all-gathers that bucket into the full parameters over a group of its own
(``land(key)``), so no read between steps ever needs a collective from the reading thread. There a failure is
undone on the worker itself (``update.rollback``, then the buckets already gathered gathered again,
``restore(keys)``: every rank's worker does the same, whatever its main thread is doing), and the waiting
thread only raises.

Used where the parameters live on a GPU (the forward then leaves the host's cores to the update);
on a CPU-only run only when ``UpdateBehind.on_cpu`` is set (the tests do).

On a GPU the worker's uploads of new narrow params run on the copy stream (``tiers/transfer.py``);
each key's ticket is an event recorded there after its jobs, which the waiting thread's stream
waits for (``Ticket.order_before``) before it gathers. With a ``land`` the worker runs on the copy stream
throughout, so its gathers queue there too and the ticket follows them.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Protocol

import torch

from .comm.collectives import Comm
from .sharding.partition import Partition
from .tiers.transfer import DONE, Ticket, transfers
from .update import PartitionJob, UpdatePlan, commit, rollback, run_job


class Landing(Protocol):
    """Stages 1-2: what the worker does with a key's buckets once every rank updated them."""

    def land(self, key) -> None:
        """All-gather ``key``'s buckets into the full parameters (a collective of the worker's own group)."""

    def restore(self, keys: list) -> None:
        """After a rollback: gather ``keys``' buckets again (their shards are as before the step)."""


class UpdateBehind:
    """One optimizer's host update running behind ``step()``, on one worker thread."""

    gathers_only = False  # it runs the update itself (gathers_behind.GathersBehind runs only the all-gathers)

    #: Whether it runs where the parameters live on the CPU too. There the next forward runs on the same
    #: cores as the host update: measured on 2 cores (stage 3, 8.4M parameters, three runs), the step plus
    #: the next forward took 1.00-1.09x ("cpu") and 1.05-1.15x ("nvme") the time with the update inside
    #: step(). So a CPU-only run updates inside step(); the tests set this to run the overlap on CPU.
    on_cpu = False

    def __init__(self, device: torch.device, agree: Comm | None = None, landing: Landing | None = None) -> None:
        """``device``: the parameters' device; ``agree``: a gloo Comm of the worker's own (None: one rank);
        ``landing``: stages 1-2, the gathers after each key (None: stage 3, the gatherer gathers)."""
        self.device = torch.device(device)
        self._agree = agree
        self._landing = landing
        self._undone = False  # the worker rolled the step back itself (with a landing)
        self._pool: ThreadPoolExecutor | None = None
        self._cond = threading.Condition()
        self._future: Future | None = None
        self._keys: set = set()
        self._ready: dict = {}  # key -> Ticket: its update ended on every rank
        self._stopped = False  # the worker stopped (finished, or a rank failed)
        self._error: BaseException | None = None  # this rank's own failure
        self._partitions: list[Partition] = []
        self._plan: UpdatePlan | None = None
        #: tests: a list the worker appends ("updated", key) to as each key's update ends, or None
        self.log: list | None = None

    @property
    def pending(self) -> bool:
        """Whether an update was started and not yet waited for."""
        return self._future is not None

    def start(self, partitions: list[Partition], plan: UpdatePlan,
              order: list[tuple[object, list[PartitionJob]]]) -> None:
        """Run ``order``'s jobs, key by key, on the worker; ``partitions``: all the optimizer's (commit, rollback)."""
        if self._future is not None:
            raise RuntimeError("an update is already running behind step(): wait() for it first")
        self._partitions, self._plan = partitions, plan
        self._keys = {key for key, _ in order}
        self._ready, self._stopped, self._error, self._undone = {}, False, None, False
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fused_zero-update")
        # with a landing the worker queues on the copy stream, not behind the compute stream as the copies
        # otherwise are (transfers.copy): it first waits for everything the step queued there (the backward
        # may still read the parameters its uploads and gathers write)
        after = torch.cuda.current_stream(self.device).record_event() \
            if self._landing is not None and self.device.type == "cuda" else None
        self._future = self._pool.submit(self._run, order, after)

    # -- the worker ---------------------------------------------------------
    def _run(self, order, after=None) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # the current device is per thread
            # with a landing, the gathers queue on the copy stream behind the uploads (the tickets follow them)
            stream = torch.cuda.stream(transfers(self.device).stream) if after is not None else nullcontext()
            with stream:
                if after is not None:
                    torch.cuda.current_stream(self.device).wait_event(after)
                self._run_keys(order)
        finally:
            with self._cond:
                self._stopped = True
                self._cond.notify_all()

    def _run_keys(self, order) -> None:
        landed = []
        for key, jobs in order:
            ticket = DONE
            if self._error is None:
                try:
                    for job in jobs:
                        run_job(job)
                    ticket = self._ticket()
                except BaseException as e:  # raised on the waiting thread, after every rank knows
                    self._error = e
            failed = self._error is not None
            if self._agree is not None:
                failed = self._agree.any_rank(failed, "offload: the ranks' update verdict")
            if not failed and self._landing is not None:
                self._landing.land(key)  # every rank updated it: gather it (a collective of the worker's group)
                landed.append(key)
                ticket = self._ticket()
            with self._cond:
                if not failed:
                    self._ready[key] = ticket
                    if self.log is not None:
                        self.log.append(("updated", key))
                self._cond.notify_all()
            if failed:
                if self._landing is not None:  # undo here: restoring the gathered buckets is a collective
                    rollback(self._partitions, self._plan.advanced)
                    self._landing.restore(landed)
                    self._undone = True
                return
        commit(self._partitions)

    def _ticket(self) -> Ticket:
        """What later GPU work waits for: every upload queued so far on the copy stream."""
        if self.device.type != "cuda":
            return DONE
        return Ticket(transfers(self.device).stream.record_event())

    # -- the waiting thread ---------------------------------------------------
    @property
    def failed(self) -> bool:
        """Whether the update in flight stopped short (some rank's failed): the next wait raises."""
        return self._future is not None and self._stopped and len(self._ready) < len(self._keys)

    def ready(self, key) -> bool:
        """Whether ``key``'s update has ended on every rank (or there is none to wait for)."""
        return self._future is None or key not in self._keys or key in self._ready

    def wait(self, key=None) -> None:
        """Wait for ``key``'s update (None: the whole update, committed); raise if some rank's failed."""
        if self._future is None:
            return
        if key is not None:
            if key not in self._keys:
                return
            with self._cond:
                while key not in self._ready and not self._stopped:
                    self._cond.wait()
                ticket = self._ready.get(key)
            if ticket is not None:
                ticket.order_before()
                return
        self._settle()

    def _settle(self) -> None:
        future, self._future = self._future, None
        try:
            future.result()  # the worker's own errors (a collective that failed)
            failed = len(self._ready) < len(self._keys)
        except BaseException:
            if not self._undone:
                rollback(self._partitions, self._plan.advanced)
            raise
        if failed:
            if not self._undone:
                rollback(self._partitions, self._plan.advanced)
            error, self._error = self._error, None
            if error is not None:
                raise error
            raise RuntimeError("the host update of the last step failed on another rank (see its error); it was "
                               "undone on every rank: the optimizer states, step counts and parameters are as "
                               "before that step")
        for ticket in self._ready.values():
            ticket.order_before()

    def close(self) -> None:
        """Wait for the update in flight (raising its failure), then stop the worker."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
