"""The build's first meeting: the ranks that will train together check, through the default group's store, that
each was given the same groups, before any collective (no torch.distributed here: ``Topology.meet`` hands in
the store and the groups).

Why not a collective: the build's agreement checks (options, parameters) are collectives over each rank's own
groups. Ranks given different groups (``process_group=`` on some ranks and none on others, an HSDP mesh on some
and a flat group on others) would make them over groups that never pair and wait until the process group's
timeout (30 minutes by default), naming nothing. A store is shared by every rank whatever its groups.

Each rank publishes a ``Seat``: the names of the groups it shards and replicates over (torch names a group alike
on every rank of it), a digest of their ranks, the mesh it was given, and a digest of the whole layout (a flat
group's ranks; an HSDP mesh's table). Seats are kept under the *span*, the global ranks of both levels, and the
span's build count, so ranks that build optimizers over the same span in the same order meet at the same key.
Every rank of a span reads every seat there (a few hundred bytes each, one round trip; waits block in the store,
no polling) and reaches the same verdict: the layouts and meshes agree and every shard group's (and replica
group's) ranks name the same group, or every rank raises, naming two ranks' groups.

A rank whose span differs never seats at this key. While a rank waits for one, it reads where that peer is
(``now``): a peer waiting at a meeting of another span that needs this rank, where this rank never seated, waits
for this rank as this rank waits for it (another group, or optimizers built in another order): both raise. A peer
building elsewhere without this rank (an optimizer over its own subgroup first) is waited for, with a warning
after ``WARN_S`` seconds naming where it is, until the group's timeout.

A rank that refused the build before meeting (a bad argument on it alone: ``topology.refuse_build``) sits with its
reason and does not wait; the others raise that reason, so no rank waits for one that already raised.
"""
from __future__ import annotations

import hashlib
import pickle
import time
import warnings
from typing import NamedTuple

from .rendezvous import WARN_S


class Seat(NamedTuple):
    """What one rank was given: ``shard`` and ``replicate`` as (group name, digest of its global ranks), the
    replicas' None without HSDP; ``mesh``: ``Topology.describe()``; ``layout``: a digest of the span's groups;
    ``says``: how it reads in a message."""

    shard: tuple[str, str]
    replicate: tuple[str, str] | None
    mesh: tuple
    layout: str
    says: str
    refused: tuple[type, str] | None = None  # this rank refused the build before meeting: (the class the others
    # raise, agreement._error_class's, and the message)


def digest(value) -> str:
    return hashlib.sha1(repr(value).encode()).hexdigest()[:16]


def seat_of(shard: tuple[str, tuple[int, ...]], replicate: tuple[str, tuple[int, ...]] | None, mesh: tuple,
            default: bool, layout) -> Seat:
    """The seat of a rank given ``shard`` and ``replicate`` groups as (name, global ranks in group order)."""
    if mesh:
        device, shape, names = mesh
        says = f"a {device!r} mesh of shape {shape} named {names}"
        says += (f" (shard group {_short(shard[1])}, replicas {_short(replicate[1])})" if replicate is not None
                 else f" (group {_short(shard[1])})")
    elif default:
        says = f"the default process group (ranks {_short(shard[1])})"
    else:
        says = f"process group {shard[0]!r} over ranks {_short(shard[1])}"
    return Seat((shard[0], digest(shard[1])), None if replicate is None else (replicate[0], digest(replicate[1])),
                mesh, digest(layout), says)


def _short(ranks) -> str:
    ranks = list(ranks)
    return str(ranks) if len(ranks) <= 8 else f"[{', '.join(map(str, ranks[:8]))}, ...] ({len(ranks)} ranks)"


def _runs(ranks: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """Sorted ``ranks`` as (start, stop, step) ranges: a block or a strided column in one (``now`` stays small)."""
    out, i = [], 0
    while i < len(ranks):
        step = ranks[i + 1] - ranks[i] if i + 1 < len(ranks) else 1
        j = i + 1
        while j < len(ranks) and ranks[j] - ranks[j - 1] == step:
            j += 1
        out.append((ranks[i], ranks[j - 1] + 1, step))
        i = j
    return tuple(out)


def _holds(runs, rank: int) -> bool:
    return any(rank in range(*r) for r in runs)


_REFUSED = "the ShardedOptimizer's build was refused on"
_FIX = ("pass the same process_group= or mesh= on every rank (one group made by dist.new_group(...) on every rank, "
        "or one DeviceMesh), and build the optimizers in the same order everywhere")
#: the first slice a wait blocks in the store before it looks where the missing ranks are (then twice as long, up to 5 s)
_LOOK_S = 0.5


def meet(store, me: int, seat: Seat, span: tuple[int, ...], groups: list[tuple[str, list[tuple[int, ...]]]],
         timeout_s: float | None) -> None:
    """Publish ``seat`` for global rank ``me`` and check it against every rank of ``span`` (sorted; every rank of
    it calls this); ``groups``: ("shard" or "replicate", that level's groups as tuples of global ranks) over the
    span, from this rank's own layout (used once every seat's layout digest equals this one's). Raises ValueError
    on every rank of the span if their groups do not pair, RuntimeError where a peer never comes within
    ``timeout_s`` (None: 30 minutes). A seat that ``refused`` the build (a bad argument on that rank alone) is
    published and not waited with: every other rank raises its reason, as the same class."""
    if len(span) == 1:
        return
    key = "fused_zero/meet/" + digest(span)
    number = store.add(f"{key}/built/{me}", 1)  # the same on every rank of the span: builds over it in order
    here = f"{key}/{number}"
    store.set(f"{here}/{me}", pickle.dumps(seat))
    if seat.refused is not None:  # this rank raises its own error; the peers read its reason here and raise too
        return
    store.set(f"fused_zero/meet/now/{me}", pickle.dumps((here, _runs(span))))  # where this rank waits (_astray)
    try:
        seats = _wait_for(store, here, span, me, 1800.0 if timeout_s is None else timeout_s)
    except (ValueError, RuntimeError) as e:
        if not str(e).startswith(_REFUSED):  # this meeting will never be whole: its waiters raise too
            store.set(f"{here}/failed", f"rank {me}: {e}")
        raise
    finally:
        store.set(f"fused_zero/meet/now/{me}", pickle.dumps(None))
    refused = next(((r, seats[r].refused) for r in span if seats[r].refused is not None), None)
    if refused is not None:
        r, (cls, message) = refused
        raise cls(f"rank {r} failed to build the ShardedOptimizer: {message}")
    problem = _mismatch(seats, span, groups)
    if problem is not None:
        raise ValueError(f"the ranks were given different groups: {problem}; {_FIX}")


def _wait_for(store, here: str, span: tuple[int, ...], me: int, timeout_s: float) -> dict[int, Seat]:
    """Every seat at ``here`` (rank -> Seat) once all of ``span`` sat; raises where a peer waits elsewhere for this
    rank, or never comes."""
    keys = [f"{here}/{r}" for r in span]
    start, look, warned = time.monotonic(), _LOOK_S, False
    while True:
        if _sat(store, keys, look):
            break
        waited = time.monotonic() - start
        look = min(2 * look, 5.0)
        if store.check([f"{here}/failed"]):
            raise ValueError(f"{_REFUSED} {store.get(f'{here}/failed').decode()}")
        missing = _missing(store, span, keys)
        astray = _astray(store, missing, me, here)
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
    return {r: pickle.loads(v) for r, v in zip(span, store.multi_get(keys))}


def _sat(store, keys: list[str], look: float) -> bool:
    """Whether every one of ``keys`` is in the store within ``look`` seconds. Polled with ``check`` (1 ms, doubling to
    50 ms): a ``store.wait`` slice that runs out makes torch's TCPStore client log two c10d warnings on stderr each
    time ("waitForInput ... timed out"), which a rank that merely arrives a second later must not cause."""
    end, pause = time.monotonic() + look, 0.001
    while not store.check(keys):
        if time.monotonic() >= end:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    return True


def _missing(store, span, keys, most: int = 8) -> list[int]:
    """The first ``most`` ranks of ``span`` that have not sat (a few store checks a look, not one per rank)."""
    out = []
    for r, k in zip(span, keys):
        if not store.check([k]):
            out.append(r)
            if len(out) == most:
                break
    return out


def _now(store, r: int):
    key = f"fused_zero/meet/now/{r}"
    return pickle.loads(store.get(key)) if store.check([key]) else None


def _astray(store, missing: list[int], me: int, here: str) -> tuple[str, str] | None:
    """A missing peer waiting at another meeting whose span holds ``me``, where ``me`` has not sat: it waits for
    this rank as this rank waits for it (never both come): that meeting's key and the two ranks' groups described;
    else None. (Had ``me`` sat there, the peer is only slow to leave a meeting both made.)"""
    for r in missing:
        where = _now(store, r)
        if where is None:
            continue
        there, runs = where
        if there != here and _holds(runs, me) and not store.check([f"{there}/{me}"]):
            theirs, mine = pickle.loads(store.get(f"{there}/{r}")), pickle.loads(store.get(f"{here}/{me}"))
            return there, f"rank {r} builds its ShardedOptimizer over {theirs.says}, rank {me} over {mine.says}"
    return None


def _whereabouts(store, missing: list[int]) -> str:
    """Where the missing ranks are, as far as the store says."""
    parts = []
    for r in missing[:4]:
        where = _now(store, r)
        if where is None:
            parts.append(f"rank {r} is not building one now (still computing, or in another collective)")
        else:
            ranks = [x for run in where[1] for x in range(*run)]
            parts.append(f"rank {r} waits to build one over ranks {_short(ranks)}")
    return "; ".join(parts)


def _mismatch(seats: dict[int, Seat], span: tuple[int, ...], groups) -> str | None:
    """The first pair of ranks whose groups or meshes do not pair, described; None if every group pairs. The same
    answer on every rank (the same seats, read in rank order; ``groups`` are read only once every layout agrees)."""
    def differ(r: int, q: int) -> str:
        return f"rank {r} builds its ShardedOptimizer over {seats[r].says}, rank {q} over {seats[q].says}"

    first = span[0]
    ref = seats[first]
    for r in span:
        s = seats[r]
        if (s.mesh, s.layout, s.replicate is None) != (ref.mesh, ref.layout, ref.replicate is None):
            return differ(first, r)
    for level, members in groups:
        for group in members:
            for q in group[1:]:
                if getattr(seats[q], level) != getattr(seats[group[0]], level):
                    return differ(group[0], q)
    return None
