"""``cast_``: fp32 -> bf16 / fp16 / fp32, round to nearest even or stochastic.

Backends: ``triton`` (``fused_zero.kernels.cast``) and ``torch`` (the twin
below), both with the signature ``(src, dst, *, stochastic, seed)``.
"""
from __future__ import annotations

import torch

from . import _backend
from ._checks import (F32, FLOATS, check_bool, check_flat, check_no_overlap, check_same_device,
                      check_same_numel)


def cast_(src, dst, *, stochastic: bool = False, seed: int = 0):
    """``dst[:] = src`` rounded to ``dst.dtype``; returns ``dst``.

    src: fp32, flat and contiguous. dst: bf16, fp16 or fp32 (a plain copy), as
    many elements, same device. Round to nearest even (bitwise equal to
    ``src.to(dst.dtype)``; NaN stays NaN), or with ``stochastic=True`` (bf16
    only) round up with probability equal to the distance from the lower bf16
    neighbour, drawing bits from Philox with the integer ``seed``:
    deterministic per seed, unbiased in expectation.
    """
    check_flat("src", src, F32)
    check_flat("dst", dst, FLOATS)
    check_same_numel("src", src, dst=dst)
    check_same_device("src", src, dst=dst)
    check_no_overlap(src=src, dst=dst)
    check_bool("stochastic", stochastic)
    if stochastic and dst.dtype != torch.bfloat16:
        raise ValueError(
            f"stochastic rounding supports a bfloat16 dst only, got {dst.dtype}; "
            "pass stochastic=False for round-to-nearest-even"
        )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    return _backend.implementation("cast", src.device)(src, dst, stochastic=stochastic, seed=seed)


def cast_twin(src: torch.Tensor, dst: torch.Tensor, *, stochastic: bool = False,
              seed: int = 0) -> torch.Tensor:
    """Twin of ``kernels.cast.cast``: ``dst[:] = src`` rounded to nearest even, or
    stochastically to bf16 (torch's generator, not the kernel's Philox bits)."""
    if not stochastic:
        return dst.copy_(src)
    gen = torch.Generator(device=src.device)
    gen.manual_seed(seed)
    rand = torch.randint(0, 1 << 16, src.shape, generator=gen, device=src.device, dtype=torch.int32)
    bits = src.view(torch.int32)
    # Add 16 random bits below the kept mantissa of the magnitude of finite
    # values, then cut: rounds up with probability (distance to the lower
    # neighbour) / ulp. int32 cannot overflow: finite magnitudes are < 0x7F800000.
    mag = bits & 0x7FFFFFFF
    rand.masked_fill_(mag >= 0x7F800000, 0)  # inf and NaN: no random carry
    mag.add_(rand).bitwise_right_shift_(16)
    out = torch.where(bits < 0, mag - 0x8000, mag)  # sign bit set, as an int16
    out.masked_fill_(mag > 0x7F80, -1)  # NaN -> 0xFFFF, as the kernel writes it
    dst.view(torch.int16).copy_(out)
    return dst


_backend.register("cast", triton=_backend.kernel("cast", "cast"), torch=cast_twin)
