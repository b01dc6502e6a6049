"""Staging: the host buffers one optimizer's offloaded stores stream their chunks through, shared.

The update runs the partitions one after another (update.py), so one set of staging buffers serves
them all: host memory for staging stays bounded by the chunk size, however many partitions there
are (stage 3 has one per unit and dtype). Two kinds, made on first use:

- ``blocks(kinds, numel)``: NvmeStore's three sets of fp32 blocks (one block per state kind each),
  the one being updated, the one read ahead and the one written behind; a block holds a chunk, or
  the largest store's states where every store is smaller than a chunk (grown when a larger one
  asks, as after ``add_param_group``);
- ``uploads(dtype)``: the pinned buffers NvmeStore's new narrow params go up to a GPU through
  (``transfer.Uploads``; unused when the parameters live on the host). HostStore takes only the chunk
  size: its page-locked master goes up as it is.

A store borrows them only inside ``update_chunks``; stores of two optimizers never share.
"""
from __future__ import annotations

import torch

from ..config import ALIGN
from .transfer import Uploads, aligned_empty


#: O_DIRECT blocks: whole 4 KiB units (a multiple of ALIGN: config.ALIGN's chunk-edge rule still holds)
DIRECT_ELEMENTS = 1024


def whole_lanes(chunk_numel: int, multiple: int = ALIGN) -> int:
    """``chunk_numel`` rounded up to a multiple of ``multiple`` (ALIGN: config.ALIGN's chunk-edge rule)."""
    return -(-max(1, chunk_numel) // multiple) * multiple


class Staging:
    """The staging buffers of one optimizer's stores (chunks of ``chunk_numel`` elements)."""

    def __init__(self, chunk_numel: int = 1 << 20, direct: bool = False) -> None:
        """``direct``: blocks for O_DIRECT (whole 4 KiB units, page-aligned)."""
        self.direct = direct
        self.chunk_numel = whole_lanes(chunk_numel, DIRECT_ELEMENTS if direct else ALIGN)
        self._blocks: list[dict[str, torch.Tensor]] = []
        self._block_numel = 0  # elements of each block made so far (at most chunk_numel)
        self._uploads: dict[torch.dtype, Uploads] = {}

    def blocks(self, kinds: tuple[str, ...], numel: int | None = None) -> list[dict[str, torch.Tensor]]:
        """Three dicts of an fp32 block per kind in ``kinds`` (more kinds, amsgrad's, are added when asked),
        each block at least ``min(numel, chunk_numel)`` elements (``numel``: the asking store's; None: a chunk).
        Blocks made for a smaller store are replaced (the stores update one after another: none is in use)."""
        unit = DIRECT_ELEMENTS if self.direct else ALIGN
        need = self.chunk_numel if numel is None else min(self.chunk_numel, whole_lanes(numel, unit))
        if need > self._block_numel:
            self._blocks, self._block_numel = [], need
        if not self._blocks:
            self._blocks = [{} for _ in range(3)]
        for buf in self._blocks:
            for kind in kinds:
                if kind not in buf:
                    try:
                        buf[kind] = aligned_empty(self._block_numel, torch.float32)  # zeros, like any fresh mapping
                    except (OSError, MemoryError, RuntimeError) as e:
                        raise MemoryError(
                            f"fused_zero offload: the staging blocks (three per state kind, offload_chunk_numel="
                            f"{self.chunk_numel} fp32 elements, {4 * self._block_numel / 2**30:.3g} GiB each) could "
                            f"not be allocated ({e}): pass a smaller offload_chunk_numel (the default, 2**20, "
                            "streams as fast)") from e
        return self._blocks

    def uploads(self, dtype: torch.dtype) -> Uploads:
        up = self._uploads.get(dtype)
        if up is None:
            up = self._uploads[dtype] = Uploads(dtype, self.chunk_numel)
        return up

    def nbytes(self) -> int:
        blocks = sum(t.numel() * t.element_size() for buf in self._blocks for t in buf.values())
        return blocks + sum(up.nbytes() for up in self._uploads.values())
