"""Block-wise absmax quantization to int8 / int4 and back: the communication codecs' kernels.

A flat buffer of ``chunks * n`` elements is cut into ``chunks`` runs of ``n`` (one per peer of a
collective), and each run into blocks of ``BLOCK_Q`` elements (the last one short). Each chunk is
encoded into a payload of its own (``fused_zero.ops.quant.payload_bytes``): the quantized values
(int8: one byte each; int4: two per byte, element 2i in the low nibble, stored as q + 8), padded to
a multiple of 4 bytes, then one fp32 scale per block. Arithmetic per block, in fp32:

    absmax = max |x| over the block's finite elements
    scale  = absmax / QMAX,  inv = QMAX / absmax      (div_rn: correctly rounded, as torch's ``/``)
    q      = clamp(rne(x * inv), -QMAX, QMAX)         (QMAX = 127, or 7 for int4)
             or, rounding stochastically (a ``seed``), clamp(floor(x * inv + u), -QMAX, QMAX) with u in [0, 1)
             a hash of the seed and the element's index (``_uniform``): unbiased, and reproducible
    x'     = q * scale

``rne`` is the explicit round-half-to-even of fp32 values below 2**22 (add and subtract 1.5 * 2**23),
exact in the interpreter and on a GPU. A block whose absmax is below ``TINY`` is sent as zeros (scale 0;
keeps ``inv`` finite, no subnormal arithmetic that a GPU could flush), and a block holding an inf or
a NaN as q = 0 with a NaN scale: it decodes to NaN throughout, so an overflow stays visible to the
optimizer's non-finite checks (GradScaler) instead of turning into finite values.

Decoding writes every chunk (``SUM=False``) or the sum of the chunks in chunk order, accumulated in
fp32 (``SUM=True``: the reduction of a quantized all-to-all), rounded to nearest even into the output
dtype. One fixed launch configuration, int64 offsets, no mul+add contraction.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .cast import launch_context, round_fp32_to

#: Elements per program (ROWS blocks of the block size).
TILE = 2048
NUM_WARPS = 4
#: Blocks with a largest magnitude below this are sent as zeros.
TINY = 2.0 ** -96
_TINY = tl.constexpr(TINY)  # (the kernels' copy of it)
_FLT_MAX = tl.constexpr(3.4028234663852886e38)  # (a kernel reads globals only as constexpr)
_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + M - M rounds |x| < 2**22 to an integer, half to even


@triton.jit
def _nan():
    return tl.full((), 0x7FC00000, tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def _scales(absmax, bad, QMAX: tl.constexpr):
    """(scale, inv) of each block: 0 / 0 when tiny, NaN / 0 when it holds a non-finite value."""
    tiny = absmax < _TINY
    scale = tl.where(tiny, 0.0, tl.math.div_rn(absmax, tl.full(absmax.shape, QMAX, tl.float32)))
    inv = tl.where(tiny, 0.0, tl.math.div_rn(tl.full(absmax.shape, QMAX, tl.float32), tl.maximum(absmax, _TINY)))
    return tl.where(bad, _nan(), scale), tl.where(bad, 0.0, inv)


@triton.jit
def _uniform(seed, index):
    """fp32 in [0, 1) on a 2**-24 grid: a 32-bit hash (lowbias32) of ``index`` (the element's place in the
    buffer) mixed with ``seed``, in uint64 arithmetic masked to 32 bits (ops.quant.uniform_twin)."""
    h = (index.to(tl.uint64) ^ (seed.to(tl.uint64) * 0x9E3779B1)) & 0xFFFFFFFF
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & 0xFFFFFFFF
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & 0xFFFFFFFF
    h = h ^ (h >> 16)
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24


@triton.jit
def _quant(x, fin, inv, seed, index, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr):
    """The integers of ``x`` (int32), given each row's ``inv``: rounded to nearest even, or with STOCHASTIC
    to ``floor(y + u)`` with ``u = _uniform(seed, index)``."""
    y = tl.where(fin, x * inv[:, None], 0.0)
    if STOCHASTIC:
        r = tl.floor(y + _uniform(seed, index))
    else:
        r = (y + _RNE_MAGIC) - _RNE_MAGIC
    r = tl.minimum(tl.maximum(r, -QMAX), QMAX)
    return r.to(tl.int32)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, n, nb, chunk_words, q_words, seed,
                     BITS: tl.constexpr, BLOCK_Q: tl.constexpr, ROWS: tl.constexpr, STOCHASTIC: tl.constexpr):
    QMAX: tl.constexpr = 127 if BITS == 8 else 7
    chunk = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    x_base = x_ptr + chunk * n
    q_base = q_ptr + chunk * chunk_words * 4
    if BITS == 8:
        idx = rows[:, None] * BLOCK_Q + tl.arange(0, BLOCK_Q)[None, :]
        x = tl.load(x_base + idx, mask=idx < n, other=0.0).to(tl.float32)
        fin = tl.abs(x) <= _FLT_MAX
        absmax = tl.max(tl.where(fin, tl.abs(x), 0.0), axis=1)
        bad = tl.max(tl.where(fin, 0, 1), axis=1) > 0
        scale, inv = _scales(absmax, bad, QMAX)
        q = _quant(x, fin, inv, seed, chunk * n + idx, QMAX, STOCHASTIC)
        tl.store(q_base + idx, q.to(tl.int8), mask=idx < n)
    else:
        pair = rows[:, None] * (BLOCK_Q // 2) + tl.arange(0, BLOCK_Q // 2)[None, :]
        lo = tl.load(x_base + 2 * pair, mask=2 * pair < n, other=0.0).to(tl.float32)
        hi = tl.load(x_base + 2 * pair + 1, mask=2 * pair + 1 < n, other=0.0).to(tl.float32)
        fin_lo = tl.abs(lo) <= _FLT_MAX
        fin_hi = tl.abs(hi) <= _FLT_MAX
        absmax = tl.maximum(tl.max(tl.where(fin_lo, tl.abs(lo), 0.0), axis=1),
                            tl.max(tl.where(fin_hi, tl.abs(hi), 0.0), axis=1))
        bad = tl.max(tl.where(fin_lo & fin_hi, 0, 1), axis=1) > 0
        scale, inv = _scales(absmax, bad, QMAX)
        byte = ((_quant(lo, fin_lo, inv, seed, chunk * n + 2 * pair, QMAX, STOCHASTIC) + 8)
                | ((_quant(hi, fin_hi, inv, seed, chunk * n + 2 * pair + 1, QMAX, STOCHASTIC) + 8) << 4))
        tl.store(q_base + pair, byte.to(tl.uint8), mask=2 * pair < n)
    tl.store(s_ptr + chunk * chunk_words + q_words + rows, scale, mask=rows < nb)


@triton.jit
def _decode_chunk(q_ptr, s_ptr, chunk, rows, n, nb, chunk_words, q_words,
                  BITS: tl.constexpr, BLOCK_Q: tl.constexpr):
    """fp32 values of one chunk's rows of blocks (a [ROWS, BLOCK_Q] tile; 0 past ``n``)."""
    words = chunk * chunk_words.to(tl.int64)  # int64 whatever type the loop index has
    scale = tl.load(s_ptr + words + q_words + rows, mask=rows < nb, other=0.0)
    idx = rows[:, None] * BLOCK_Q + tl.arange(0, BLOCK_Q)[None, :]
    q_base = q_ptr + words * 4
    if BITS == 8:
        q = tl.load(q_base + idx, mask=idx < n, other=0).to(tl.int32)
    else:
        byte = tl.load(q_base + idx // 2, mask=idx < n, other=0x88).to(tl.int32)
        q = tl.where((idx % 2) == 0, byte & 15, byte >> 4) - 8
    return q.to(tl.float32) * scale[:, None], idx


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, out_ptr, n, nb, chunk_words, q_words, chunks,
                       BITS: tl.constexpr, BLOCK_Q: tl.constexpr, ROWS: tl.constexpr, SUM: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    if SUM:
        acc = tl.zeros((ROWS, BLOCK_Q), tl.float32)
        idx = rows[:, None] * BLOCK_Q + tl.arange(0, BLOCK_Q)[None, :]
        for c in range(0, chunks):
            val, idx = _decode_chunk(q_ptr, s_ptr, c, rows, n, nb, chunk_words, q_words,
                                     BITS, BLOCK_Q)
            acc = acc + val
        tl.store(out_ptr + idx, round_fp32_to(acc, out_ptr.dtype.element_ty), mask=idx < n)
    else:
        chunk = tl.program_id(1).to(tl.int64)
        val, idx = _decode_chunk(q_ptr, s_ptr, chunk, rows, n, nb, chunk_words, q_words, BITS, BLOCK_Q)
        tl.store(out_ptr + chunk * n + idx, round_fp32_to(val, out_ptr.dtype.element_ty), mask=idx < n)


def _rows(block: int) -> int:
    return max(1, TILE // block)


def quantize(x, q, scales, *, n: int, chunks: int, chunk_words: int, q_words: int, bits: int, block: int,
             seed: int | None = None):
    """Launch: encode ``chunks`` runs of ``n`` elements of ``x`` into the payload (``q``: its int8 or uint8
    view, ``scales``: its fp32 view); ``seed``: stochastic rounding. Arguments are validated by ops."""
    nb = triton.cdiv(n, block)
    if n == 0 or chunks == 0:
        return
    rows = _rows(block)
    with launch_context(x.device):
        _quantize_kernel[(triton.cdiv(nb, rows), chunks)](
            x, q, scales, n, nb, chunk_words, q_words, 0 if seed is None else seed, BITS=bits, BLOCK_Q=block,
            ROWS=rows, STOCHASTIC=seed is not None, num_warps=NUM_WARPS, enable_fp_fusion=False)


def dequantize(q, scales, out, *, n: int, chunks: int, chunk_words: int, q_words: int, bits: int, block: int,
               sum_chunks: bool):
    """Launch: decode the payload into ``out`` (every chunk, or their sum). Arguments are validated by ops."""
    nb = triton.cdiv(n, block)
    if n == 0:
        return
    rows = _rows(block)
    grid = (triton.cdiv(nb, rows),) if sum_chunks else (triton.cdiv(nb, rows), chunks)
    if not sum_chunks and chunks == 0:
        return
    with launch_context(out.device):
        _dequantize_kernel[grid](q, scales, out, n, nb, chunk_words, q_words, chunks, BITS=bits, BLOCK_Q=block,
                                 ROWS=rows, SUM=sum_chunks, num_warps=NUM_WARPS, enable_fp_fusion=False)
