"""fp32 -> bf16 / fp16 / fp32 casting kernel, round-to-nearest-even or stochastic.

bf16 is rounded on the fp32 bits (``rounding.to_bf16_rne``) because the Triton
interpreter truncates ``.to(tl.bfloat16)``. fp32 -> fp16 uses ``.to(tl.float16)``
with explicit ``rtne`` rounding: on GPU that is ``cvt.rn.f16.f32`` and under the
interpreter a numpy ``astype``, which rounds to nearest even too (checked
bitwise against torch on random bit patterns, ties and subnormals in
tests/test_cast.py).

Stochastic rounding (bf16 only) draws one Philox ``tl.randint(seed, i)`` per
element ``i``: a given seed gives the same bits for any launch configuration.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .rounding import bf16_bits_stochastic, to_bf16_rne

#: Elements per program; every element is read once and written once.
BLOCK = 2048
NUM_WARPS = 4


@triton.jit
def round_fp32_to(x, DST: tl.constexpr):
    """fp32 ``x`` rounded to nearest even in dtype ``DST`` (fp32, bf16 or fp16)."""
    if DST == tl.bfloat16:
        y = to_bf16_rne(x)
    elif DST == tl.float16:
        y = x.to(tl.float16, fp_downcast_rounding="rtne")
    else:
        y = x
    return y


@triton.jit
def _cast_kernel(src_ptr, dst_ptr, n, seed, STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs, mask=mask)
    if STOCHASTIC:
        bits = bf16_bits_stochastic(x, tl.randint(seed, offs))
        y = bits.to(tl.bfloat16, bitcast=True)
    else:
        y = round_fp32_to(x, dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + offs, y, mask=mask)


def launch_context(device: torch.device):
    """Where a launch for tensors on ``device`` runs.

    CUDA: that device (Triton launches on the current device's current
    stream). CPU tensors reach Triton only under TRITON_INTERPRET=1, where an
    fp32 -> fp16 cast is a numpy ``astype`` that warns 'overflow encountered
    in cast' when a finite fp32 rounds to inf (the inf is right): silenced.
    """
    if device.type == "cuda":
        return torch.cuda.device(device)
    return np.errstate(over="ignore", invalid="ignore")


def cast(src: torch.Tensor, dst: torch.Tensor, *, stochastic: bool = False, seed: int = 0) -> torch.Tensor:
    """Launch: ``dst[:] = src`` rounded to ``dst.dtype``. Arguments are validated by ops."""
    n = src.numel()
    if n == 0:
        return dst
    grid = (triton.cdiv(n, BLOCK),)
    with launch_context(src.device):
        _cast_kernel[grid](src, dst, n, seed, STOCHASTIC=stochastic, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return dst
