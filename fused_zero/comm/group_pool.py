"""The process groups this package makes: kept for the next Comm over the same ranks, never destroyed.

Why not destroy a group when its Comm goes (its optimizer dropped, or replaced in a sweep or a reload)? torch
names a group made with ``use_local_synchronization=True`` sha1(its ranks, the number of groups registered) and
keys that group's rendezvous by the name in the store. A destroy lowers the count: the next group over the same
ranks takes the dead group's name and reads its addresses, still in the store (gloo: "connectFullMesh failed ...
Connection refused"); and where garbage collection destroyed at different moments on different ranks, the ranks
compute different names and wait for each other until the timeout. Groups named by a counter
(``use_local_synchronization=False``) never share a name, but their destroys move the count the hashed names read.

So the group of a collected Comm goes back to a pool on its rank, and the next request over the same ranks,
backend and timeout takes one back -- once every rank of the request has it back: collection times differ
between ranks, so the ranks agree through the default store (one key written and one read per rank of the
request, at a build) on a group free on all of them, or make a new one. A group is named by the number of the
request that made it, the same on every rank (they make requests in the same order: each build does). The
groups alive stay as many as the optimizers alive at once need; torch.distributed's ``destroy_process_group()``
takes them all (a pooled group no longer registered is dropped).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Hashable

_free: dict[Hashable, dict[int, object]] = {}  # key -> {request number that made it: group}, idle on this rank
_requests: dict[Hashable, int] = {}  # requests made per key (the same count on every rank of the key)


def take(key: Hashable, ranks: list[int], rank: int, make: Callable[[], object], store, digest: str,
         registered: Callable[[object], bool]):
    """``(group, number)``: a group for ``key`` free on every rank of ``ranks`` (the global ranks that all make
    this request; ``rank``: this one's), or ``make()``'s (every rank of ``ranks`` calls it then) numbered by this
    request. ``digest`` names the key in the store; ``registered(group)``: whether torch.distributed still holds
    it (no torch.distributed here: comm/collectives.py hands these in)."""
    number = _requests[key] = _requests.get(key, 0) + 1
    free = _free.setdefault(key, {})
    for n in [n for n, g in free.items() if g is not None and not registered(g)]:
        del free[n]  # destroy_process_group() took it
    if store is None or len(ranks) < 2:
        return make(), number
    prefix = f"fused_zero/groups/{digest}/{number}"
    store.set(f"{prefix}/{rank}", json.dumps(sorted(free)))
    common = set(free)
    for r in ranks:
        if r != rank:
            common &= set(json.loads(store.get(f"{prefix}/{r}")))
    if common:
        n = min(common)
        return free.pop(n), n
    return make(), number


def give_back(key: Hashable, number: int, group) -> None:
    """``group`` (made by request ``number`` of ``key``) is idle on this rank: a later request may take it."""
    _free.setdefault(key, {})[number] = group
