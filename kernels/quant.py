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
fp32 (``SUM=True``: the reduction of a quantized all-to-all; one program per output tile reads every
chunk, the chunk count compiled in), rounded to nearest even into the output dtype.

Instructions per element are what bounds these kernels on a GPU (an H200 moves ~16 bytes per SM
clock: an int4 bf16 quantize has ~20 instructions per element to spend), so integers and floats
meet on the bits: the absmax and the non-finite test are one integer max of ``|x|``'s bits (Hopper
reduces it in one warp instruction), ``q`` is read off the bits of ``y + 1.5 * 2**23``, and decoded
values are ``2**23 + u`` built on the bits, less a constant: no float/int conversions, which run at a
quarter of the FP32 rate; int4 quantize reads element pairs as one word (``_load_pairs``); bf16 outputs
round on the bits (``round_fp32_to``: the GPU's own conversion would be fewer instructions but gives a NaN
other bits than the twins). Every value is the plain arithmetic's, bitwise equal to the torch twins'. One
fixed launch configuration, int64 offsets, no mul+add contraction.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .cast import launch_context, round_fp32_to

#: Elements per program (ROWS blocks of the block size).
TILE = 4096
NUM_WARPS = 4
#: Blocks with a largest magnitude below this are sent as zeros.
TINY = 2.0 ** -96
_TINY = tl.constexpr(TINY)  # (the kernels' copy of it)
_FLT_MAX_BITS = tl.constexpr(0x7F7FFFFF)  # the largest finite fp32's bits (a kernel reads globals only as constexpr)
_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + M - M rounds |x| < 2**22 to an integer, half to even
_BYTE_BITS = tl.constexpr(0x4B000080)  # 2**23's bits with bit 7 set: XOR-ing q mod 256 in gives 2**23 + q + 128's
_BYTE_MAGIC = tl.constexpr(8388736.0)  # 2**23 + 128
_NIBBLE_BITS = tl.constexpr(0x4B000000)  # 2**23's bits: OR-ing u in [0, 2**23) in gives 2**23 + u's bits
_NIBBLE_MAGIC = tl.constexpr(8388616.0)  # 2**23 + 8: (2**23 + u) - this = u - 8, an int4 nibble's value


@triton.jit
def _nan():
    return tl.full((), 0x7FC00000, tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def _scales(peak, QMAX: tl.constexpr):
    """(scale, inv, bad) of each block from its ``_peak``: 0 / 0 when tiny, NaN / 0 and bad when it holds a
    non-finite value."""
    bad = peak > _FLT_MAX_BITS
    absmax = tl.where(bad, 0, peak).to(tl.float32, bitcast=True)
    tiny = absmax < _TINY
    scale = tl.where(tiny, 0.0, tl.math.div_rn(absmax, tl.full(absmax.shape, QMAX, tl.float32)))
    inv = tl.where(tiny, 0.0, tl.math.div_rn(tl.full(absmax.shape, QMAX, tl.float32), tl.maximum(absmax, _TINY)))
    return tl.where(bad, _nan(), scale), tl.where(bad, 0.0, inv), bad


@triton.jit
def _peak(x):
    """Each row's largest ``|x|`` bits (int32): one integer reduction finds both the absmax and a non-finite
    element, as ``|x|``'s bits order as its values and inf's and NaN's are above ``_FLT_MAX_BITS``."""
    return tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)


@triton.jit
def _uniform(seed, index):
    """fp32 in [0, 1) on a 2**-24 grid: a 32-bit hash (lowbias32) of ``index`` (the element's place in the
    buffer, uint32: its low 32 bits) mixed with ``seed``, in uint32 arithmetic, which wraps as the twin's
    int64 arithmetic masked to 32 bits does (ops.quant.uniform_twin)."""
    h = index ^ (seed.to(tl.uint32) * 0x9E3779B1)
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x846CA68B
    h = h ^ (h >> 16)
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24


@triton.jit
def _rounded_bits(y, seed, index, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr, OFFSET: tl.constexpr):
    """int32 whose low 8 bits are ``OFFSET + q``, the integer of finite ``y`` (|y| < 2**22): ``q = rne(y)``
    or, with STOCHASTIC, ``clamp(floor(y + u), -QMAX, QMAX)`` with ``u = _uniform(seed, index)``.

    The integer is read off the bits of ``q + M + OFFSET`` (``M`` = 1.5 * 2**23: one unit per ulp) instead
    of a float-to-int conversion. To nearest there is no clamp: ``y = x * inv`` with ``|x| <= absmax`` and
    ``inv = rn(QMAX / absmax)`` is at most ``QMAX * (1 + 2**-24)`` rounded, below ``QMAX + 0.5``, so
    ``rne(y)`` is within [-QMAX, QMAX] (the twin's clamp never acts). ``floor(z)`` is ``rne(z)``, less one
    where that is above ``z``; clamping ``z`` first gives the clamped floor (the bounds are integers)."""
    if STOCHASTIC:
        z = y + _uniform(seed, index)
        z = tl.minimum(tl.maximum(z, -QMAX), QMAX)
        t = z + _RNE_MAGIC
        bits = t.to(tl.int32, bitcast=True) - tl.where((t - _RNE_MAGIC) > z, 1, 0)
    else:
        bits = (y + _RNE_MAGIC).to(tl.int32, bitcast=True)
    return bits + OFFSET


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, n, nb, q_bytes, chunk_words, q_words, seed,
                     BITS: tl.constexpr, BLOCK_Q: tl.constexpr, ROWS: tl.constexpr, STOCHASTIC: tl.constexpr,
                     PAIRED: tl.constexpr):
    """int4: PAIRED loads elements 2i and 2i + 1 as one word (even ``n``, ``x`` aligned to two elements);
    else one contiguous load split in registers, which lays each thread's elements over more rows."""
    QMAX: tl.constexpr = 127 if BITS == 8 else 7
    chunk = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    idx = rows[:, None] * BLOCK_Q + tl.arange(0, BLOCK_Q)[None, :]
    q_base = q_ptr + chunk * chunk_words * 4
    if BITS == 8:
        x = tl.load(x_ptr + chunk * n + idx, mask=idx < n, other=0.0).to(tl.float32)
        scale, inv, bad = _scales(_peak(x), QMAX)
        y = tl.where(bad[:, None], 0.0, x * inv[:, None])  # a bad block's finite elements: x * 0; all of it: 0
        index = (chunk * n + idx).to(tl.uint32) if STOCHASTIC else idx  # (only the stochastic hash reads it)
        q = _rounded_bits(y, seed, index, QMAX, STOCHASTIC, 0)
        tl.store(q_base + idx, q.to(tl.int8), mask=idx < n)  # the low byte: q in two's complement
    else:  # elements 2i and 2i + 1 side by side, in the shape of the bytes they make
        pair = rows[:, None] * (BLOCK_Q // 2) + tl.arange(0, BLOCK_Q // 2)[None, :]
        if PAIRED:
            lo, hi = _load_pairs(x_ptr, chunk * n, pair, pair < q_bytes)
        else:
            x = tl.load(x_ptr + chunk * n + idx, mask=idx < n, other=0.0).to(tl.float32)
            lo, hi = tl.split(tl.reshape(x, (ROWS, BLOCK_Q // 2, 2)))
        scale, inv, bad = _scales(tl.maximum(_peak(lo), _peak(hi)), QMAX)
        index = (chunk * n + 2 * pair).to(tl.uint32) if STOCHASTIC else pair
        q_lo = _rounded_bits(tl.where(bad[:, None], 0.0, lo * inv[:, None]), seed, index, QMAX, STOCHASTIC, 8)
        q_hi = _rounded_bits(tl.where(bad[:, None], 0.0, hi * inv[:, None]), seed, index + 1, QMAX, STOCHASTIC, 8)
        byte = (q_lo & 15) | (q_hi << 4)  # low nibbles: q + 8 in [1, 15]
        tl.store(q_base + pair, byte.to(tl.uint8), mask=pair < q_bytes)
    tl.store(s_ptr + chunk * chunk_words + q_words + rows, scale, mask=rows < nb)


@triton.jit
def _load_pairs(x_ptr, start, pair, mask):
    """fp32 values of elements ``start + 2 * pair`` and the next (0 where masked), loaded as one word each:
    64-bit for fp32, 32-bit for bf16 / fp16 (``start`` even, ``x_ptr`` aligned to two elements)."""
    if x_ptr.dtype.element_ty == tl.float32:
        w = tl.load((x_ptr + start).to(tl.pointer_type(tl.int64)) + pair, mask=mask, other=0)
        lo = w.to(tl.int32).to(tl.float32, bitcast=True)  # the low word: the element at the lower address
        hi = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    else:
        w = tl.load((x_ptr + start).to(tl.pointer_type(tl.uint32)) + pair, mask=mask, other=0)
        lo = w.to(tl.uint16).to(x_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.uint16).to(x_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _decode_chunk(q_ptr, s_ptr, chunk, rows, n, nb, q_bytes, chunk_words, q_words,
                  BITS: tl.constexpr, BLOCK_Q: tl.constexpr, ROWS: tl.constexpr):
    """fp32 values of one chunk's rows of blocks (a [ROWS, BLOCK_Q] tile; 0 past ``n``).

    Integers become floats on their bits (exact, no int-to-float conversion): an int8 ``q`` (byte ``u``) is
    ``(2**23's bits | (u ^ 128)) - (2**23 + 128)``, an int4 nibble ``u`` is ``(2**23's bits | u) - (2**23 + 8)``."""
    words = chunk * chunk_words.to(tl.int64)  # int64 whatever type ``chunk`` has
    scale = tl.load(s_ptr + words + q_words + rows, mask=rows < nb, other=0.0)
    q_base = q_ptr + words * 4
    if BITS == 8:
        idx = rows[:, None] * BLOCK_Q + tl.arange(0, BLOCK_Q)[None, :]
        u = tl.load(q_base + idx, mask=idx < n, other=0).to(tl.uint8, bitcast=True).to(tl.int32)  # q mod 256
        val = ((u ^ _BYTE_BITS).to(tl.float32, bitcast=True) - _BYTE_MAGIC) * scale[:, None]
    else:
        pair = rows[:, None] * (BLOCK_Q // 2) + tl.arange(0, BLOCK_Q // 2)[None, :]
        byte = tl.load(q_base + pair, mask=pair < q_bytes, other=0x88).to(tl.int32)
        lo = ((byte & 15) | _NIBBLE_BITS).to(tl.float32, bitcast=True) - _NIBBLE_MAGIC
        hi = ((byte >> 4) | _NIBBLE_BITS).to(tl.float32, bitcast=True) - _NIBBLE_MAGIC
        val = tl.reshape(tl.join(lo * scale[:, None], hi * scale[:, None]), (ROWS, BLOCK_Q))
    return val


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, out_ptr, n, nb, q_bytes, chunk_words, q_words,
                       BITS: tl.constexpr, BLOCK_Q: tl.constexpr, ROWS: tl.constexpr, SUM: tl.constexpr,
                       CHUNKS: tl.constexpr):
    """Every chunk (SUM False: one program per tile and chunk, CHUNKS unused) or the sum of the CHUNKS
    chunks (one program per output tile reading all of them; the loop unrolled, its loads in flight). The
    sum starts from chunk 0's values where the twin adds them to zeros: the same, as no decoded value is -0
    (q = 0 decodes to +0, and scales are positive, 0 or NaN)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    idx = rows[:, None] * BLOCK_Q + tl.arange(0, BLOCK_Q)[None, :]
    if SUM:
        acc = _decode_chunk(q_ptr, s_ptr, 0, rows, n, nb, q_bytes, chunk_words, q_words, BITS, BLOCK_Q, ROWS)
        for c in tl.static_range(1, CHUNKS):
            acc = acc + _decode_chunk(q_ptr, s_ptr, c, rows, n, nb, q_bytes, chunk_words, q_words, BITS, BLOCK_Q, ROWS)
        tl.store(out_ptr + idx, round_fp32_to(acc, out_ptr.dtype.element_ty), mask=idx < n)
    else:
        chunk = tl.program_id(1).to(tl.int64)
        val = _decode_chunk(q_ptr, s_ptr, chunk, rows, n, nb, q_bytes, chunk_words, q_words, BITS, BLOCK_Q, ROWS)
        tl.store(out_ptr + chunk * n + idx, round_fp32_to(val, out_ptr.dtype.element_ty), mask=idx < n)


def _rows(block: int) -> int:
    return max(1, TILE // block)


def quantize(x, q, scales, *, n: int, chunks: int, chunk_words: int, q_words: int, bits: int, block: int,
             seed: int | None = None):
    """Launch: encode ``chunks`` runs of ``n`` elements of ``x`` into the payload (``q``: its int8 or uint8
    view, ``scales``: its fp32 view); ``seed``: stochastic rounding. Arguments are validated by ops."""
    if n == 0 or chunks == 0:
        return
    nb, q_bytes = -(-n // block), n if bits == 8 else (n + 1) // 2
    rows = _rows(block)
    paired = bits == 4 and n % 2 == 0 and x.data_ptr() % (2 * x.element_size()) == 0
    with launch_context(x.device):
        _quantize_kernel[(-(-nb // rows), chunks)](
            x, q, scales, n, nb, q_bytes, chunk_words, q_words, 0 if seed is None else seed, BITS=bits, BLOCK_Q=block,
            ROWS=rows, STOCHASTIC=seed is not None, PAIRED=paired, num_warps=NUM_WARPS, enable_fp_fusion=False)


def dequantize(q, scales, out, *, n: int, chunks: int, chunk_words: int, q_words: int, bits: int, block: int,
               sum_chunks: bool):
    """Launch: decode the payload into ``out`` (every chunk, or their sum: one program per output tile, the
    chunk count compiled in). Arguments are validated by ops."""
    if n == 0 or chunks == 0:
        return
    nb, q_bytes = -(-n // block), n if bits == 8 else (n + 1) // 2
    rows = _rows(block)
    tiles = -(-nb // rows)
    with launch_context(out.device):
        _dequantize_kernel[(tiles,) if sum_chunks else (tiles, chunks)](
            q, scales, out, n, nb, q_bytes, chunk_words, q_words, BITS=bits, BLOCK_Q=block, ROWS=rows, SUM=sum_chunks,
            CHUNKS=chunks if sum_chunks else 1, num_warps=NUM_WARPS, enable_fp_fusion=False)
