"""``quantize_`` / ``dequantize_``: block-wise absmax int8 / int4 with fp32 scales (the communication codecs).

A flat buffer of ``chunks * n`` elements (one run of ``n`` per peer of a collective) is encoded into
``chunks`` payloads of ``payload_bytes(n, bits, block)`` bytes each, one after another in a uint8 buffer:
the quantized values (int8 one byte each, int4 two per byte), padded to a multiple of 4 bytes, then one
fp32 scale per block of ``block`` elements. ``kernels/quant.py`` states the arithmetic, the rounding and
what zeros, tiny blocks, inf and NaN become. Backends: ``triton`` (``fused_zero.kernels.quant``) and
``torch`` (the twins below: the CPU path and the test oracle), bitwise equal.
"""
from __future__ import annotations

import functools

import torch

from ..config import payload_bytes, quant_words
from . import _backend
from ._checks import FLOATS, check_bool, check_flat, check_same_device

#: The codecs' integer widths and their largest magnitude (symmetric: int8 uses -127..127, int4 -7..7).
QMAX = {8: 127, 4: 7}
#: Block sizes a codec takes: powers of two (a Triton tile) from 32 to 8192.
BLOCK_RANGE = (32, 8192)
TINY = 2.0 ** -96  # kernels.quant.TINY: blocks below it are sent as zeros


def check_codec(bits: object, block: object) -> None:
    """``bits`` is 8 or 4 and ``block`` a power of two in ``BLOCK_RANGE``."""
    if bits not in QMAX or isinstance(bits, bool):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    lo, hi = BLOCK_RANGE
    if isinstance(block, bool) or not isinstance(block, int) or not lo <= block <= hi or block & (block - 1):
        raise ValueError(f"the quantization block must be a power of two from {lo} to {hi}, got {block!r}")


@functools.lru_cache(maxsize=256)
def _geometry(n: int, bits: int, block: int) -> dict:
    """The launch's sizes for chunks of ``n`` elements (cached: a codec sends the same sizes every step)."""
    return dict(n=n, chunk_words=payload_bytes(n, bits, block) // 4, q_words=quant_words(n, bits), bits=bits,
                block=block)


def _check_payload(payload: torch.Tensor, n: int, chunks: int, bits: int, block: int) -> dict:
    """Refuse a payload of the wrong dtype, size or alignment; returns ``_geometry(n, bits, block)``."""
    check_flat("payload", payload, (torch.uint8,))
    geometry = _geometry(n, bits, block)
    need = chunks * 4 * geometry["chunk_words"]
    if payload.numel() != need:
        raise ValueError(f"payload has {payload.numel()} bytes; {chunks} chunk(s) of {n} elements need "
                         f"{need} (payload_bytes(n, bits, block) each)")
    if payload.numel() and payload.data_ptr() % 4:
        raise ValueError("payload must start at a 4-byte aligned address (its scales are read as fp32)")
    return geometry


def _views(payload: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the values' view: int8 or uint8, the fp32 view the scales are read from) of ``payload``."""
    return payload.view(torch.int8) if bits == 8 else payload, payload.view(torch.float32)


def quantize_(x, payload, *, bits: int = 8, block: int = 256, chunks: int = 1, seed: int | None = None):
    """Encode ``x`` (fp32/bf16/fp16, ``chunks * n`` elements) into ``payload`` (uint8); returns ``payload``.

    ``seed`` None rounds to nearest even; an int in [0, 2**31) rounds stochastically (``floor(y + u)``, ``u``
    uniform in [0, 1) from a hash of ``seed`` and the element's index): unbiased, and the same payload for
    the same ``x`` and ``seed``."""
    check_flat("x", x, FLOATS)
    check_codec(bits, block)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 31):
        raise ValueError(f"seed must be None (round to nearest) or an int in [0, 2**31), got {seed!r}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1 or x.numel() % chunks:
        raise ValueError(f"chunks must be a positive int dividing x's {x.numel()} elements, got {chunks!r}")
    n = x.numel() // chunks
    geometry = _check_payload(payload, n, chunks, bits, block)
    check_same_device("x", x, payload=payload)
    q, scales = _views(payload, bits)
    _backend.implementation("quantize", x.device)(x, q, scales, chunks=chunks, seed=seed, **geometry)
    return payload


def dequantize_(payload, out, *, bits: int = 8, block: int = 256, chunks: int = 1, sum_chunks: bool = False):
    """Decode ``payload`` into ``out`` (fp32/bf16/fp16): every chunk (``out`` holds ``chunks * n``), or with
    ``sum_chunks`` their sum in chunk order, in fp32, rounded once (``out`` holds ``n``). Returns ``out``."""
    check_flat("out", out, FLOATS)
    check_codec(bits, block)
    check_bool("sum_chunks", sum_chunks)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")
    if not sum_chunks and out.numel() % chunks:
        raise ValueError(f"out's {out.numel()} elements do not split into {chunks} chunks")
    n = out.numel() if sum_chunks else out.numel() // chunks
    geometry = _check_payload(payload, n, chunks, bits, block)
    check_same_device("out", out, payload=payload)
    q, scales = _views(payload, bits)
    _backend.implementation("dequantize", out.device)(q, scales, out, chunks=chunks, sum_chunks=sum_chunks,
                                                      **geometry)
    return out


# -- the twins -----------------------------------------------------------------------------------------------
def _blocks(t: torch.Tensor, chunks: int, n: int, block: int) -> torch.Tensor:
    """``t`` ([chunks * n]) as [chunks, blocks, block], zero-padded at each chunk's end."""
    nb = -(-n // block)
    padded = torch.zeros(chunks, nb * block, dtype=t.dtype, device=t.device)
    padded[:, :n] = t.view(chunks, n)
    return padded.view(chunks, nb, block)


_M32 = 0xFFFFFFFF


def uniform_twin(seed: int, index: torch.Tensor) -> torch.Tensor:
    """Twin of ``kernels.quant._uniform``: fp32 in [0, 1) on a 2**-24 grid, from a 32-bit hash (lowbias32)
    of ``index`` (int64, the element's place in the buffer) mixed with ``seed``."""
    h = (index ^ (seed * 0x9E3779B1)) & _M32
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _M32  # int64 products wrap; their low 32 bits are the uint32 product's
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & _M32
    h = h ^ (h >> 16)
    return (h >> 8).to(torch.float32) * 2.0 ** -24


def quantize_twin(x, q, scales, *, n, chunks, chunk_words, q_words, bits, block, seed=None):
    """Twin of ``kernels.quant.quantize``."""
    qmax = float(QMAX[bits])
    xb = _blocks(x.float(), chunks, n, block)
    fin = xb.abs() <= torch.finfo(torch.float32).max  # False for inf and NaN
    absmax = torch.where(fin, xb.abs(), 0.0).amax(-1)
    bad, tiny = ~fin.all(-1), absmax < TINY
    q_t = torch.full_like(absmax, qmax)  # tensor / tensor: ``qmax / t`` would be reciprocal(t) * qmax in torch
    scale = torch.where(tiny, 0.0, torch.div(absmax, q_t))
    inv = torch.where(tiny, 0.0, torch.div(q_t, absmax.clamp(min=TINY)))
    scale = torch.where(bad, torch.tensor(float("nan"), dtype=scale.dtype, device=x.device), scale)
    inv = torch.where(bad, 0.0, inv)
    y = torch.where(fin, xb * inv[..., None], 0.0)
    if seed is None:
        r = torch.round(y)
    else:  # the element's index in x: chunk * n + its place in the chunk (block padding past n is dropped)
        place = torch.arange(y.shape[1] * block, device=x.device).view(1, -1, block)
        index = torch.arange(chunks, device=x.device).view(-1, 1, 1) * n + place
        r = torch.floor(y + uniform_twin(seed, index))
    r = r.clamp_(-qmax, qmax).to(torch.int32).view(chunks, -1)[:, :n]
    if bits == 4:
        r = torch.nn.functional.pad(r + 8, (0, n % 2), value=8)
        r = r[:, 0::2] | (r[:, 1::2] << 4)
    words = q.view(chunks, 4 * chunk_words)
    words[:, :r.shape[1]] = r.to(q.dtype)
    scales.view(chunks, chunk_words)[:, q_words:] = scale
    return q


def _decode_twin(q, scales, *, n, chunks, chunk_words, q_words, bits, block) -> torch.Tensor:
    """Every chunk's values in fp32, [chunks, n]."""
    rows = q.view(chunks, 4 * chunk_words)
    if bits == 8:
        ints = rows[:, :n].to(torch.int32)
    else:
        byte = rows[:, :-(-n // 2)].to(torch.int32)
        ints = torch.stack((byte & 15, byte >> 4), dim=-1).view(chunks, -1)[:, :n] - 8
    scale = scales.view(chunks, chunk_words)[:, q_words:]
    return (_blocks(ints.float(), chunks, n, block) * scale[..., None]).view(chunks, -1)[:, :n]


def dequantize_twin(q, scales, out, *, n, chunks, chunk_words, q_words, bits, block, sum_chunks):
    """Twin of ``kernels.quant.dequantize``."""
    vals = _decode_twin(q, scales, n=n, chunks=chunks, chunk_words=chunk_words, q_words=q_words, bits=bits,
                        block=block)
    if not sum_chunks:
        return out.copy_(vals.reshape(-1))
    acc = torch.zeros(n, dtype=torch.float32, device=out.device)
    for c in range(chunks):  # chunk order, one rounding per add: the kernel's
        acc += vals[c]
    return out.copy_(acc)


_backend.register("quantize", triton=_backend.kernel("quant", "quantize"), torch=quantize_twin)
_backend.register("dequantize", triton=_backend.kernel("quant", "dequantize"), torch=dequantize_twin)
