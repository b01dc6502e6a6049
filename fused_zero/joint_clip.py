"""``fused_zero.clip_grad_norm_``: one global norm over the gradients of several ShardedOptimizers.

torch clips several models together with ``torch.nn.utils.clip_grad_norm_(list(a.parameters()) +
list(b.parameters()), m)``: one norm over all of them, one factor for all. A ShardedOptimizer holds its
averaged gradients in its shards (stages 2-3; stage 1 keeps each rank's local ``.grad``), so torch's clip
cannot see them, and each optimizer's own ``clip_grad_norm_(m)`` clips to its own norm: another result.
Here each optimizer measures its global norm first (``clip_grad_norm_(inf)``: measured, nothing scaled),
the norms combine into the total on the device, and each optimizer is then clipped to its share of
``max_norm`` (``(its norm + 1e-6) * min(1, max_norm / (total + 1e-6))``: its own clip divides by its norm
+ 1e-6), which scales every gradient by torch's one factor, also where nothing is clipped. Each
optimizer's second call measures what its first left (``ClipMethods.clip_grad_norm_``).

Optimizers over different ranks (expert parallelism, as DeepSpeed's MoE and Megatron run it: the dense parameters
over every data-parallel rank, each expert's over its own smaller group): each optimizer's norm is agreed inside
its own ranks only, and each of its groups holds other parameters (another expert). The total is then summed
over the ranks that the widest optimizer spans, each optimizer's square counted once per group
(``sum over the ranks of norm**2 / the size of its group``, groups of any sizes): the dense norm once plus every
expert's, the same on every rank, as Megatron's and DeepSpeed's global norm. Refused before any collective where no
optimizer spans the ranks of all the others (every rank must find the same widest optimizer: the dense one).
"""
from __future__ import annotations

import math

import torch

from .clipping import _check_clip_args
from .host_read import to_host


def clip_grad_norm_(optimizers, max_norm: float, norm_type: float = 2.0, grad_scaler=None, *,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of every optimizer in ``optimizers`` (ShardedOptimizers, each called on every rank) to
    one total 2-norm ``max_norm``, as torch's clip over all of their parameters; return the total norm.

    Two clip calls per optimizer (two all-reduces each); with ``error_if_nonfinite=True`` or on a GPU the shares
    are read on the host once per optimizer (their agreement among ranks)."""
    from .optimizer import ShardedOptimizer
    _check_clip_args(max_norm, norm_type)  # (every rank alike, before any collective)
    opts = [optimizers] if isinstance(optimizers, ShardedOptimizer) else list(optimizers)
    if not opts or not all(isinstance(o, ShardedOptimizer) for o in opts):
        raise TypeError("fused_zero.clip_grad_norm_ takes ShardedOptimizers (an iterable of them), got "
                        f"{[type(o).__name__ for o in opts]}: clip a torch optimizer's parameters with "
                        "torch.nn.utils.clip_grad_norm_, or one ShardedOptimizer with its own clip_grad_norm_")
    if len({id(o) for o in opts}) != len(opts):
        raise ValueError("fused_zero.clip_grad_norm_ was given the same optimizer twice: list each once")
    # measured, nothing scaled; a GradScaler not known to an optimizer yet is looked for above this call
    spans = [o.topology.span() for o in opts]
    widest = _widest(spans)  # (refused before any collective)
    norms = [o.clip_grad_norm_(math.inf, norm_type, grad_scaler, _caller_frames=1).float().reshape(()) for o in opts]
    union = spans[widest]
    whole = [n for n, span in zip(norms, spans) if span == union]  # the same on every rank: added here
    total = torch.linalg.vector_norm(torch.stack(whole))
    if len(union) > 1:  # every rank joins, with or without optimizers over fewer ranks (another rank may have some)
        parts = [n.square() / len(span) for n, span in zip(norms, spans) if span != union]
        squares = torch.stack(parts).sum() if parts else torch.zeros((), device=total.device)
        opts[widest].topology.all_reduce(squares)
        total = torch.where(squares == 0, total, (total.square() + squares).sqrt())  # (no host read)
    if error_if_nonfinite and not math.isfinite(to_host(total, "clip_grad_norm_(error_if_nonfinite=True)")):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for o, n in zip(opts, norms):  # its own clip divides by its norm + 1e-6: what it is given carries that back
        o.clip_grad_norm_((n + 1e-6) * coef, norm_type, grad_scaler, _caller_frames=1)
    return total


def _widest(spans: list[tuple[int, ...]]) -> int:
    """Which optimizer spans the ranks of all the others (the first such); ValueError where none does."""
    widest = max(range(len(spans)), key=lambda i: len(spans[i]))
    union = set(spans[widest])
    if any(not union.issuperset(span) for span in spans):
        raise ValueError(
            "fused_zero.clip_grad_norm_ over optimizers on different ranks needs one of them to span the ranks of "
            f"all the others (expert parallelism: the dense optimizer over every data-parallel rank, each expert's "
            f"over its own group); got optimizers over the "
            f"global ranks {[list(span) for span in spans]}: clip each optimizer with its own clip_grad_norm_, or "
            "pass optimizers over nested groups")
    return widest
