"""Copies between the parameters' device and host memory, off the compute stream.

The offload tiers move each bucket's reduced gradient shard down to the host while backward
goes on, and the updated narrow params back up while the host updates the next chunk. On a
GPU those copies run on a side stream of their own (``Transfers``, one per device), each
answered by a ``Ticket``: ``done()`` asks without blocking, ``wait()`` blocks the host until
the copy is over (before the host reads what came down, or rewrites a staging buffer that
went up), ``order_before()`` makes later work on the compute stream wait for it on the GPU
(before anything reads what went up, or overwrites what went down). With the parameters on
the host every copy is synchronous and every ticket done: the same calls, so the CPU tests
run this code path.
"""
from __future__ import annotations

import mmap
import warnings
import weakref
from typing import Any, NamedTuple

import torch


class Ticket(NamedTuple):
    """A copy in flight; ``event`` is None when it is already complete."""

    event: Any = None

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def order_before(self) -> None:
        """Work queued later on the current stream starts after the copy (a GPU-side wait)."""
        if self.event is not None:
            torch.cuda.current_stream(self.event.device).wait_event(self.event)


DONE = Ticket()


class Transfers:
    """The copy stream of one device (None on the host: copies run in place, synchronously)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=None) -> Ticket:
        """``dst`` <- ``src`` once ``after`` (a collective's Handle, or None) is complete.

        On a GPU, queued on the copy stream behind everything queued so far on the compute stream
        (which may still read ``dst`` or write ``src``) and behind ``after``; the host does not wait.
        Host memory on either side must be pinned for the copy not to block.
        """
        return self._queued(src, after, lambda: dst.copy_(src, non_blocking=True))

    def add_down(self, dst: torch.Tensor, src: torch.Tensor, scratch: torch.Tensor, after=None) -> Ticket:
        """``dst`` += ``src`` on ``src``'s device once ``after`` is complete: ``dst`` (host) goes up into ``scratch``
        (on the device), ``src`` is added there (``dst``'s old value the left operand, as ``dst.add_(src)``) and the
        sum comes back down into ``dst``. The host adds nothing; ``scratch`` is only ever used on the copy stream.

        On a GPU, queued as ``copy`` is (the copy up may run before ``after`` completes; the add waits for it).
        """
        def add():
            scratch.add_(src)
            dst.copy_(scratch, non_blocking=True)
        return self._queued(src, after, add, before=lambda: scratch.copy_(dst, non_blocking=True))

    def _queued(self, src: torch.Tensor, after, work, before=None) -> Ticket:
        """Run ``before()``, then ``work()`` once ``after`` is complete: on the host at once (every ticket done); on a
        GPU queued on the copy stream behind everything queued so far on the compute stream, the device ``src``
        kept from the caching allocator's reuse until then (a reduction's own output, HSDP's, is dropped by its
        owner while its copy down may still run; what is copied up lands in buffers as long-lived as the
        optimizer)."""
        if self.stream is None:
            if before is not None:
                before()
            if after is not None:
                after.wait()
            work()
            return DONE
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if src.is_cuda:
            src.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            if before is not None:
                before()
            if after is not None:
                after.wait()  # an NCCL Work's wait() orders the current (copy) stream after it
            work()
            return Ticket(self.stream.record_event())


_PER_DEVICE: dict[torch.device, Transfers] = {}


def transfers(device: torch.device) -> Transfers:
    """The one ``Transfers`` of ``device`` (a stream per device is enough: copies queue in order)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    t = _PER_DEVICE.get(device)
    if t is None:
        t = _PER_DEVICE[device] = Transfers(device)
    return t


def _mapped(numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap]:
    """A tensor of zeros over anonymous memory of its own, and that mapping (alive while any view is)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    mapping = mmap.mmap(-1, max(1, numel) * itemsize)
    if numel == 0:  # (torch.frombuffer refuses a count of 0): a partition of 0-element parameters
        return torch.empty(0, dtype=dtype), mapping
    return torch.frombuffer(mapping, dtype=dtype, count=numel), mapping


def aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A host tensor of zeros at a page boundary (as O_DIRECT transfers need)."""
    return _mapped(numel, dtype)[0]


def host_buffer(numel: int, dtype: torch.dtype, pinned: bool = True) -> torch.Tensor:
    """A host tensor of zeros; page-locked where CUDA runs and ``pinned`` (copies to and from it then run
    asynchronously; callers pass ``pinned=False`` when it is never copied to a GPU, which also keeps a
    CPU-only run on a GPU machine from creating a CUDA context). Locked at its exact size with
    cudaHostRegister: torch's pinned allocator rounds every block up to a power of two, up to twice the
    bytes for a multi-GB gradient shard."""
    t, mapping = _mapped(numel, dtype)
    if pinned and numel and torch.cuda.is_available():
        _page_lock(t, mapping)
    return t


_LOCKED = [0]  # bytes page-locked by host_buffer and not yet released


def locked_bytes() -> int:
    """Host bytes fused_zero holds page-locked now (``host_buffer``'s exact-size registrations; torch's own pinned
    allocations, ``torch.cuda.host_memory_stats()``, are apart): what the planner's ``host_pinned`` predicts."""
    return _LOCKED[0]


def _unlock(cudart, ptr: int, nbytes: int) -> None:
    cudart.cudaHostUnregister(ptr)
    _LOCKED[0] -= nbytes


def _page_lock(t: torch.Tensor, mapping: mmap.mmap) -> None:
    """Register ``t``'s memory with CUDA until ``mapping`` goes (a warning, and pageable copies, if refused)."""
    cudart = torch.cuda.cudart()
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        warnings.warn(f"fused_zero: could not page-lock {nbytes} bytes of host memory (cudaHostRegister: {err}); "
                      "copies to and from it will not overlap with the GPU's work: raise the locked-memory limit "
                      "(ulimit -l) or free host memory", RuntimeWarning, stacklevel=3)
        return
    _LOCKED[0] += nbytes
    # the finalizer runs when the last view is gone, before the memory is unmapped
    weakref.finalize(mapping, _unlock, cudart, ptr, nbytes)


class Uploads:
    """Pinned host buffers, used in turn, that the host update writes narrow params into; each is copied
    up to its place on the device while the host goes on with the next chunk.

    ``buffer(n)`` hands out the next one (waiting, on the host, for the copy that last used it),
    ``send(dst)`` copies it up to ``dst``, and ``finish()`` makes the compute stream wait for every
    copy (before the all-gather reads what went up). With ``depth`` buffers, ``depth - 1`` copies
    overlap the update of the next chunk.
    """

    def __init__(self, dtype: torch.dtype, chunk_numel: int, depth: int = 2) -> None:
        self.dtype, self.chunk_numel, self.depth = dtype, chunk_numel, depth
        self._buffers: list[torch.Tensor] = []
        self._tickets: list[Ticket] = [DONE] * depth
        self._next = 0
        self._current: torch.Tensor | None = None

    def buffer(self, numel: int) -> torch.Tensor:
        if numel > self.chunk_numel:
            raise ValueError(f"a chunk of {numel} elements does not fit the {self.chunk_numel}-element staging buffers")
        i = self._next
        if len(self._buffers) <= i:
            self._buffers.append(host_buffer(self.chunk_numel, self.dtype))
        self._tickets[i].wait()
        self._current = self._buffers[i][:numel]
        return self._current

    def send(self, dst: torch.Tensor) -> None:
        if self._current is None:
            raise RuntimeError("Uploads.send() without a buffer() to send")
        self._tickets[self._next] = transfers(dst.device).copy(dst, self._current)
        self._current = None
        self._next = (self._next + 1) % self.depth

    def finish(self) -> None:
        """Work queued from now on the compute stream sees every copy sent."""
        for t in self._tickets:
            t.order_before()
        self._current = None

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers)
