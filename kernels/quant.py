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
values are ``2**(23 - k) + u`` built on the bits with the field ``u`` left in place at bit ``k`` (one LOP3 a
value, ``_field``), less a constant: no float/int conversions, which run at a quarter of the FP32 rate;
int4 quantize reads element pairs as one word (``_load_pairs``); decoding reads the payload one integer a
thread holding the values it stores (each chunk) or 128 bits a load (the sum), so that no value crosses
threads but the sum, once; bf16 outputs round on the bits (``_to_out``, as ``round_fp32_to``: the GPU's own
conversion would be fewer instructions but gives a NaN other bits than the twins). Every value is the plain
arithmetic's, bitwise equal to the torch twins'. One fixed launch configuration, int64 bases (int32 offsets
within a tile), no mul+add contraction.
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
_MAGIC = 0x4B000000  # 2**23's bits: the decode kernel's ``magic`` argument (an immediate would be folded)


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
        q_lo = _rounded_bits(lo * inv[:, None], seed, index, QMAX, STOCHASTIC, 8)
        q_hi = _rounded_bits(hi * inv[:, None], seed, index + 1, QMAX, STOCHASTIC, 8)
        # low nibbles: q + 8 in [1, 15]; a bad block's (x * 0: NaN at its inf / NaN) made q = 0 by a mask a row
        keep = tl.where(bad, 0, 255)[:, None]
        fill = tl.where(bad, 0x88, 0)[:, None]
        byte = (((q_lo & 15) | (q_hi << 4)) & keep) | fill
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
def _field(w, magic, SHIFT: tl.constexpr, BIAS: tl.constexpr):
    """fp32 ``f - BIAS`` of the bit field of ``w`` at ``SHIFT`` (4 bits, or 8 with XOR-ed sign, ``SHIFT`` + width
    <= 23): the field's bits in place, OR-ed (XOR-ed) into the bits of 2**(23 - SHIFT), whose ulp is 2**-SHIFT,
    make the float 2**(23 - SHIFT) + field exactly; one LOP3 a value, no shift. ``magic``: 2**23's bits
    (0x4B000000), a kernel argument, so that ``(w & mask) | magic`` keeps one immediate (a LOP3 has one)."""
    m = magic - (SHIFT << 23)
    if BIAS == 8:
        bits = (w & (15 << SHIFT)) | m
    else:
        bits = (w & (255 << SHIFT)) ^ (m + (128 << SHIFT))  # (+: an or would be split off into a second LOP3)
    return bits.to(tl.float32, bitcast=True) - (2.0 ** (23 - SHIFT) + BIAS)


@triton.jit
def _interleave(v0, v1, v2, v3, v4, v5, v6, v7, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """[ROWS, WIDTH] from [ROWS, WIDTH // 8] (or // 4, from v0..v3: the rest None), element 8j + i (4j + i) from
    ``vi``'s j: joined in registers, each thread's elements stay its own."""
    if v4 is None:
        t = tl.join(tl.join(v0, v2), tl.join(v1, v3))
    else:
        t = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
    return tl.reshape(t, (ROWS, WIDTH))


@triton.jit
def _decode_chunk(q_ptr, s_ptr, chunk, row0, nb, chunk_words, q_words, magic,
                  BITS: tl.constexpr, BLOCK_Q: tl.constexpr, ROWS: tl.constexpr, UNIT: tl.constexpr):
    """fp32 values of one chunk's blocks ``row0`` on (a [ROWS, BLOCK_Q] tile; garbage past ``n``: masked by the caller).

    ``UNIT`` > 0 (each chunk decoded into its own output): the values are read ``UNIT`` at a time (the 16 bytes a
    thread stores: 4 fp32 or 8 bf16 / fp16), one integer of ``UNIT * BITS`` bits a thread (the payload is word
    aligned and its values padded to a word), so that the values joined from it are laid out as the store wants them
    (no exchange through shared memory). ``UNIT`` 0 (the sum): 32-bit words, 128 bits a load (one load and one scale
    a thread and chunk, few registers a chunk), and the sum crosses threads once, on its way to the store. Each
    value becomes a float on its bits in place (``_field``): an int8 ``q`` (byte ``u``) is 2**k + (u ^ 128) less
    2**k + 128, an int4 nibble ``u`` is 2**k + u less 2**k + 8, both exact; the fields at bits 16 and up are
    shifted down once a word. Offsets within the tile are int32, from int64 scalar bases."""
    words = chunk * chunk_words.to(tl.int64)  # int64 whatever type ``chunk`` has
    r = tl.arange(0, ROWS)
    rows_left = tl.minimum(nb - row0, ROWS).to(tl.int32)
    scale = tl.load(s_ptr + (words + q_words + row0) + r, mask=r < rows_left, other=0.0)[:, None]
    LOAD_BITS: tl.constexpr = 32 if UNIT == 0 else UNIT * BITS
    UNITS: tl.constexpr = BLOCK_Q * BITS // LOAD_BITS  # loads a block
    ty: tl.constexpr = tl.int16 if LOAD_BITS == 16 else (tl.int32 if LOAD_BITS == 32 else tl.int64)
    if LOAD_BITS == 16:  # loads reaching the values (a 64-bit one may end in a scale)
        units = q_words * 2
    elif LOAD_BITS == 32:
        units = q_words
    else:
        units = (q_words + 1) // 2
    left = tl.minimum(units - row0 * UNITS, 1 << 30).to(tl.int32)  # (a bound keeping units' divisibility by 16)
    local = r[:, None] * UNITS + tl.arange(0, UNITS)[None, :]
    if UNIT != 0:
        local = tl.max_contiguous(local, [1, 1])  # one load a thread
    base = (q_ptr + words * 4).to(tl.pointer_type(ty)) + row0 * UNITS
    w = tl.load(base + local, mask=local < left, other=0)
    if LOAD_BITS == 16:  # int4, 4 values
        w = w.to(tl.uint16, bitcast=True).to(tl.int32)
        val = _interleave(_field(w, magic, 0, 8) * scale, _field(w, magic, 4, 8) * scale,
                          _field(w, magic, 8, 8) * scale, _field(w, magic, 12, 8) * scale,
                          None, None, None, None, ROWS, BLOCK_Q)
    elif LOAD_BITS == 32:
        t = w >> 16
        if BITS == 8:  # 4 values
            val = _interleave(_field(w, magic, 0, 128) * scale, _field(w, magic, 8, 128) * scale,
                              _field(t, magic, 0, 128) * scale, _field(t, magic, 8, 128) * scale,
                              None, None, None, None, ROWS, BLOCK_Q)
        else:  # 8 values
            val = _interleave(_field(w, magic, 0, 8) * scale, _field(w, magic, 4, 8) * scale,
                              _field(w, magic, 8, 8) * scale, _field(w, magic, 12, 8) * scale,
                              _field(w, magic, 16, 8) * scale, _field(t, magic, 4, 8) * scale,
                              _field(t, magic, 8, 8) * scale, _field(t, magic, 12, 8) * scale, ROWS, BLOCK_Q)
    else:  # int8, 8 values from two words
        lo = w.to(tl.int32)
        hi = (w >> 32).to(tl.int32)
        t = lo >> 16
        u = hi >> 16
        val = _interleave(_field(lo, magic, 0, 128) * scale, _field(lo, magic, 8, 128) * scale,
                          _field(t, magic, 0, 128) * scale, _field(t, magic, 8, 128) * scale,
                          _field(hi, magic, 0, 128) * scale, _field(hi, magic, 8, 128) * scale,
                          _field(u, magic, 0, 128) * scale, _field(u, magic, 8, 128) * scale, ROWS, BLOCK_Q)
    return val


@triton.jit
def _to_out(x, DST: tl.constexpr):
    """fp32 ``x`` rounded to nearest even in ``DST``: bf16 on the bits, as ``round_fp32_to`` (NaN: 0xFFFF). A NaN is
    swapped for the NaN of bits 0xFFFF0000 first, which the rounding keeps at 0xFFFF: the select stays on 32 bits,
    and two values' upper halves pair in one byte permute."""
    if DST == tl.bfloat16:
        x = tl.where(x != x, tl.full((), 0xFFFF0000, tl.uint32).to(tl.float32, bitcast=True), x)
        bits = x.to(tl.uint32, bitcast=True)
        y = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = round_fp32_to(x, DST)
    return y


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, out_ptr, n, nb, chunk_words, q_words, magic,
                       BITS: tl.constexpr, BLOCK_Q: tl.constexpr, ROWS: tl.constexpr, SUM: tl.constexpr,
                       CHUNKS: tl.constexpr, WIDE: tl.constexpr):
    """Every chunk (SUM False: one program per tile and chunk, CHUNKS unused) or the sum of the CHUNKS
    chunks (one program per output tile reading all of them; the loop unrolled, its loads in flight). The
    sum starts from chunk 0's values where the twin adds them to zeros: the same, as no decoded value is -0
    (q = 0 decodes to +0, and scales are positive, 0 or NaN). ``magic``: ``_MAGIC`` (see ``_field``). WIDE: every
    chunk's payload is 8-byte aligned, so that int8 into bf16 / fp16 reads its 8 values a thread as one 64-bit word
    (else as one 32-bit word, and the values cross threads through shared memory on their way to the store)."""
    row0 = tl.program_id(0).to(tl.int64) * ROWS  # the tile's first block
    local = tl.arange(0, ROWS)[:, None] * BLOCK_Q + tl.arange(0, BLOCK_Q)[None, :]
    left = tl.minimum(n - row0 * BLOCK_Q, ROWS * BLOCK_Q).to(tl.int32)  # the tile's elements below n
    DST: tl.constexpr = out_ptr.dtype.element_ty
    UNIT: tl.constexpr = 4 if DST.primitive_bitwidth == 32 or (BITS == 8 and not WIDE) else 8  # values a load
    if SUM:
        acc = _decode_chunk(q_ptr, s_ptr, 0, row0, nb, chunk_words, q_words, magic, BITS, BLOCK_Q, ROWS, 0)
        for c in tl.static_range(1, CHUNKS):
            acc = acc + _decode_chunk(q_ptr, s_ptr, c, row0, nb, chunk_words, q_words, magic, BITS, BLOCK_Q, ROWS, 0)
        tl.store(out_ptr + row0 * BLOCK_Q + local, _to_out(acc, DST), mask=local < left)
    else:
        chunk = tl.program_id(1).to(tl.int64)
        val = _decode_chunk(q_ptr, s_ptr, chunk, row0, nb, chunk_words, q_words, magic, BITS, BLOCK_Q, ROWS, UNIT)
        tl.store(out_ptr + (chunk * n + row0 * BLOCK_Q) + local, _to_out(val, DST), mask=local < left)


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
    nb = -(-n // block)
    rows = _rows(block)
    tiles = -(-nb // rows)
    wide = bits == 8 and out.element_size() == 2 and chunk_words % 2 == 0 and q.data_ptr() % 8 == 0
    with launch_context(out.device):
        _dequantize_kernel[(tiles,) if sum_chunks else (tiles, chunks)](
            q, scales, out, n, nb, chunk_words, q_words, _MAGIC, BITS=bits, BLOCK_Q=block, ROWS=rows, SUM=sum_chunks,
            CHUNKS=chunks if sum_chunks else 1, WIDE=wide, num_warps=NUM_WARPS, enable_fp_fusion=False)
