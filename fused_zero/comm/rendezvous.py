"""Calls every rank must make, announced through the process group's store.

``state_dict()``, ``load_state_dict()``, ``full_parameters()``, ``close()`` at stage 3 and the
checkpoint calls are collective. A rank that makes one alone (``if rank == 0:
torch.save(opt.state_dict(), path)``, DDP's habit) would wait in its collective while the others
wait in their next step's, until the process group's timeout (30 minutes by default) says
"Timed out waiting ... for recv", naming nothing. So each such call first meets the other ranks
through the c10d store the process group already has (a few store operations, no collective):

- every rank publishes how many of these calls it has entered, the name of each, and whether it
  is blocked in one of fused_zero's collective waits (``collectives`` waits on gloo in one-second
  slices and tells this module when a slice times out) or gone (closed, or the process exited);
- a rank entering call number c waits until every rank has entered call c with the same name.
  A peer that is blocked in the next step's collectives is where DDP's habit leaves it. For
  ``state_dict()`` the blocked peer *serves* the call: from inside its blocked wait it runs its
  side of the gather (on a process group of its own, so nothing queued on the training group
  is disturbed; its states are those of the last step, which every rank finished), so the
  habit works. For the other calls there is nothing sensible to serve (a load, a checkpoint
  file, parameters gathered for a body the peer does not run): the caller raises at once,
  naming the call and what to write instead, and takes its announcement back, so that once
  every rank makes the call it works, and a caller that carries on meets the peer's pending
  collective as if nothing had happened. If the caller's exception ends its process instead,
  the blocked peer's collective fails with "Connection closed by peer"; that peer then reads
  the caller's reason from the store and raises it too.
- Blocked means blocked *past* the call: each rank publishes, with its BLOCKED state, how many steps its
  optimizer has finished (``progress``), and each caller its own with its call. A peer blocked with fewer
  steps finished is still inside an earlier step's collective (on a loaded machine a rank may wait there
  for a slow third rank after the caller's side of it completed): it is waited for, and serves nothing yet.
- A peer that neither arrives nor blocks (it is still computing, evaluating, or waiting in a
  collective fused_zero did not issue) is waited for as a collective would be, up to the
  process group's timeout, with a warning after ``WARN_S`` seconds that names the call.

NCCL waits do not block the host, so there a blocked peer is not seen: the call waits, warns
and times out as above.
"""
from __future__ import annotations

import os
import time
import warnings
import weakref
from collections.abc import Callable
from contextlib import contextmanager

#: the name a stage-3 evaluation forward (without gradients, or in eval mode) meets the other ranks under
#: (optimizer._meet_eval)
EVAL_FORWARD = "a stage-3 evaluation forward (without gradients, or in eval mode)"

#: Seconds a collective call waits for the other ranks before it warns that they have not called it.
WARN_S = float(os.environ.get("FUSED_ZERO_COLLECTIVE_WARN_S", "30"))

BUSY, BLOCKED, GONE = 0, 1, 2
_POLL_S = (0.0005, 0.05)  # first and longest pause between two looks at the store

_LIVE: "weakref.WeakSet[Rendezvous]" = weakref.WeakSet()

_WHAT_INSTEAD = {
    "state_dict()": "call it on every rank and save on one: `sd = optimizer.state_dict()` then "
                    "`if rank == 0: torch.save(sd, path)`, or save a sharded checkpoint with "
                    "fused_zero.checkpoint.save(dir, model, optimizer) on every rank",
    "load_state_dict()": "call optimizer.load_state_dict(sd) on every rank (each may load rank 0's dict: "
                         "`sd = torch.load(path)` on every rank)",
    "full_parameters()": "enter `with optimizer.full_parameters():` on every rank and save on one inside it: "
                         "`if rank == 0: torch.save(model.state_dict(), path)`; a framework's save that gathers "
                         "the model enters it for you (HF `trainer.save_model()`, Accelerate's `save_model` / "
                         "`get_state_dict`): call that on every rank, not under `if is_world_process_zero()`",
    "checkpoint.save()": "call fused_zero.checkpoint.save(dir, model, optimizer) on every rank; each writes its shard",
    "checkpoint.load()": "call fused_zero.checkpoint.load(dir, model, optimizer) on every rank",
    "close()": "call optimizer.close() on every rank",
    EVAL_FORWARD: "at stage 3 every rank runs every forward, evaluation included (its "
                                            "gathers need every rank); to evaluate on one rank, enter "
                                            "`with optimizer.full_parameters():` on every rank and evaluate inside "
                                            "it on that one (`if rank == 0: evaluate(model)`): nothing is gathered "
                                            "there",
}


def _message(name: str, why: str) -> str:
    fix = _WHAT_INSTEAD.get(name, "call it on every rank")
    return f"{name} is collective: every rank of the optimizer's process group must call it, but {why}; {fix}"


#: the name under which a rank that raised out of a step leaves its reason (``Rendezvous.raised``)
_RAISED = "step()"

#: what ``Rendezvous._left_reason`` says of a rank that gave up on a call of its own and left
_GAVE_UP = " gave up on its "

#: the prefix of a name key whose rank withdrew its call (rendezvous keys are never deleted)
_WITHDRAWN = "withdrawn:"


class _Withdrawn(Exception):
    """A call this rank served from a blocked wait was given up by its caller."""


class Rendezvous:
    """The meeting point of one optimizer's collective calls (one per optimizer over several ranks).

    ``store`` is the process group's c10d store, ``rank`` and ``world_size`` the group's,
    ``timeout_s`` the group's timeout (None: 30 minutes), ``control`` a callable that returns the
    communicator the served calls run on (made on first use, by every rank at the same call).
    """

    def __init__(self, store, rank: int, world_size: int, timeout_s: float | None, ranks_key: str,
                 global_ranks: list[int] | None = None):
        """``global_ranks``: the global rank of each of its ranks (what the messages name; None: the same)."""
        self._ranks = list(range(world_size)) if global_ranks is None else list(global_ranks)
        prefix = f"fused_zero/{ranks_key}"
        number = store.add(f"{prefix}/built/{rank}", 1)  # the same on every rank: optimizers build in order
        self._prefix = f"{prefix}/{number}"
        self._store, self.rank, self.world_size = store, rank, world_size
        self._timeout_s = 1800.0 if timeout_s is None else timeout_s
        self._count = 0           # calls this rank entered (and did not take back)
        self._depth = 0           # > 0 inside one (nested calls are part of the outer one)
        self._published = BUSY
        self._serving = False
        self._raised = False      # this rank left a step's exception in the store (raised / recovered)
        self._servers: dict[str, Callable[[], Callable[[], None] | None]] = {}
        #: how many steps the optimizer finished (set by it): where in the run a call or a blocked wait is
        self.progress: Callable[[], int | None] = lambda: 0
        self._store.add(self._key(f"state/{rank}"), 0)
        _LIVE.add(self)

    # Keys, all under this optimizer's prefix (every rank reads O(1) of them per look while a call
    # goes as it should; the per-rank ones only when it does not):
    #   calls/<c>          ranks that entered call number c
    #   calls/<c>/<name>   of those, ranks that entered it as <name>
    #   name/<c>/<r>       rank r's name for call c ("withdrawn:<name>" once it withdrew: never deleted, so
    #                      a peer's get never waits for a key that is gone)
    #   state/<r>          BUSY, BLOCKED or GONE
    #   progress/<r>       rank r's steps finished when it last blocked (written before its BLOCKED)
    #   at/<c>             the callers' steps finished when they entered call c
    #   failed/<r>         the call rank r gave up on, and why
    def _key(self, what: str) -> str:
        return f"{self._prefix}/{what}"

    def _global(self, ranks) -> list[int]:
        """``ranks`` (of this meeting point) as the global ranks a user sees."""
        return [self._ranks[q] for q in ranks]

    def _peers(self):
        return (q for q in range(self.world_size) if q != self.rank)

    def _read(self, what: str) -> int:
        return self._store.add(self._key(what), 0)

    def _steps(self) -> int:
        return self.progress() or 0

    def _publish(self, state: int) -> None:
        if state != self._published:
            if state == BLOCKED:  # first: a peer that reads BLOCKED reads where
                self._store.set(self._key(f"progress/{self.rank}"), str(self._steps()))
            self._store.add(self._key(f"state/{self.rank}"), state - self._published)
            self._published = state

    def serve(self, name: str, server: Callable[[], None]) -> None:
        """While blocked, run ``server`` (held weakly) when a peer makes call ``name`` alone."""
        self._servers[name] = weakref.WeakMethod(server) if hasattr(server, "__self__") else (lambda: server)

    # ---- the calls -----------------------------------------------------------------------
    @contextmanager
    def collective(self, name: str):
        """Meet every rank at call ``name`` before running the body (nested calls meet once).

        Inside a blocked wait (serving a peer's lone call), a meeting that fails raises
        ``_Withdrawn``, which the wait swallows: the peer's call is over, this rank's wait goes on.
        """
        if self._depth == 0:
            try:
                self._meet(name)
            except RuntimeError as e:
                if self._serving:
                    raise _Withdrawn() from e
                raise
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def _meet(self, name: str) -> None:
        c = self._count = self._count + 1
        st = self._store
        mine = self._steps()
        st.set(self._key(f"at/{c}"), str(mine))
        st.set(self._key(f"name/{c}/{self.rank}"), name)
        st.add(self._key(f"calls/{c}/{name}"), 1)
        st.add(self._key(f"calls/{c}"), 1)
        start, pause, warned, looked = time.monotonic(), _POLL_S[0], False, 0.0
        while True:
            everyone = self._read(f"calls/{c}") == self.world_size  # read first: a rank adds to it last
            if self._read(f"calls/{c}/{name}") == self.world_size:
                return
            if everyone:  # all there, not all as ``name``
                self._fail(name, self._other_names(c, name))
            waited = time.monotonic() - start
            if waited - looked > 0.2:  # slow: see who is missing, and where
                looked = waited
                behind = [q for q in self._peers() if not self._entered(c, q)]
                states = {q: self._read(f"state/{q}") for q in behind}
                gone = [q for q in behind if states[q] == GONE]
                if gone:
                    reason = self._left_reason(gone)
                    self._fail(name, reason or f"rank(s) {self._global(gone)} closed this optimizer or exited "
                                               "without calling it")
                blocked = [q for q in behind if states[q] == BLOCKED and self._blocked_at(q) >= mine]
                if blocked and name not in self._servers:
                    self._fail(name, f"rank(s) {self._global(blocked)} did not call it and are waiting in their next "
                                     "collective (the next step's)")
                if waited > self._timeout_s:
                    self._fail(name, f"rank(s) {self._global(behind)} did not call it within the process group's "
                                     f"timeout ({self._timeout_s:.0f} s): either their code does not make this "
                                     "call, or those processes died without exiting (killed, out of memory, a crash in "
                                     "native code: look at their logs), which no rank can tell apart from "
                                     "waiting")
                if waited > WARN_S and not warned:
                    warned = True
                    warnings.warn(f"rank {self._ranks[self.rank]} has waited {waited:.0f} s in {name} for "
                                  f"rank(s) {self._global(behind)}: " + _message(name, "they have not called it yet"),
                                  RuntimeWarning, stacklevel=4)
            time.sleep(pause)
            pause = min(2 * pause, _POLL_S[1])

    def _blocked_at(self, q: int) -> int:
        """Rank q's steps finished when it last blocked (read after its BLOCKED state, written before it)."""
        return int(self._store.get(self._key(f"progress/{q}")).decode())

    def _named(self, c: int, q: int) -> str:
        """Rank q's name for call c: "" if it has not called, ``withdrawn:<name>`` if it called and withdrew. A
        name key is never deleted, so the get after the check cannot wait for a key removed meanwhile."""
        key = self._key(f"name/{c}/{q}")
        return self._store.get(key).decode() if self._store.check([key]) else ""

    def _entered(self, c: int, q: int) -> bool:
        """Whether rank q is in call c now (it called it and did not withdraw)."""
        named = self._named(c, q)
        return bool(named) and not named.startswith(_WITHDRAWN)

    def _left_reason(self, ranks: list[int]) -> str | None:
        """Why one of ``ranks`` (gone) left, where it gave up on a call of its own first (``_fail``: it met a
        different call, and its process then ended), or None."""
        reasons = []
        for q in ranks:
            other, why = self._failure_of(q) or (_RAISED, "")
            if other != _RAISED:
                reasons.append(why if _GAVE_UP in why else f"rank {self._ranks[q]}{_GAVE_UP}{other} and left: {why}")
        # the first cause, not a peer that left because of it
        return min(reasons, key=lambda r: r.count(_GAVE_UP), default=None)

    def _failure_of(self, q: int) -> tuple[str, str] | None:
        """(the call rank q gave up on, or ``_RAISED``; why) as it left them in the store, or None."""
        key = self._key(f"failed/{q}")
        if not self._store.check([key]):
            return None
        name, why = self._store.get(key).decode().split("\n", 1)
        return name, why

    def _other_names(self, c: int, name: str) -> str:
        for q in self._peers():
            other = self._named(c, q).removeprefix(_WITHDRAWN)
            if other and other != name:
                return f"rank {self._ranks[q]} called {other} at the same point"
        return "another rank called something else at the same point"

    def _fail(self, name: str, why: str) -> None:
        """Take this rank's announcement back, leave the reason for the others, raise."""
        c, st = self._count, self._store
        st.set(self._key(f"failed/{self.rank}"), f"{name}\n{why}")
        st.add(self._key(f"calls/{c}"), -1)
        st.add(self._key(f"calls/{c}/{name}"), -1)
        st.set(self._key(f"name/{c}/{self.rank}"), _WITHDRAWN + name)  # not deleted: see _named
        self._count -= 1
        raise RuntimeError(_message(name, why))

    # ---- told by collectives' waits ------------------------------------------------------------
    def while_blocked(self) -> None:
        """A wait of this process has blocked for a slice: say so, and serve a peer's lone call."""
        self._publish(BLOCKED)
        c = self._count + 1
        if self._depth or self._read(f"calls/{c}") == 0:
            return
        if int(self._store.get(self._key(f"at/{c}")).decode()) > self._steps():
            return  # called after a step this rank has not finished: it is blocked inside that step, not past it
        for name, server in self._servers.items():
            run = server()
            if run is None or self._read(f"calls/{c}/{name}") == 0:
                continue
            self._serving = True
            try:
                run()
            except _Withdrawn:  # the caller gave up meanwhile (its call met another): keep waiting
                pass
            finally:
                self._serving = False
            return

    def unblocked(self) -> None:
        self._publish(BUSY)

    def peer_failure(self) -> str | None:
        """What a peer that gave up on a collective call, or raised out of a step, left in the store, if anything."""
        for q in self._peers():
            failure = self._failure_of(q)
            if failure is not None:
                name, why = failure
                if name == _RAISED:
                    return f"rank {self._ranks[q]} raised {why}"
                return f"rank {self._ranks[q]} stopped in {name}: " + _message(name, why)
        return None

    def raised(self, what: str) -> None:
        """This rank raised out of a step (``what``: the exception, as it reads): if that ends the process, a peer
        whose collective then fails says why (``peer_failure``)."""
        try:
            self._store.set(self._key(f"failed/{self.rank}"), f"{_RAISED}\n{what}")
            self._raised = True
        except Exception:  # noqa: BLE001 - the store may be gone with the process group: the error goes on as it is
            pass

    def recovered(self) -> None:
        """A step went through after one raised: its reason is no longer this rank's last word."""
        if self._raised:
            self._raised = False
            try:
                self._store.delete_key(self._key(f"failed/{self.rank}"))
            except Exception:  # noqa: BLE001 - as above
                pass

    def close(self) -> None:
        """This optimizer will make no more calls: a peer's lone call fails at once."""
        try:
            self._publish(GONE)
        except Exception:  # noqa: BLE001 - the store may be gone with the process group
            pass
        _LIVE.discard(self)

    def __del__(self) -> None:  # the optimizer was collected (a script's end, a rebuilt optimizer)
        self.close()


def watching() -> bool:
    """Whether any optimizer over several ranks is open in this process."""
    return bool(_LIVE)


def while_blocked() -> None:
    for rv in list(_LIVE):
        rv.while_blocked()


def unblocked() -> None:
    for rv in list(_LIVE):
        try:
            rv.unblocked()
        except Exception:  # noqa: BLE001 - never turn a finished wait into an error
            pass


def peer_failure() -> str | None:
    for rv in list(_LIVE):
        try:
            found = rv.peer_failure()
        except Exception:  # noqa: BLE001 - the store went with the failed peer
            found = None
        if found is not None:
            return found
    return None


def at_exit() -> None:
    """The process is exiting: every live optimizer is gone for its peers."""
    for rv in list(_LIVE):
        rv.close()
