"""Bucket packing: many tensors <-> one flat bucket, one launch per bucket.

The work table is built once per plan (and per tuple of entry dtypes) and kept
on the bucket's device. It never holds a tensor address: the host cuts every
range into chunks of ``BLOCK`` elements and writes one int64 row per chunk::

    (entry index, element offset in the entry, bucket offset, length * 4 + code)

``code`` is the entry's dtype (0 fp32, 1 bf16, 2 fp16) or 3 for a zero fill (a
``None`` entry of pack: its rows store +0 and read nothing). The entries'
addresses go in a separate int64 vector, one per entry (``upload_addresses``),
that the caller replaces whenever an address changes: 8 bytes per tensor, so a
plan serves new gradient tensors every step without rebuilding any row, and no
row can point at memory the tensors no longer own.

One program handles one row: it loads the entry's address from the vector,
turns it into a typed pointer with ``.to(tl.pointer_type(...))`` (works on GPU
and under the interpreter, where addresses are CPU addresses) and moves
``length <= BLOCK`` elements. Every dtype present in the table (``CODES``, a
bit mask) gets its own branch of the one kernel; a program takes the branch of
its row, so a mixed-dtype bucket is still one launch. Zero-fill rows end the
table, so launching a shorter grid skips them (unpack, accumulate).

Full chunks take an unmasked branch; when every address and bucket offset is
16-byte aligned (``ALIGNED``: the table's offsets, the bucket's and the
entries' addresses), the pointers carry ``multiple_of`` hints so that branch
compiles to 128-bit loads and stores.

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

#: dtype codes of the table's rows; ZERO marks a zero-fill row
CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ZERO = 3
_SIZES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


class Table(NamedTuple):
    """The rows of one bucket layout, on the bucket's device."""

    rows: torch.Tensor  # int64 [rows, 4]
    copy_rows: int      # rows 0 .. copy_rows-1 copy; the rest zero-fill
    codes: int          # bit mask of the codes present (a constexpr of the kernel)
    aligned: bool       # every bucket offset 16-byte aligned (as bytes from the bucket's start)
    ready: object       # CUDA: (event after the upload, the stream it was recorded on); else None
    copied: np.ndarray  # the entries that have copy rows: those whose address the kernel reads


class Addresses(NamedTuple):
    """One address per entry (0 for None), on the bucket's device."""

    ptrs: torch.Tensor  # int64 [max(entries, 1)]
    aligned: bool       # every address of an entry with rows 16-byte aligned
    ready: object       # CUDA: (event after the upload, the stream it was recorded on); else None


@triton.jit
def _pack_kernel(table_ptr, addr_ptr, bucket_ptr, scale, CODES: tl.constexpr, UNPACK: tl.constexpr,
                 ACCUMULATE: tl.constexpr, HAS_SCALE: tl.constexpr, ALIGNED: tl.constexpr,
                 BLOCK: tl.constexpr):
    # No nested @jit calls: under the interpreter each costs milliseconds per
    # program, so the bf16 rounding of rounding.bf16_bits_rne is written out.
    row = table_ptr + tl.program_id(0).to(tl.int64) * 4
    entry = tl.load(row)
    start = tl.load(row + 1)
    off = tl.load(row + 2)
    meta = tl.load(row + 3)
    n = meta >> 2
    code = meta & 3
    base = tl.load(addr_ptr + entry)
    buf = bucket_ptr + off
    if ALIGNED:
        buf = tl.multiple_of(buf, 16)
    B: tl.constexpr = bucket_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    if (CODES >> 3) & 1:
        if not UNPACK and not ACCUMULATE:  # zero-fill rows: +0, whatever the scale
            if code == 3:
                tl.store(buf + offs, tl.zeros([BLOCK], dtype=B), mask=offs < n)
    for C in tl.static_range(3):
        if (CODES >> C) & 1:
            if code == C:
                if C == 0:
                    ext = base.to(tl.pointer_type(tl.float32)) + start
                elif C == 1:
                    ext = base.to(tl.pointer_type(tl.bfloat16)) + start
                else:
                    ext = base.to(tl.pointer_type(tl.float16)) + start
                if ALIGNED:
                    ext = tl.multiple_of(ext, 16)
                if UNPACK:
                    src = buf
                    dst = ext
                else:
                    src = ext
                    dst = buf
                IN: tl.constexpr = src.dtype.element_ty
                OUT: tl.constexpr = dst.dtype.element_ty
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
                            y = x  # raw bits
                        else:
                            v = x.to(tl.float32)
                            if HAS_SCALE:
                                v = v * scale
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


def _rows(entry: np.ndarray, off: np.ndarray, numel: np.ndarray, code: np.ndarray) -> np.ndarray:
    """Chunk rows for entries ``entry`` at bucket offsets ``off`` of ``numel``
    elements with dtype codes ``code``; int64 [rows, 4]."""
    chunks = (numel + BLOCK - 1) // BLOCK
    total = int(chunks.sum())
    owner = np.repeat(np.arange(len(numel)), chunks)
    first = np.cumsum(chunks) - chunks
    k = np.arange(total, dtype=np.int64) - np.repeat(first, chunks)
    rows = np.empty((total, _ROW), dtype=np.int64)
    rows[:, 0] = entry[owner]
    rows[:, 1] = k * BLOCK
    rows[:, 2] = off[owner] + k * BLOCK
    rows[:, 3] = np.minimum(BLOCK, numel[owner] - k * BLOCK) * 4 + code[owner]
    return rows


def build_table(dtypes, offsets, numels, bucket: torch.Tensor) -> Table:
    """The rows for entries of ``dtypes`` (a dtype, or None for a zero fill) at
    ``offsets`` with ``numels`` elements in ``bucket``: copy rows in entry order,
    then the zero-fill rows. Arguments are validated by ops; nothing here depends
    on the entries' addresses or the bucket's."""
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
    numels = np.asarray(numels, dtype=np.int64).reshape(-1)
    code = np.array([ZERO if d is None else CODES[d] for d in dtypes], dtype=np.int64)
    live = numels > 0
    copy = np.flatnonzero(live & (code != ZERO))
    zero = np.flatnonzero(live & (code == ZERO))
    parts = [_rows(idx, offsets[idx], numels[idx], code[idx]) for idx in (copy, zero)]
    rows = np.concatenate(parts)
    mask = 0
    for c in np.unique(rows[:, 3] & 3).tolist():
        mask |= 1 << c
    aligned = bool(np.all(rows[:, 2] * bucket.element_size() % 16 == 0))
    table, ready = _upload(rows, bucket.device)
    return Table(table, len(parts[0]), mask, aligned, ready, copy)


#: address vectors uploaded so far (bench/profile_step.py reports them per step)
uploads = 0


def upload_addresses(ptrs: list, table: Table, device: torch.device) -> Addresses:
    """The entries' addresses (0 for a None entry) on ``device``, for ``table``'s rows."""
    global uploads
    uploads += 1
    host = np.fromiter(ptrs, dtype=np.int64, count=len(ptrs)) if ptrs else np.zeros(1, dtype=np.int64)
    aligned = not np.any(host[table.copied] & 15)
    vec, ready = _upload(host, device)
    return Addresses(vec, aligned, ready)


def _upload(rows: np.ndarray, device: torch.device):
    """``rows`` on ``device``; on CUDA an asynchronous copy from pinned memory
    (the host allocator keeps the pinned block until the copy is done) and
    (event, stream): launches on other streams wait for the event."""
    host = torch.from_numpy(rows)
    if device.type != "cuda":
        return host.to(device), None
    with torch.cuda.device(device):
        table = host.pin_memory().to(device, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return table, (ready, torch.cuda.current_stream(device))


def _launch(table: Table, addrs: Addresses, bucket, rows: int, *, unpack: bool, accumulate: bool,
            scale) -> None:
    if rows == 0:
        return
    has_scale = scale is not None
    if table.ready is not None:
        _after_uploads(table, addrs, bucket.device)
    extra = {"enable_fp_fusion": False} if has_scale and accumulate else {}
    _pack_kernel[(rows,)](
        table.rows, addrs.ptrs, bucket, float(scale) if has_scale else 1.0,
        CODES=table.codes, UNPACK=unpack, ACCUMULATE=accumulate, HAS_SCALE=has_scale,
        ALIGNED=table.aligned and addrs.aligned and bucket.data_ptr() % 16 == 0,
        BLOCK=BLOCK, num_warps=NUM_WARPS, **extra,
    )


def _after_uploads(table: Table, addrs: Addresses, device: torch.device) -> None:
    """A launch on another stream than an upload's waits for it, and keeps its
    memory from reuse until the launch is done (CUDA's caching allocator reuses
    a block in the order of the stream that allocated it). On the upload's own
    stream, stream order does both."""
    stream = torch.cuda.current_stream(device)
    for tensor, (event, upload_stream) in ((table.rows, table.ready), (addrs.ptrs, addrs.ready)):
        if stream != upload_stream:
            stream.wait_event(event)
            tensor.record_stream(stream)


def pack(table: Table, addrs: Addresses, bucket: torch.Tensor, *, accumulate: bool = False,
         scale=None) -> torch.Tensor:
    """bucket[off:off+n] = round(t * scale [+ bucket]) for every entry; None entries
    zero their range (or keep it when accumulating). One launch."""
    with launch_context(bucket.device):
        rows = table.copy_rows if accumulate else len(table.rows)
        _launch(table, addrs, bucket, rows, unpack=False, accumulate=accumulate, scale=scale)
    return bucket


def unpack(table: Table, addrs: Addresses, bucket: torch.Tensor) -> None:
    """t[...] = bucket[off:off+n] cast to t.dtype for every non-None entry. One launch."""
    with launch_context(bucket.device):
        _launch(table, addrs, bucket, table.copy_rows, unpack=True, accumulate=False, scale=None)
