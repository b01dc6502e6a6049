"""HostStore: the optimizer states of a partition in host memory (``offload_optimizer="cpu"``).

The states live in (pinned, where CUDA runs) host memory and the update runs there with torch's
fused CPU AdamW (all cores). The reduced gradient shard is already on the host (GradSync copied
each bucket down as its reduction completed, during backward). With the parameters on a GPU the
host updates only the fp32 master (kept page-locked), and each updated chunk of it goes up on the
copy stream while the host updates the next one; the GPU rounds it to the parameters' dtype there
(torch's copy_ with a dtype change converts on the GPU for a non-blocking copy). The host then never
makes the rounding pass over the shard: on a 2-core CPU that pass was 27% of the host update of a bf16
model (312 of 1175 us per million elements), and the update is the host's memory bandwidth at work.
It moves 4 bytes per element over PCIe instead of 2 (behind the host update, which reads and writes
26-34 bytes per element) and the rounding is the GPU's (nearest even, as the host's; a NaN's payload bits
may differ). On a CPU-only machine the parameters live on the host and the chunks are views the kernel
writes in place; fp32 parameters there are their own master (``HostParamsAsMaster``).

Why the update waits for step() rather than running per bucket during backward (as the copies
down do): clipping and a GradScaler's overflow check need the global norm of the whole step's
gradient (every bucket, every micro-batch) before any element may change, and the result must
be bitwise that of the update without offload. torchao's CPUOffloadOptimizer makes the same
choice. At stage 3 it then runs behind step(), overlapping the next forward (``behind.py``).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from .store import ParamsAsMaster, ShardStore, StateChunk, _chunks_of
from .staging import Staging
from .tier import Tier
from .transfer import DONE, Ticket, host_buffer, transfers


class HostStore(ShardStore):
    """The states in host memory; the update runs on the host, staged chunk by chunk."""

    tier = Tier.HOST
    #: True: the parameters on the host go up as if they were on a GPU, from the master after each chunk (the
    #: tests' way to run that path on CPU: every copy then synchronous, every ticket done)
    copy_up = False

    def __init__(self, numel: int, device: torch.device, amsgrad: bool = False, chunk_numel: int = 1 << 20,
                 staging: Staging | None = None, pin_master: bool = True) -> None:
        """``staging``: the optimizer's staging, whose chunk size wins (HostStore borrows no buffer of it: its
        master goes up as it is); ``pin_master``: the master goes up to the parameters' GPU (False where the
        param shard lives on the host, which the update writes in place)."""
        super().__init__(numel, amsgrad)
        self.device = device
        self.chunk_numel = (staging or Staging(chunk_numel)).chunk_numel
        # the master goes up to a GPU chunk by chunk after each update: page-locked there; the moments never
        # leave the host
        pinned = pin_master and device.type == "cuda"
        self.tensors = {kind: host_buffer(numel, torch.float32, pinned=pinned and kind == "master")
                        for kind in self.kinds}
        # the copies up of the master in flight, as (start, end, the last copy's ticket) per update_chunks call:
        # the host rewrites no element of the master before its copy up is over
        self._uploading: list[tuple[int, int, Ticket]] = []

    def read(self, kind: str, start: int, end: int) -> torch.Tensor:
        self._check(kind, start, end)
        return self.tensors[kind][start:end].clone()

    def write(self, kind: str, start: int, values: torch.Tensor) -> None:
        self._check(kind, start, start + values.numel())
        self._settle_uploads(start, start + values.numel())
        self.tensors[kind][start:start + values.numel()].copy_(values.reshape(-1))

    def update_chunks(self, ranges, grad: torch.Tensor, param_out: torch.Tensor | None) -> Iterator[StateChunk]:
        if param_out is None or (param_out.device.type == "cpu" and not self.copy_up):
            yield from _chunks_of(self.tensors, ranges, grad, param_out)  # the kernel writes the params in place
            return
        ranges = list(ranges)
        if not ranges:
            return
        # the parameters are on a GPU: chunks of at most chunk_numel update the master, which goes up chunk by
        # chunk (rounded on the GPU) while the host updates the next one
        copies = transfers(param_out.device)
        lo, hi = min(a for a, _ in ranges), max(b for _, b in ranges)
        self._settle_uploads(lo, hi)  # the last step's copies up of this range (long over: the gradients came
        last = DONE                   # down behind them on the same stream); another bucket's are left to run
        try:
            for start, end in ranges:
                for a in range(start, end, self.chunk_numel):
                    b = min(end, a + self.chunk_numel)
                    yield next(_chunks_of(self.tensors, [(a, b)], grad, None))
                    last = copies.copy(param_out[a:b], self.tensors["master"][a:b])
        finally:
            # the gather reads the params after they are up (a failed step rewrites them after); copies on one
            # stream complete in order, so the last one's event stands for all
            last.order_before()
            self._uploading.append((lo, hi, last))

    def _settle_uploads(self, start: int, end: int) -> None:
        """Wait for the copies up that read master elements in [start, end); forget those that are over."""
        keep = []
        for a, b, ticket in self._uploading:
            if a < end and start < b:
                ticket.wait()
            elif not ticket.done():
                keep.append((a, b, ticket))
        self._uploading = keep

    def gather_source(self, start: int, end: int) -> None:
        return None  # the master is on the host: the partition keeps a device param shard to gather

    def nbytes(self) -> dict[str, int]:
        return {kind: t.numel() * t.element_size() for kind, t in self.tensors.items()}



class HostParamsAsMaster(ParamsAsMaster):
    """``offload_optimizer="cpu"`` on a CPU-only run, fp32 parameters at stages 1-2: the parameters already live
    in host memory, so this rank's slices of their flat buffer are the master, as without offload
    (``ParamsAsMaster``), and the moments are host tensors. A separate master there would hold the same bits
    at 4 more bytes per shard element and cost a copy of the shard into the parameters every step (measured:
    the in-memory step's peak RSS + 228 MiB and about 16 ms a step on the 60M-parameter MLP of
    ``bench/bench_offload.py``). Its bytes count under "host" (``memory_bytes()``); the master's under "params".
    ``HostStore.copy_up`` (the tests' way to run a GPU's path on CPU) keeps the separate master."""

    tier = Tier.HOST
