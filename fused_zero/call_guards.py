"""Decorators for ShardedOptimizer's calls that every rank makes: what one rank raises reaches the others.

``reason_left_for_peers`` wraps the calls made on every rank (``step()``, ``zero_grad()``, the clips,
``add_param_group()``, ``check_agreement()``); ``refused_on_every_rank`` wraps the constructor.
"""
from __future__ import annotations

import functools

from .comm.topology import refuse_build


def reason_left_for_peers(call: str):
    """ShardedOptimizer's calls that every rank makes (``step()``, ``add_param_group()``, ...): an exception out of
    one is left in the store (``Rendezvous.raised``), so that if it ends this process, the peers' next collective
    fails with its reason rather than gloo's "Connection closed by peer"; a call that goes through takes it back."""
    def decorate(method):
        @functools.wraps(method)
        def calling(self, *args, **kwargs):
            rendezvous = self.__dict__.get("_rendezvous")
            try:
                out = method(self, *args, **kwargs)
            except BaseException as e:  # a KeyboardInterrupt ends the process as well
                if rendezvous is not None:
                    rendezvous.raised(f"{type(e).__name__} out of {call}: {e}")
                raise
            if rendezvous is not None:
                rendezvous.recovered()
            return out
        return calling
    return decorate


def refused_on_every_rank(init):
    """ShardedOptimizer's constructor: an argument refused on this rank alone, before the build met the other ranks
    (``lr=-1`` on one rank), is raised on every rank (``topology.refuse_build``), not left to the others' wait."""
    @functools.wraps(init)
    def checked(self, params, *args, **kwargs):
        try:
            init(self, params, *args, **kwargs)
        except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:
            if not self.__dict__.get("_met"):
                refuse_build(e, kwargs.get("process_group"), kwargs.get("mesh"))
            raise
    return checked
