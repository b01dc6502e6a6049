"""Checks every rank makes together: run one on every rank and raise on all if any failed (``agree``),
compare a value with rank 0's (``check_same``). Built on ``all_gather_object`` (no torch.distributed here).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Agreement:
    """What ``Comm`` does to make every rank reach the same verdict (a mixin: it gathers with
    the communicator's ``all_gather_object``)."""

    def agree(self, fn: Callable[[], Any], share: Callable[[Any], Any] | None = None,
              errors: tuple[type, ...] = ()) -> tuple[Any, list]:
        """Run ``fn`` (no collectives inside) on every rank; if it raised on any rank, raise on all.

        Returns ``(fn's result, [share(result) of every rank])``. One all_gather_object
        that every rank joins whatever happened: a rank whose check failed never leaves
        the others waiting in a later collective. The rank that failed raises its own
        exception; the others raise the same type (``errors``, the builtin ValueError,
        TypeError, RuntimeError, OSError family; RuntimeError otherwise) naming that rank.
        """
        error, result, mine = None, None, None
        try:
            result = fn()
            mine = share(result) if share is not None else None
        except Exception as e:  # noqa: BLE001 - raised again below, on every rank
            error = e
        gathered = self.all_gather_object((None if error is None else (_error_class(error, errors), str(error)), mine))
        if error is not None:
            raise error
        failed = [(r, e) for r, (e, _) in enumerate(gathered) if e is not None]
        if failed:
            r, (cls, msg) = failed[0]
            raise cls(f"rank {r} failed: {msg}")
        return result, [s for _, s in gathered]

    def check_same(self, value: Any, what: str, hint: str = "") -> None:
        """Raise ValueError on EVERY rank if any rank's ``value`` differs from rank 0's.

        One all_gather_object that every rank joins, then the same comparison on the
        same data everywhere: all ranks agree on the verdict, so none is left waiting.
        """
        _, values = self.agree(lambda: value, share=lambda v: v)
        raise_if_differ(list(enumerate(values)), what, hint)


def raise_if_differ(values: list[tuple[int, Any]], what: str, hint: str = "") -> None:
    """Raise ValueError naming the first rank whose value differs from the first one's; ``values``: (rank, value)
    pairs, the reference first (every rank calls it on the same data, so all reach the same verdict)."""
    ref_rank, ref = values[0]
    for r, v in values[1:]:
        diff = _first_difference(v, ref, r, ref_rank=ref_rank)
        if diff is not None:
            raise ValueError(f"{what} differ across ranks: {diff}" + (f"; {hint}" if hint else ""))


def _error_class(error: Exception, extra: tuple[type, ...]) -> type:
    """The class other ranks raise for ``error``: one of ``extra`` or a builtin (they pickle)."""
    for cls in type(error).__mro__:
        if cls in extra or cls in (FileNotFoundError, FileExistsError, PermissionError, OSError, TypeError, ValueError,
                   NotImplementedError, RuntimeError):
            return cls
    return RuntimeError


def _first_difference(mine: Any, ref: Any, rank: int, path: tuple = (), ref_rank: int = 0) -> str | None:
    """Describe the first place where rank ``rank``'s value differs from rank ``ref_rank``'s, or None. Nested
    lists and tuples are entered where the differing entry is too long to show, and a (quoted name, value) pair
    (an option or hyperparameter, as ``hyper.agreement_key`` writes a dict) is named by its name."""
    if isinstance(mine, (list, tuple)) and isinstance(ref, (list, tuple)):
        if len(mine) == len(ref) == 2 and _named(mine) and mine[0] == ref[0] and mine[1] != ref[1]:
            return _first_difference(mine[1], ref[1], rank, path + (mine[0].strip("'\""),), ref_rank)
        for i in range(min(len(mine), len(ref))):
            if mine[i] != ref[i]:
                a, b = mine[i], ref[i]
                if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
                    if len(a) == len(b) == 2 and _named(a):  # a named entry: its name says where
                        return _first_difference(a, b, rank, path, ref_rank)
                    if len(repr(a)) > 120:
                        return _first_difference(a, b, rank, path + (i,), ref_rank)
                return f"{_where(path)}rank {rank} has entry {i} = {a!r}, rank {ref_rank} has {b!r}"
        if len(mine) != len(ref):
            return f"{_where(path)}rank {rank} has {len(mine)} entries, rank {ref_rank} has {len(ref)}"
        if type(mine) is type(ref):
            return None
    elif mine == ref:
        return None
    if path and isinstance(path[-1], str):
        return f"{_where(path[:-1])}rank {rank} has {path[-1]} = {mine!r}, rank {ref_rank} has {ref!r}"
    return f"{_where(path)}rank {rank} has {mine!r}, rank {ref_rank} has {ref!r}"


def _named(pair) -> bool:
    return isinstance(pair[0], str) and pair[0][:1] in "'\""


def _where(path: tuple) -> str:
    return "" if not path else "at " + " > ".join(f"entry {p}" if isinstance(p, int) else p for p in path) + ": "
