"""The build's first meeting: the ranks that will train together check, through the default group's store, that
each was given the same groups, before any collective (no torch.distributed here: ``Topology.meet`` hands in
the store and the groups).

Why not a collective: the build's agreement checks (options, parameters) are collectives over each rank's own
groups. Ranks given different groups (``process_group=`` on some ranks and none on others, an HSDP mesh on some
and a flat group on others) would make them over groups that never pair and wait until the process group's
timeout (30 minutes by default), naming nothing. A store is shared by every rank whatever its groups.

Each rank publishes a ``Seat``: the groups it shards and replicates over (their names, which torch gives alike on
every rank of one group, and their global ranks) and the mesh it was given. Seats are kept under the *span*, the
global ranks of both levels (a flat group's ranks; an HSDP mesh's), and the span's build count, so ranks that
build optimizers over the same span in the same order meet at the same key. Every rank of a span reads every
seat there and reaches the same verdict: the groups pair (each rank's shard peers name the same shard group,
each one's replicas the same replica group) and the meshes agree, or every rank raises, naming two ranks' views.

A rank whose span differs never seats at this key. While a rank waits for one, it reads where that peer is
(``now``): a peer waiting at a meeting of another span that needs this rank, where this rank never seated, waits
for this rank as this rank waits for it (another group, or optimizers built in another order): both raise. A peer
building elsewhere without this rank (an optimizer over its own subgroup first) is waited for, with a warning
after ``WARN_S`` seconds naming where it is, until the group's timeout.
"""
from __future__ import annotations

import hashlib
import pickle
import time
import warnings
from typing import NamedTuple

from .rendezvous import WARN_S

_POLL_S = (0.0005, 0.05)  # first and longest pause between two looks at the store


class Seat(NamedTuple):
    """What one rank was given: ``shard`` and ``replicate`` as (group name, global ranks in group order), the
    replicas' None without HSDP; ``mesh``: ``Topology.describe()``; ``default``: the shard group is the default
    process group (for messages); ``span``: the global ranks of both levels, sorted (an HSDP mesh's)."""

    shard: tuple[str, tuple[int, ...]]
    replicate: tuple[str, tuple[int, ...]] | None
    mesh: tuple
    default: bool
    span: tuple[int, ...]

    def says(self) -> str:
        """How this rank's groups read in a message."""
        if self.mesh:
            device, shape, names = self.mesh
            where = f"a {device!r} mesh of shape {shape} named {names}"
            if self.replicate is not None:
                return f"{where} (shard group {list(self.shard[1])}, replicas {list(self.replicate[1])})"
            return f"{where} (group {list(self.shard[1])})"
        if self.default:
            return f"the default process group (ranks {_short(self.shard[1])})"
        return f"process group {self.shard[0]!r} over ranks {_short(self.shard[1])}"


def _short(ranks) -> str:
    ranks = list(ranks)
    return str(ranks) if len(ranks) <= 8 else f"[{', '.join(map(str, ranks[:8]))}, ...] ({len(ranks)} ranks)"


_REFUSED = "the ShardedOptimizer's build was refused on"
_FIX = ("pass the same process_group= or mesh= on every rank (one group made by dist.new_group(...) on every rank, "
        "or one DeviceMesh), and build the optimizers in the same order everywhere")


def meet(store, me: int, seat: Seat, timeout_s: float | None) -> None:
    """Publish ``seat`` for global rank ``me`` and check it against every rank of its span (every rank of the span
    calls it); raises ValueError on every rank of the span if their groups do not pair, RuntimeError where a
    peer never comes within ``timeout_s`` (None: 30 minutes)."""
    span = seat.span
    if len(span) == 1:
        return
    key = "fused_zero/meet/" + hashlib.sha1(repr(span).encode()).hexdigest()[:16]
    number = store.add(f"{key}/built/{me}", 1)  # the same on every rank of the span: builds over it in order
    here = f"{key}/{number}"
    store.set(f"{here}/{me}", pickle.dumps(seat))
    store.set(f"fused_zero/meet/now/{me}", pickle.dumps((here, span)))  # where this rank waits (see _astray)
    try:
        seats = _wait_for(store, here, span, me, 1800.0 if timeout_s is None else timeout_s)
    except (ValueError, RuntimeError) as e:
        if not str(e).startswith(_REFUSED):  # this meeting will never be whole: its waiters raise too
            store.set(f"{here}/failed", f"rank {me}: {e}")
        raise
    finally:
        store.set(f"fused_zero/meet/now/{me}", pickle.dumps(None))
    problem = _mismatch(seats)
    if problem is not None:
        raise ValueError(f"the ranks were given different groups: {problem}; {_FIX}")


def _wait_for(store, here: str, span: tuple[int, ...], me: int, timeout_s: float) -> dict[int, Seat]:
    """Every seat at ``here`` (rank -> Seat) once all of ``span`` sat; raises where a peer waits elsewhere for this
    rank, or never comes."""
    keys = [f"{here}/{r}" for r in span]
    start, pause, warned, looked = time.monotonic(), _POLL_S[0], False, 0.0
    while not store.check(keys):
        waited = time.monotonic() - start
        if waited - looked >= 0.5:  # where the missing ranks are, twice a second
            looked = waited
            if store.check([f"{here}/failed"]):
                raise ValueError(f"{_REFUSED} {store.get(f'{here}/failed').decode()}")
            missing = [r for r, k in zip(span, keys) if not store.check([k])]
            astray = _astray(store, missing, me)
            if astray is not None:
                there, why = astray
                message = f"the ranks were given different groups: {why}; {_FIX}"
                store.set(f"{there}/failed", f"rank {me}: {message}")  # the peer waits there for this rank: in vain
                raise ValueError(message)
            if not warned and waited >= WARN_S:
                warned = True
                warnings.warn(f"rank {me} has waited {waited:.0f} s for rank(s) {_short(missing)} to build the "
                              f"ShardedOptimizer over ranks {_short(span)}: {_whereabouts(store, missing)}",
                              RuntimeWarning, stacklevel=4)
            if waited >= timeout_s:
                raise RuntimeError(f"rank(s) {_short(missing)} did not build the ShardedOptimizer over ranks "
                                   f"{_short(span)} within the process group's timeout ({timeout_s:.0f} s): "
                                   f"{_whereabouts(store, missing)}; {_FIX}")
        time.sleep(pause)
        pause = min(2 * pause, _POLL_S[1])
    return {r: pickle.loads(v) for r, v in zip(span, store.multi_get(keys))}


def _astray(store, missing: list[int], me: int) -> tuple[str, str] | None:
    """A missing peer waiting at another meeting whose span holds ``me``, where ``me`` has not sat: it waits for
    this rank as this rank waits for it (never both come): that meeting's key and the two ranks' groups described;
    else None. (Had ``me`` sat there, the peer
    is only slow to leave a meeting both made.)"""
    for r in missing:
        now = store.multi_get([f"fused_zero/meet/now/{r}"])[0] if store.check([f"fused_zero/meet/now/{r}"]) else None
        where = None if now is None else pickle.loads(now)
        if where is None:
            continue
        there, span = where
        if me in span and not store.check([f"{there}/{me}"]):
            seat = pickle.loads(store.get(f"{there}/{r}"))
            mine = _seat_of(store, me)
            return there, (f"rank {r} builds its ShardedOptimizer over {seat.says()}" +
                           (f", rank {me} over {mine.says()}" if mine is not None else ""))
    return None


def _seat_of(store, me: int) -> Seat | None:
    now = pickle.loads(store.get(f"fused_zero/meet/now/{me}"))
    return None if now is None else pickle.loads(store.get(f"{now[0]}/{me}"))


def _whereabouts(store, missing: list[int]) -> str:
    """Where the missing ranks are, as far as the store says."""
    parts = []
    for r in missing[:4]:
        key = f"fused_zero/meet/now/{r}"
        where = pickle.loads(store.get(key)) if store.check([key]) else None
        if where is None:
            parts.append(f"rank {r} is not building one now (still computing, or in another collective)")
        else:
            parts.append(f"rank {r} waits to build one over ranks {_short(where[1])}")
    return "; ".join(parts)


def _mismatch(seats: dict[int, Seat]) -> str | None:
    """The first pair of ranks whose groups or meshes do not pair, described; None if every group pairs. The same
    answer on every rank (the same seats, read in rank order)."""
    ranks = sorted(seats)
    for r in ranks:
        s = seats[r]
        for level in ("shard", "replicate"):
            group = getattr(s, level)
            for q in (group[1] if group is not None else ()):
                other = seats.get(q)
                if other is None or getattr(other, level) != group or other.mesh != s.mesh:
                    return f"rank {r} builds its ShardedOptimizer over {s.says()}, " + (
                        f"rank {q} over {other.says()}" if other is not None else f"rank {q} not over these ranks")
    return None
