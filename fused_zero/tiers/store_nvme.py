"""NvmeStore: the optimizer states of a partition in a scratch file (``offload_optimizer="nvme"``).

One file per partition under ``nvme_path`` (named by process id and a random id, so two
optimizers never share one), holding two slots of every state kind. The shard is cut into
blocks of ``chunk_numel`` elements; for each block one slot is live (the file's space is reserved as the
optimizer is built, or the build refused: ``ScratchFile.reserve``). A step reads a block from
its live slot into a host staging buffer (the next block is read ahead on a thread), the update
runs on it, and the block is written to its *other* slot behind (on a thread). Only ``commit()``
-- once every partition of the step succeeded -- makes the written slots live: a full disk or an
I/O error midway leaves every state as it was before the step. The process's memory stays at
three staging blocks per kind whatever the model size (``staging.Staging``: one set for all of an
optimizer's stores; a block holds a chunk, or the largest store where every one is smaller). The file
goes through the page cache: the kernel keeps what free memory allows (reclaimable, never the process's)
and writes the rest back. (Dropping written pages with posix_fadvise(DONTNEED), as this store first did,
measured worse on every count: dirty pages are not dropped, and the call starts their writeback in the I/O thread.)
The file is removed on ``close()``, when the store is collected, and at exit.
"""
from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .store import AMSGRAD_KIND, STATE_KINDS, ShardStore, StateChunk
from .scratch import ScratchFile
from .staging import DIRECT_ELEMENTS, Staging
from .tier import Tier
from .transfer import aligned_empty

_F32 = 4
#: O_DIRECT transfers start, and are sized, at multiples of this many bytes (the usual logical block size and
#: page: 4 KiB), from page-aligned host buffers (staging.aligned_empty).
DIRECT_BYTES = DIRECT_ELEMENTS * _F32


def check_nvme_path(path, direct: bool = False) -> None:
    """``path`` is a folder this process can create files in, with O_DIRECT if ``direct`` (raises naming it)."""
    if path is None:
        raise ValueError('offload_optimizer="nvme" needs nvme_path=, a folder on a fast local disk')
    if not os.path.isdir(path):
        raise ValueError(f"nvme_path {path!r} is not a folder: create it, or pass another one")
    probe = os.path.join(path, f".fused_zero-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0")
    except OSError as e:
        raise ValueError(f"nvme_path {path!r} is not writable ({e.strerror}): pass a folder you can write") from None
    try:
        if direct:
            _probe_direct(probe, path)
    finally:
        os.remove(probe)


def _probe_direct(probe: str, path: str) -> None:
    """One aligned O_DIRECT write and read of ``probe``; a ValueError naming the fix if the file system refuses."""
    buf = aligned_empty(DIRECT_ELEMENTS, torch.float32)
    try:
        fd = os.open(probe, os.O_RDWR | getattr(os, "O_DIRECT", 0))
        try:
            view = memoryview(buf.numpy()).cast("B")
            if not hasattr(os, "O_DIRECT") or os.pwritev(fd, [view], 0) != DIRECT_BYTES or \
                    os.preadv(fd, [view], 0) != DIRECT_BYTES:
                raise OSError(22, "short transfer")
        finally:
            os.close(fd)
    except OSError as e:
        raise ValueError(f"nvme_direct=True, but the file system of nvme_path {path!r} does not take O_DIRECT "
                         f"I/O ({e.strerror}; tmpfs and some network file systems do not): pass a folder on a local "
                         "disk, or nvme_direct=False to go through the page cache") from None


class NvmeStore(ShardStore):
    """The states in a file, streamed block by block through a few host staging buffers."""

    tier = Tier.NVME
    undoes_failed_steps = True  # two slots: a step's writes become the states at commit()

    def __init__(self, numel: int, device: torch.device, amsgrad: bool = False, *, path: str,
                 chunk_numel: int = 1 << 20, staging: Staging | None = None, direct: bool = False) -> None:
        """``staging``: the buffers shared with the optimizer's other stores (its chunk size wins).
        ``direct``: the update streams the blocks with O_DIRECT (no page cache)."""
        super().__init__(numel, amsgrad)
        self.device = device
        self.staging = staging or Staging(chunk_numel, direct=direct)
        # Blocks are whole multiples of ALIGN (config.ALIGN's chunk-edge rule, staging.whole_lanes).
        self.block = self.staging.chunk_numel
        self.direct = direct
        if direct and not self.staging.direct:
            raise ValueError(f"O_DIRECT needs staging.Staging(direct=True) blocks of whole {DIRECT_BYTES}-byte "
                             f"units, got {self.block} elements")
        # Each (slot, kind) region starts at a multiple of DIRECT_BYTES: O_DIRECT offsets must be aligned.
        self.stride = -(-numel // DIRECT_ELEMENTS) * DIRECT_ELEMENTS
        self.file = ScratchFile(path, "states", what="NVMe store", label="NVMe offload",
                                hint=" (the states are as before this step)")
        self.path = self.file.path
        n_blocks = -(-numel // self.block)
        self._live = np.zeros(n_blocks, dtype=np.int8)  # which slot of each block holds the states
        self._pending: set[int] = set()  # blocks written to their other slot this step
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fused_zero-nvme")
        doing, fix = "reserving space for", "free space there, or pass another nvme_path"
        try:
            self.file.reserve(2 * len(self.kinds) * self.stride * _F32, "the states need",
                              " (two slots of each state kind)")
            # the update's stream bypasses the page cache; read()/write() (checkpoints, loads) keep the buffered
            # descriptor: Linux writes cached pages back before a direct read of the range and drops them on a
            # direct write, so the two views of the file agree
            if direct:
                doing, fix = "opening (O_DIRECT)", "pass another nvme_path, or nvme_direct=False"
                self.file.open_direct()
        except OSError as e:
            self.close()
            raise OSError(e.errno, f"fused_zero NVMe offload: {doing} {self.path} failed ({e.strerror}); {fix}") \
                from None

    # -- file I/O ---------------------------------------------------------
    def _offset(self, slot: int, kind: str, element: int) -> int:
        return ((slot * len(self.kinds) + self.kinds.index(kind)) * self.stride + element) * _F32

    def _io(self, write: bool, slot: int, kind: str, element: int, t: torch.Tensor, direct: bool = False) -> None:
        self.file.transfer(write, memoryview(t.numpy()).cast("B"), self._offset(slot, kind, element),
                           self.file.direct_fd if direct else None)

    def _span(self, b: int) -> tuple[int, int]:
        return b * self.block, min(self.numel, (b + 1) * self.block)

    def _block_len(self, b: int) -> int:
        """Elements a block transfers: its span, rounded up to whole O_DIRECT units when direct (the last block
        of a region then reads and writes the region's padding too)."""
        lo, hi = self._span(b)
        return hi - lo if not self.direct else -(-(hi - lo) // DIRECT_ELEMENTS) * DIRECT_ELEMENTS

    def _read_block(self, b: int, buf: dict) -> dict:
        """Block ``b``'s states as this step left them: its other slot once this step wrote it (stages 1-2 update
        bucket by bucket behind step(), and two buckets may share a block), else its live slot."""
        lo, n = self._span(b)[0], self._block_len(b)
        slot = int(self._live[b]) ^ (b in self._pending)
        for kind in self.kinds:
            self._io(False, slot, kind, lo, buf[kind][:n], self.direct)
        return buf

    def _write_block(self, b: int, buf: dict) -> None:
        lo, n = self._span(b)[0], self._block_len(b)
        for kind in self.kinds:
            self._io(True, 1 - int(self._live[b]), kind, lo, buf[kind][:n], self.direct)

    # -- the store's verbs ----------------------------------------------------
    def read(self, kind: str, start: int, end: int) -> torch.Tensor:
        self._check(kind, start, end)
        out = torch.empty(end - start, dtype=torch.float32)
        for b in range(start // self.block, -(-end // self.block)):
            lo, hi = self._span(b)
            a, z = max(lo, start), min(hi, end)
            self._io(False, int(self._live[b]), kind, a, out[a - start:z - start])
        return out

    def write(self, kind: str, start: int, values: torch.Tensor) -> None:
        end = start + values.numel()
        self._check(kind, start, end)
        # a copy of our own: .numpy() on a view of the caller's tensor would pin its storage's size
        values = values.detach().reshape(-1).to("cpu", torch.float32, copy=True)
        for b in range(start // self.block, -(-end // self.block)):
            lo, hi = self._span(b)
            a, z = max(lo, start), min(hi, end)
            self._io(True, int(self._live[b]), kind, a, values[a - start:z - start])

    def update_chunks(self, ranges, grad: torch.Tensor, param_out: torch.Tensor | None) -> Iterator[StateChunk]:
        pieces: dict[int, list[tuple[int, int]]] = {}
        for start, end in ranges:
            for b in range(start // self.block, -(-end // self.block)):
                lo, hi = self._span(b)
                pieces.setdefault(b, []).append((max(lo, start), min(hi, end)))
        blocks = sorted(pieces)
        writes = []
        # with the parameters on a GPU the new narrow params go up through pinned buffers, pipelined
        uploads = None if param_out is None or param_out.device.type == "cpu" else self.staging.uploads(param_out.dtype)
        # shared with the optimizer's other stores, one update at a time
        buffers = self.staging.blocks(self.kinds, self.numel)
        reading = self._pool.submit(self._read_block, blocks[0], buffers[0]) if blocks else None
        # The reads and writes behind are CPU work too (copies to and from the page cache): the update
        # leaves them a core. Every kernel call is one OpenMP parallel region; with as many threads as
        # cores, each waits at its barrier for a thread the I/O has descheduled (one 2**20-element
        # fused AdamW on a 2-core box: 1.5 ms on 1 thread, 8.8 ms on 2 while another thread runs).
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, threads - 1))
        try:
            for i, b in enumerate(blocks):
                buf = reading.result()
                if i + 1 < len(blocks):  # read ahead into the buffer no write still needs
                    nxt = buffers[(i + 1) % 3]
                    if len(writes) >= 2:
                        writes[-2].result()
                    reading = self._pool.submit(self._read_block, blocks[i + 1], nxt)
                lo, _ = self._span(b)
                for a, z in pieces[b]:
                    out = uploads.buffer(z - a) if uploads is not None else (
                        None if param_out is None else param_out[a:z])
                    yield StateChunk(a, z, *(buf[k][a - lo:z - lo] for k in STATE_KINDS),
                                     buf[AMSGRAD_KIND][a - lo:z - lo] if AMSGRAD_KIND in self.kinds else None,
                                     grad[a:z], out)
                    if uploads is not None:
                        uploads.send(param_out[a:z])
                writes.append(self._pool.submit(self._write_block, b, buf))
                self._pending.add(b)
        finally:
            torch.set_num_threads(threads)
            if uploads is not None:
                uploads.finish()
            for f in writes + ([reading] if reading is not None else []):
                try:
                    f.result()
                except OSError:
                    pass
        for f in writes:
            f.result()  # raises the first I/O error, naming the file

    def commit(self) -> None:
        for b in self._pending:
            self._live[b] ^= 1
        self._pending.clear()

    def rollback(self) -> None:
        self._pending.clear()

    def gather_source(self, start: int, end: int) -> None:
        return None

    def nbytes(self) -> dict[str, int]:
        return {kind: self.numel * _F32 for kind in self.kinds}  # on disk, one slot each

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.file.close()
