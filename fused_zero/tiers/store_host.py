"""HostStore: the optimizer states of a partition in host memory (``offload_optimizer="cpu"``).

The states live in (pinned, where CUDA runs) host memory and the update runs there with torch's
fused CPU AdamW (all cores). The reduced gradient shard is already on the host (GradSync copied
each bucket down as its reduction completed, during backward). With the parameters on a GPU the
kernel writes each chunk's narrow params into a pinned staging buffer that is copied up on a
side stream while the host updates the next chunk (``transfer.Uploads``); on a CPU-only machine
the parameters live on the host and the chunks are views the kernel writes in place.

Why the update waits for step() rather than running per bucket during backward (as the copies
down do): clipping and a GradScaler's overflow check need the global norm of the whole step's
gradient (every bucket, every micro-batch) before any element may change, and the result must
be bitwise that of the update without offload. torchao's CPUOffloadOptimizer makes the same
choice. At stage 3 it then runs behind step(), overlapping the next forward (``behind.py``).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from .store import ShardStore, StateChunk, _chunks_of
from .staging import Staging
from .tier import Tier
from .transfer import host_buffer


class HostStore(ShardStore):
    """The states in host memory; the update runs on the host, staged chunk by chunk."""

    tier = Tier.HOST

    def __init__(self, numel: int, device: torch.device, amsgrad: bool = False, chunk_numel: int = 1 << 20,
                 staging: Staging | None = None) -> None:
        """``staging``: the buffers shared with the optimizer's other stores (its chunk size wins)."""
        super().__init__(numel, amsgrad)
        self.device = device
        self.staging = staging or Staging(chunk_numel)
        self.chunk_numel = self.staging.chunk_numel
        # never copied to or from a GPU as they are (the update stages chunks): not page-locked
        self.tensors = {kind: host_buffer(numel, torch.float32, pinned=False) for kind in self.kinds}

    def read(self, kind: str, start: int, end: int) -> torch.Tensor:
        self._check(kind, start, end)
        return self.tensors[kind][start:end].clone()

    def write(self, kind: str, start: int, values: torch.Tensor) -> None:
        self._check(kind, start, start + values.numel())
        self.tensors[kind][start:start + values.numel()].copy_(values.reshape(-1))

    def update_chunks(self, ranges, grad: torch.Tensor, param_out: torch.Tensor | None) -> Iterator[StateChunk]:
        if param_out is None or param_out.device.type == "cpu":  # the kernel writes the params in place
            yield from _chunks_of(self.tensors, ranges, grad, param_out)
            return
        # the parameters are on a GPU: chunks of at most chunk_numel, their new params going up pipelined
        uploads = self.staging.uploads(param_out.dtype)
        try:
            for start, end in ranges:
                for a in range(start, end, self.chunk_numel):
                    b = min(end, a + self.chunk_numel)
                    chunk = next(_chunks_of(self.tensors, [(a, b)], grad, None))
                    yield chunk._replace(param_out=uploads.buffer(b - a))
                    uploads.send(param_out[a:b])
        finally:
            uploads.finish()  # the gather reads the params after they are up (a failed step rewrites them after)

    def gather_source(self) -> None:
        return None  # the master is on the host: the partition keeps a device param shard to gather

    def nbytes(self) -> dict[str, int]:
        return {kind: t.numel() * t.element_size() for kind, t in self.tensors.items()}

