"""Bucket packing: many tensors <-> one flat bucket, one launch per tensor dtype.

The host cuts every tensor into chunks of ``BLOCK`` elements and writes one
row per chunk into an int64 work table::

    (tensor address of the chunk's first element, bucket offset, length, kind)

``kind`` is 0 for a copy and 1 for a zero fill (a ``None`` entry of pack:
its rows read a BLOCK-long zero buffer and are never scaled). One program
handles one row: it turns the address into a typed pointer with
``.to(tl.pointer_type(...))`` (works on GPU and under the interpreter, where
addresses are CPU addresses) and moves ``length <= BLOCK`` elements. All
tensors of one dtype go into one table and one launch; the zero-fill rows sit
at the end of the first table, so launching a shorter grid skips them
(unpack, accumulate). Every pointer a program forms is valid memory.

Full chunks take an unmasked branch; when every address and bucket offset of
a table is 16-byte aligned (``ALIGNED``), the pointers carry ``multiple_of``
hints so that branch compiles to 128-bit loads and stores.

Values move through fp32: ``bucket = round(t * scale [+ bucket])``, one
rounding at the end (bf16 on the bits, see rounding.py). A copy between equal
dtypes without scale or accumulate moves the raw bits. FP contraction is off
when scaling and accumulating, so ``t * scale + b`` is two roundings (as in
the torch twin), never an FMA.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from .cast import launch_context

BLOCK = 2048
NUM_WARPS = 4
_ROW = 4  # int64 columns per table row

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


class Launch(NamedTuple):
    """One kernel launch: all chunks of the tensors of one dtype."""

    dtype: torch.dtype      # dtype of the tensors in this table
    table: torch.Tensor     # int64 [rows, 4] on the bucket's device
    copy_rows: int          # rows 0 .. copy_rows-1 copy; the rest zero-fill
    aligned: bool           # every address and bucket offset 16-byte aligned
    ready: object           # CUDA event after the table's upload, or None


@triton.jit
def _pack_kernel(table_ptr, bucket_ptr, scale, EXT: tl.constexpr, UNPACK: tl.constexpr,
                 ACCUMULATE: tl.constexpr, HAS_SCALE: tl.constexpr, ALIGNED: tl.constexpr,
                 BLOCK: tl.constexpr):
    # No nested @jit calls: under the interpreter each costs milliseconds per
    # program, so the bf16 rounding of rounding.bf16_bits_rne is written out.
    row = table_ptr + tl.program_id(0).to(tl.int64) * 4
    addr = tl.load(row)
    off = tl.load(row + 1)
    n = tl.load(row + 2)
    kind = tl.load(row + 3)
    ext = addr.to(tl.pointer_type(EXT))
    buf = bucket_ptr + off
    if ALIGNED:
        ext = tl.multiple_of(ext, 16)
        buf = tl.multiple_of(buf, 16)
    if UNPACK:
        src = buf
        dst = ext
    else:
        src = ext
        dst = buf
    IN: tl.constexpr = src.dtype.element_ty
    OUT: tl.constexpr = dst.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    # The body is emitted twice: unmasked for full chunks (vectorizes when
    # ALIGNED), masked for the last chunk of a tensor. One runs per program.
    for FULL in tl.static_range(2):
        if FULL == 1:
            go = n == BLOCK
        else:
            go = n != BLOCK
        if go:
            mask = None if FULL == 1 else offs < n
            x = tl.load(src + offs, mask=mask)
            if IN == OUT and not HAS_SCALE and not ACCUMULATE:
                y = x  # raw bits; zero-fill rows read a zero buffer
            else:
                v = x.to(tl.float32)
                if HAS_SCALE:
                    v = v * tl.where(kind == 0, scale, 1.0)  # zero-fill rows stay +0
                if ACCUMULATE:
                    v = v + tl.load(dst + offs, mask=mask).to(tl.float32)
                if OUT == tl.bfloat16:
                    # uint64: the interpreter checks every <64-bit integer add
                    # for overflow, which costs more than the whole copy.
                    bits = v.to(tl.uint32, bitcast=True).to(tl.uint64)
                    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                    bits = tl.where(v != v, 0xFFFF, bits)
                    y = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
                elif OUT == tl.float16:
                    y = v.to(tl.float16, fp_downcast_rounding="rtne")
                else:
                    y = v
            tl.store(dst + offs, y, mask=mask)


def _rows(addr, off: np.ndarray, numel: np.ndarray, elsize: int, kind: int) -> np.ndarray:
    """Chunk rows for ranges (addr, off, numel); int64 [rows, 4]. Zero-fill
    rows (kind 1) all read the same zero buffer at ``addr``."""
    chunks = (numel + BLOCK - 1) // BLOCK
    total = int(chunks.sum())
    owner = np.repeat(np.arange(len(numel)), chunks)
    first = np.cumsum(chunks) - chunks
    k = np.arange(total, dtype=np.int64) - np.repeat(first, chunks)
    rows = np.empty((total, _ROW), dtype=np.int64)
    rows[:, 0] = addr[owner] + k * (BLOCK * elsize) if kind == 0 else addr
    rows[:, 1] = off[owner] + k * BLOCK
    rows[:, 2] = np.minimum(BLOCK, numel[owner] - k * BLOCK)
    rows[:, 3] = kind
    return rows


_ZERO_BUFFERS: dict = {}


def _zeros(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """BLOCK zeros that zero-fill rows read (kept for the life of the process)."""
    key = (str(device), dtype)
    if key not in _ZERO_BUFFERS:
        _ZERO_BUFFERS[key] = torch.zeros(BLOCK, dtype=dtype, device=device)
    return _ZERO_BUFFERS[key]


def build_launches(entries, offsets, numels, bucket: torch.Tensor) -> tuple[Launch, ...]:
    """Work tables for ``entries`` (tensors or None) at ``offsets`` in ``bucket``.

    Arguments are validated by ops. Entries of one dtype share one table, in
    the order of first appearance; zero-fill rows (None entries) end the first.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    numels = np.asarray(numels, dtype=np.int64)
    bsize = bucket.element_size()
    bptr = bucket.data_ptr()
    groups: dict[torch.dtype, list[int]] = {}
    zeros = []
    for i, t in enumerate(entries):
        if t is None:
            zeros.append(i)
        elif numels[i] > 0:
            groups.setdefault(t.dtype, []).append(i)
    if zeros and not groups:
        groups[bucket.dtype] = []
    launches = []
    for g, (dtype, idx) in enumerate(groups.items()):
        idx = np.asarray(idx, dtype=np.int64)
        elsize = torch.empty((), dtype=dtype).element_size()
        addr = np.fromiter((entries[i].data_ptr() for i in idx), dtype=np.int64, count=len(idx))
        parts = [_rows(addr, offsets[idx], numels[idx], elsize, 0)]
        copy_rows = len(parts[0])
        if g == 0 and zeros:
            z = np.asarray(zeros, dtype=np.int64)
            parts.append(_rows(_zeros(bucket.device, dtype).data_ptr(), offsets[z], numels[z], elsize, 1))
        rows = np.concatenate(parts)
        if len(rows) == 0:
            continue
        aligned = bool(np.all(rows[:, 0] % 16 == 0) and np.all((bptr + rows[:, 1] * bsize) % 16 == 0))
        table, ready = _upload(rows, bucket.device)
        launches.append(Launch(dtype, table, copy_rows, aligned, ready))
    return tuple(launches)


def _upload(rows: np.ndarray, device: torch.device):
    """The table on ``device``; on CUDA an asynchronous copy from pinned memory
    (the host allocator keeps the pinned block until the copy is done) and an
    event that later launches on other streams wait for."""
    host = torch.from_numpy(rows)
    if device.type != "cuda":
        return host.to(device), None
    with torch.cuda.device(device):
        table = host.pin_memory().to(device, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
    return table, ready


def _launch(lau: Launch, bucket, rows: int, *, unpack: bool, accumulate: bool, scale) -> None:
    if rows == 0:
        return
    has_scale = scale is not None
    if lau.ready is not None:
        torch.cuda.current_stream(bucket.device).wait_event(lau.ready)
    extra = {"enable_fp_fusion": False} if has_scale and accumulate else {}
    _pack_kernel[(rows,)](
        lau.table, bucket, float(scale) if has_scale else 1.0,
        EXT=_TL_DTYPES[lau.dtype], UNPACK=unpack, ACCUMULATE=accumulate, HAS_SCALE=has_scale,
        ALIGNED=lau.aligned, BLOCK=BLOCK, num_warps=NUM_WARPS, **extra,
    )


def pack(launches, bucket: torch.Tensor, *, accumulate: bool = False, scale=None) -> torch.Tensor:
    """bucket[off:off+n] = round(t * scale [+ bucket]) for every entry; None entries
    zero their range (or keep it when accumulating)."""
    with launch_context(bucket.device):
        for lau in launches:
            rows = lau.copy_rows if accumulate else len(lau.table)
            _launch(lau, bucket, rows, unpack=False, accumulate=accumulate, scale=scale)
    return bucket


def unpack(launches, bucket: torch.Tensor) -> None:
    """t[...] = bucket[off:off+n] cast to t.dtype for every non-None entry."""
    with launch_context(bucket.device):
        for lau in launches:
            _launch(lau, bucket, lau.copy_rows, unpack=True, accumulate=False, scale=None)
