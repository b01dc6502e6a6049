"""Where a partition's narrow param shard lives between uses: the ParamShard tiers.

The narrow param shard is this rank's part of every bucket of a partition, in the parameters'
dtype: the update writes it (the fused kernel rounds the fp32 master into it) and the
all-gather reads it. Four owners:

- ``OwnSlices`` (stages 1-2 with offloaded optimizer states): no buffer of its own; the
  shard *is* this rank's slice of every bucket of the full flat buffer, which stays resident.
  The update writes the new values straight into the parameters and the all-gather is in place.
  fp32 parameters at stages 1-2 with the states on the device use it as their master
  (``store.ParamsAsMaster``) and need no narrow shard at all.
- ``DeviceParamShard``: a tensor beside the parameters (stage 3, and narrow parameters at
  stages 1-2 without offload).
- ``HostParamShard`` (``offload_params="cpu"``): a tensor in host memory (pinned where CUDA
  runs), copied to the device when its unit is gathered; on a CPU-only machine the gather
  reads it in place.
- ``NvmeParamShard`` (``offload_params="nvme"``): a private file under ``nvme_path`` (space
  reserved when built, so rewriting it never runs out of room; ``ScratchFile.reserve``), read on a
  thread when the unit's gather is prefetched; host memory holds a shard only while its unit is
  gathered. A failed write (an I/O error) raises at ``flush()``; the partition then rewrites the
  shard from the fp32 master (``Partition.param_shard_lost``, ``update.rollback``).

The verbs: ``sink()`` (what the update writes into: ``sink[a:b]`` is a tensor where the
kernel runs; ``flush()`` makes what was written the shard), ``fetch()`` (start bringing the
shard to the device), ``source(a, b)`` (the gather's input, waiting for the fetch),
``drop()`` (the staged copy is no longer needed), ``write`` / ``read`` and ``nbytes``.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..sharding.layout import FlatLayout
from .scratch import ScratchFile
from .staging import whole_lanes
from .tier import Tier
from .transfer import host_buffer


def _host_tensor(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A short-lived pinned buffer (an NVMe read for one gather): torch's pinned allocator caches and reuses it."""
    return torch.empty(numel, dtype=dtype, pin_memory=torch.cuda.is_available())


class ParamShard:
    """The device tier: a tensor beside the parameters. The base of the other tiers."""

    tier = Tier.DEVICE
    #: True where the shard is the parameters' own memory (nothing to copy when they change)
    is_params = False

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, kernel_device: torch.device,
                 chunk_numel: int = 1 << 20) -> None:
        self.numel = numel
        self.dtype = dtype
        self.device = device
        self.kernel_device = kernel_device  # where the update kernel writes the new values
        self.chunk_numel = whole_lanes(chunk_numel)  # config.ALIGN's chunk-edge rule

    def edges(self) -> list[int]:
        """Shard offsets at which the update must cut its chunks (none by default)."""
        return []

    # the update
    def sink(self):
        raise NotImplementedError

    def flush(self) -> None:
        """What the update wrote through ``sink()`` is the shard now."""

    # the gather
    def fetch(self) -> None:
        """Start bringing the shard to the parameters' device (a prefetch; ``source`` waits for it)."""

    def source(self, start: int, end: int) -> torch.Tensor:
        raise NotImplementedError

    def drop(self) -> None:
        """The gather no longer needs a staged copy."""

    def stage(self, values: torch.Tensor) -> None:
        """Serve ``values`` (the whole shard, on the host) to the next gather in place of a read that failed
        (only the NVMe tier reads)."""
        raise NotImplementedError(f"{type(self).__name__} never reads, so never stages a substitute")

    def discard(self) -> None:
        """A step failed: forget what the update handed out and wait for writes in flight (errors ignored)."""

    # everything else
    def write(self, start: int, values: torch.Tensor) -> None:
        raise NotImplementedError

    def nbytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class DeviceParamShard(ParamShard):
    def __init__(self, numel, dtype, device, kernel_device=None, chunk_numel=1 << 20) -> None:
        super().__init__(numel, dtype, device, device, chunk_numel)
        self.tensor = torch.empty(numel, dtype=dtype, device=device)

    def sink(self) -> torch.Tensor:
        return self.tensor

    def source(self, start, end):
        return self.tensor[start:end]

    def write(self, start, values):
        self.tensor[start:start + values.numel()].copy_(values.reshape(-1))

    def nbytes(self):
        return self.tensor.numel() * self.tensor.element_size()


class OwnSlices(ParamShard):
    """This rank's slices of the resident full flat buffer, addressed in shard elements."""

    is_params = True

    def __init__(self, flat: torch.Tensor, layout: FlatLayout, rank: int) -> None:
        super().__init__(layout.shard_numel, flat.dtype, flat.device, flat.device)
        self.flat = flat
        self.layout = layout
        self.rank = rank
        self._starts = [b.shard_offset for b in layout.buckets]

    def edges(self) -> list[int]:
        """Shard offsets where a bucket starts: an update chunk never crosses one."""
        return self._starts[1:]

    def _view(self, start: int, end: int) -> torch.Tensor:
        k = bisect.bisect_right(self._starts, start) - 1
        b = self.layout.buckets[k]
        if end > b.shard_offset + b.shard_numel:
            raise ValueError(f"shard range [{start}, {end}) crosses the end of bucket {k}")
        at = self.layout.shard_range(b, self.rank)[0] + start - b.shard_offset
        return self.flat[at:at + end - start]

    # ``sink()[a:b]`` is a view of the parameters: what the kernel writes is final at once
    def sink(self) -> OwnSlices:
        return self

    def __getitem__(self, s: slice) -> torch.Tensor:
        return self._view(s.start, s.stop)

    def source(self, start, end):
        return self._view(start, end)

    def _runs(self, start: int, end: int) -> Iterator[tuple[int, int]]:
        """[start, end) cut at the bucket edges, in order."""
        k = max(0, bisect.bisect_right(self._starts, start) - 1)
        for b in self.layout.buckets[k:]:
            a, z = max(start, b.shard_offset), min(end, b.shard_offset + b.shard_numel)
            if b.shard_offset >= end:
                break
            if a < z:
                yield a, z

    def read(self, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) as one tensor (a view within one bucket, a new tensor across several)."""
        parts = [self._view(a, z) for a, z in self._runs(start, end)]
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else self.flat[:0]

    def write(self, start, values):
        values = values.reshape(-1)
        for a, z in self._runs(start, start + values.numel()):
            self._view(a, z).copy_(values[a - start:z - start])


class _Sink:
    """What the update writes a staged tier through: ``[a:b]`` hands out a fresh buffer where the
    kernel runs; the previous one is handed to ``persist`` then (and the last at ``flush``)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, persist: Callable[[int, torch.Tensor], None]):
        self.device, self.dtype, self._persist = device, dtype, persist
        self._pending: tuple[int, torch.Tensor] | None = None

    def __getitem__(self, s: slice) -> torch.Tensor:
        self.flush()
        t = torch.empty(s.stop - s.start, dtype=self.dtype, device=self.device)
        self._pending = (s.start, t)
        return t

    def flush(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._persist(*pending)


class HostParamShard(ParamShard):
    """``offload_params="cpu"``: the shard in (pinned) host memory."""

    tier = Tier.HOST

    def __init__(self, numel, dtype, device, kernel_device, chunk_numel=1 << 20) -> None:
        super().__init__(numel, dtype, device, kernel_device, chunk_numel)
        # page-locked at its exact size (transfer.host_buffer) when it is copied to a GPU
        self.tensor = host_buffer(numel, dtype, pinned=device.type == "cuda")
        self._staged: torch.Tensor | None = None
        self._sink: _Sink | None = None

    def edges(self):
        return [] if self.kernel_device.type == "cpu" else list(range(self.chunk_numel, self.numel, self.chunk_numel))

    def sink(self):
        self.drop()
        if self.kernel_device.type == "cpu":
            return self.tensor  # the update runs on the host: it writes the shard in place
        self._sink = _Sink(self.kernel_device, self.dtype, self.write)
        return self._sink

    def flush(self):
        if self._sink is not None:
            self._sink.flush()
            self._sink = None
        self.drop()

    def discard(self):
        self._sink = None

    def fetch(self):
        if self.device.type != "cpu" and self._staged is None:
            self._staged = self.tensor.to(self.device, non_blocking=True)

    def source(self, start, end):
        if self.device.type == "cpu":
            return self.tensor[start:end]  # the parameters' device is the host: gathered in place
        self.fetch()
        return self._staged[start:end]

    def drop(self):
        self._staged = None

    def write(self, start, values):
        self.drop()
        self.tensor[start:start + values.numel()].copy_(values.reshape(-1))

    def nbytes(self):
        return self.tensor.numel() * self.tensor.element_size()


class NvmeParamShard(ParamShard):
    """``offload_params="nvme"``: the shard in a private file, read on a thread for each gather."""

    tier = Tier.NVME

    def __init__(self, numel, dtype, device, kernel_device, chunk_numel=1 << 20, *, path: str) -> None:
        super().__init__(numel, dtype, device, kernel_device, chunk_numel)
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        self.file = ScratchFile(path, "params", what="NVMe parameter shard", label="NVMe parameter offload")
        self.path = self.file.path
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fused_zero-nvme-params")
        self._reading: Future | None = None
        self._writes: list[Future] = []
        self._failed: list[OSError] = []  # writes behind that failed this update (raised by flush)
        self._staged: torch.Tensor | None = None
        self._sink: _Sink | None = None
        try:  # reserve the space now: the update rewrites the shard in place and never needs more
            self.file.reserve(numel * self.itemsize, "the parameter shard needs")
        except OSError as e:
            self.close()
            raise self.file.error("reserving space for", e) from None

    def _io(self, write: bool, start: int, t: torch.Tensor) -> None:
        self.file.transfer(write, memoryview(t.view(torch.uint8).numpy()).cast("B"), start * self.itemsize)

    def _read_all(self) -> torch.Tensor:
        host = _host_tensor(self.numel, self.dtype)
        if self.numel:
            self._io(False, 0, host)
        return host

    def _settle(self) -> None:
        """Wait for the writes behind; the first error is raised (naming the file)."""
        while self._writes:
            self._wait_oldest()
        errors, self._failed = self._failed, []
        if errors:
            raise errors[0]

    def _wait_oldest(self) -> None:
        """Wait for the oldest write behind; its error is kept for ``_settle`` (the update it serves never stops
        midway for it: with the states in memory the step goes on, ``Partition.param_shard_lost``)."""
        try:
            self._writes.pop(0).result()
        except OSError as e:
            self._failed.append(e)

    # the update
    def edges(self):
        return list(range(self.chunk_numel, self.numel, self.chunk_numel))

    def sink(self):
        self.drop()
        self._sink = _Sink(self.kernel_device, self.dtype, self._write_behind)
        return self._sink

    def _write_behind(self, start: int, values: torch.Tensor) -> None:
        self.drop()
        host = values if values.device.type == "cpu" else values.to("cpu")
        self._writes.append(self._pool.submit(self._io, True, start, host))
        if len(self._writes) > 2:  # bounded: at most a few chunks in flight
            self._wait_oldest()

    def flush(self):
        if self._sink is not None:
            self._sink.flush()
            self._sink = None
        self._settle()

    def discard(self):
        self._sink = None
        try:
            self._settle()
        except OSError:
            pass

    # the gather
    def fetch(self):
        if self._reading is None and self._staged is None:
            self._settle()
            self._reading = self._pool.submit(self._read_all)

    def source(self, start, end):
        if self._staged is None:
            self.fetch()
            reading, self._reading = self._reading, None
            host = reading.result()
            self._staged = host if self.device.type == "cpu" else host.to(self.device, non_blocking=True)
        return self._staged[start:end]

    def stage(self, values):
        self.drop()
        self._staged = values if self.device.type == "cpu" else values.to(self.device, non_blocking=True)

    def drop(self):
        if self._reading is not None:
            reading, self._reading = self._reading, None
            try:
                reading.result()
            except OSError:
                pass  # a prefetch no longer wanted; the next fetch reads (and raises) again
        self._staged = None

    def write(self, start, values):
        self.drop()
        self._settle()
        self._io(True, start, values.detach().reshape(-1).to("cpu", self.dtype, copy=True))

    def read(self, start: int, end: int) -> torch.Tensor:
        self._settle()
        out = torch.empty(end - start, dtype=self.dtype)
        if end > start:
            self._io(False, start, out)
        return out

    def nbytes(self):
        return self.numel * self.itemsize

    def close(self):
        self.drop()
        self._pool.shutdown(wait=True)
        self.file.close()
