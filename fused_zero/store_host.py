"""HostStore: the optimizer states of a partition in host memory (``offload_optimizer="cpu"``).

The states live in (pinned, where CUDA runs) host memory and the update runs there with torch's
fused CPU AdamW. Each chunk's gradient shard is copied to a host staging buffer and the narrow
param shard the kernel writes there is copied back to the device; on a CPU-only machine the
gradient and param shards already live on the host and the chunks are views (the same code
path, so the tests here exercise it).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from .config import ALIGN
from .store import ShardStore, StateChunk, _chunks_of


def _host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype, pin_memory=torch.cuda.is_available())


class HostStore(ShardStore):
    """The states in host memory; the update runs on the host, staged chunk by chunk."""

    tier = "host"

    def __init__(self, numel: int, device: torch.device, amsgrad: bool = False, chunk_numel: int = 1 << 20) -> None:
        super().__init__(numel, amsgrad)
        self.device = device
        self.chunk_numel = -(-max(1, chunk_numel) // ALIGN) * ALIGN  # whole lanes: see store_nvme.py
        self.tensors = {kind: _host_empty(numel, torch.float32) for kind in self.kinds}
        self._staging: dict = {}

    def read(self, kind: str, start: int, end: int) -> torch.Tensor:
        self._check(kind, start, end)
        return self.tensors[kind][start:end].clone()

    def write(self, kind: str, start: int, values: torch.Tensor) -> None:
        self._check(kind, start, start + values.numel())
        self.tensors[kind][start:start + values.numel()].copy_(values.reshape(-1))

    def _stage(self, name: str, like: torch.Tensor, n: int) -> torch.Tensor:
        buf = self._staging.get((name, like.dtype))
        if buf is None or buf.numel() < n:
            buf = self._staging[(name, like.dtype)] = _host_empty(max(n, self.chunk_numel), like.dtype)
        return buf[:n]

    def update_chunks(self, ranges, grad: torch.Tensor, param_out: torch.Tensor | None) -> Iterator[StateChunk]:
        if grad.device.type == "cpu" and (param_out is None or param_out.device.type == "cpu"):
            yield from _chunks_of(self.tensors, ranges, grad, param_out)
            return
        for start, end in ranges:  # the device holds the grad and param shards: stage each chunk
            for a in range(start, end, self.chunk_numel):
                b = min(end, a + self.chunk_numel)
                g = self._stage("grad", grad, b - a)
                g.copy_(grad[a:b])
                out = None if param_out is None else self._stage("param", param_out, b - a)
                states = next(_chunks_of(self.tensors, [(a, b)], grad, None))
                yield states._replace(grad=g, param_out=out)
                if out is not None:
                    param_out[a:b].copy_(out)

    def gather_source(self) -> None:
        return None  # the master is on the host: the partition keeps a device param shard to gather

    def nbytes(self) -> dict[str, int]:
        return {kind: t.numel() * t.element_size() for kind, t in self.tensors.items()}
