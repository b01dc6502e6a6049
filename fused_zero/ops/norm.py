"""``norm_stats`` / ``norm_stats_many``: squared L2 norm and a non-finite flag.

Backends: ``triton`` (``fused_zero.kernels.norm``: one read, a fixed-order
two-stage reduction) and ``torch`` (the twin below). Both have the launcher's
signature ``(tensors, sq_out, nf_out)``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import _backend
from ._checks import FLOATS, check_flat, check_no_overlap, check_same_device


class NormStats(NamedTuple):
    """Squared L2 norm (fp32 accumulation) and a non-finite flag (1.0 / 0.0).

    Both are 0-d fp32 tensors on the input's device. ``sq_sum`` may be inf for
    finite inputs whose squares overflow; ``nonfinite`` is 1.0 only when an
    element itself is inf or NaN.
    """

    sq_sum: torch.Tensor
    nonfinite: torch.Tensor


def norm_stats_many(tensors, *, out: NormStats | None = None) -> NormStats:
    """Sum of squares (fp32 accumulation) and a non-finite flag over flat buffers.

    ``tensors``: fp32/bf16/fp16 1-D contiguous buffers on one device. Returns
    NormStats(sq_sum, nonfinite) as 0-d fp32 tensors on that device (written into
    ``out`` when given). One read of each buffer, a fixed-order two-stage
    reduction: bitwise the same on every run.
    """
    if isinstance(tensors, torch.Tensor):
        raise TypeError("norm_stats_many takes a list of flat buffers; use norm_stats(x) for one")
    tensors = list(tensors)
    if not tensors and out is None:
        raise ValueError("norm_stats_many needs at least one tensor, or out= to write zeros into")
    for i, x in enumerate(tensors):
        check_flat(f"tensors[{i}]", x, FLOATS)
        check_same_device("tensors[0]", tensors[0], **{f"tensors[{i}]": x})
    device = tensors[0].device if tensors else out[0].device
    if out is None:
        out = NormStats(torch.empty((), dtype=torch.float32, device=device),
                        torch.empty((), dtype=torch.float32, device=device))
    else:
        _check_out(out, device)
        out = NormStats(*out)
    _backend.implementation("norm", device)(tensors, out.sq_sum, out.nonfinite)
    return out


def norm_stats(x, *, out: NormStats | None = None) -> NormStats:
    """``norm_stats_many([x])``: squared L2 norm and non-finite flag of one flat buffer."""
    check_flat("x", x, FLOATS)
    return norm_stats_many([x], out=out)


def _check_out(out, device: torch.device) -> None:
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError("out must be a NormStats(sq_sum, nonfinite) of 0-d fp32 tensors")
    for name, t in zip(("out.sq_sum", "out.nonfinite"), out):
        if not isinstance(t, torch.Tensor) or t.dim() != 0 or t.dtype != torch.float32:
            raise TypeError(f"{name} must be a 0-d fp32 tensor; allocate torch.empty((), "
                            "dtype=torch.float32)")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the input is on {device}; "
                             f"allocate it on {device}")
    check_no_overlap(**{"out.sq_sum": out[0], "out.nonfinite": out[1]})


def norm_stats_twin(tensors, sq_out: torch.Tensor, nf_out: torch.Tensor) -> None:
    """Twin of ``kernels.norm.norm_stats_into``: sum of squares and non-finite flag."""
    sq = torch.zeros((), dtype=torch.float32, device=sq_out.device)
    bad = torch.zeros((), dtype=torch.bool, device=sq_out.device)
    for x in tensors:
        if x.numel() == 0:
            continue
        x32 = x.to(torch.float32)
        sq = sq + torch.sum(x32 * x32)  # torch's cascade sum: fp32, accurate, deterministic
        bad = bad | ~torch.isfinite(x).all()
    sq_out.copy_(sq)
    nf_out.copy_(bad)


_backend.register("norm", triton=_backend.kernel("norm", "norm_stats_into"), torch=norm_stats_twin)
