"""Squared L2 norm and non-finite detection in one pass, deterministic.

Stage 1: a grid of at most ``MAX_PARTIALS`` programs, its size fixed by the
buffer's length alone; program ``i`` walks tiles ``i, i + grid, ...``, keeps a
BLOCK-wide fp32 accumulator of squares and of a non-finite flag, and writes
one partial of each. Stage 2: one program reduces all partials (of every
buffer in the call) in a fixed order. No atomics: the same inputs give the
same bits on every run, on every GPU.

Non-finite is read off the exponent bits (all ones = inf or NaN), so finite
values whose squares overflow to inf do not count as non-finite.
Arguments are validated by ``fused_zero.ops``; the launchers trust them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096
NUM_WARPS = 8
MAX_PARTIALS = 2048
REDUCE_BLOCK = 1024


@triton.jit
def _square_and_flag(x, acc, bad):
    x = x.to(tl.float32)
    exp_bits = x.to(tl.uint32, bitcast=True) & 0x7F800000
    return acc + x * x, tl.maximum(bad, (exp_bits == 0x7F800000).to(tl.int32))


@triton.jit
def _norm_partials_kernel(x_ptr, sq_ptr, nf_ptr, n, full_tiles, tail_owner, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    # Full tiles, unmasked (a mask on an n that is not a multiple of 16 would make
    # every vector load scalar); int64 offsets for more than 2**31 elements.
    for tile in range(pid, full_tiles, nprog):
        offs = tl.cast(tile, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        acc, bad = _square_and_flag(tl.load(x_ptr + offs), acc, bad)
    # The partial last tile: loaded by one program, an empty mask for the others.
    offs = tl.cast(full_tiles, tl.int64) * BLOCK + tl.arange(0, BLOCK)
    limit = tl.where(pid == tail_owner, n, 0)
    acc, bad = _square_and_flag(tl.load(x_ptr + offs, mask=offs < limit, other=0.0), acc, bad)
    tl.store(sq_ptr + pid, tl.sum(acc, axis=0))
    tl.store(nf_ptr + pid, tl.max(bad, axis=0).to(tl.float32))


@triton.jit
def _norm_finish_kernel(sq_ptr, nf_ptr, n_parts, sq_out, nf_out, RBLOCK: tl.constexpr):
    acc = tl.zeros([RBLOCK], dtype=tl.float32)
    bad = tl.zeros([RBLOCK], dtype=tl.float32)
    for start in range(0, n_parts, RBLOCK):
        offs = start + tl.arange(0, RBLOCK)
        mask = offs < n_parts
        acc += tl.load(sq_ptr + offs, mask=mask, other=0.0)
        bad = tl.maximum(bad, tl.load(nf_ptr + offs, mask=mask, other=0.0))
    tl.store(sq_out, tl.sum(acc, axis=0))
    tl.store(nf_out, tl.max(bad, axis=0))


def num_partials(numel: int) -> int:
    """Stage-1 grid size for a buffer of ``numel`` elements (a function of numel only)."""
    return min(triton.cdiv(numel, BLOCK), MAX_PARTIALS)


def norm_stats_into(tensors, sq_out: torch.Tensor, nf_out: torch.Tensor) -> None:
    """Write the sum of squares and the non-finite flag of all ``tensors`` into the
    0-d fp32 tensors ``sq_out`` and ``nf_out`` (all on one device)."""
    grids = [num_partials(x.numel()) for x in tensors]
    total = sum(grids)
    parts = torch.empty(2 * max(total, 1), dtype=torch.float32, device=sq_out.device)
    sq_parts, nf_parts = parts[: max(total, 1)], parts[max(total, 1):]
    offset = 0
    for x, grid in zip(tensors, grids):
        if grid == 0:
            continue
        full_tiles = x.numel() // BLOCK
        _norm_partials_kernel[(grid,)](
            x, sq_parts[offset:], nf_parts[offset:], x.numel(), full_tiles, full_tiles % grid,
            BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=True,  # fma: a more exact acc
        )
        offset += grid
    _norm_finish_kernel[(1,)](sq_parts, nf_parts, total, sq_out, nf_out,
                              RBLOCK=REDUCE_BLOCK, num_warps=4, enable_fp_fusion=True)
