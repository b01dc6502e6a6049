"""The bytes each collective moved, per rank, as the ZeRO paper counts volume (no torch.distributed here).

A reduce_scatter counts its input's bytes (an all_to_all too), an all_gather its output's, an all_reduce
twice its tensor's (a reduce-scatter and an all-gather: 2Ψ); a codec's exchanges count under kinds of their own.
A communicator over one rank counts nothing.
"""
from __future__ import annotations

import torch


class TrafficCount:
    """``Comm``'s traffic counts (a mixin: it reads whether the communicator runs locally)."""

    def traffic(self) -> dict[str, int]:
        """Bytes per collective kind since the last reset (a copy)."""
        return dict(self._traffic)

    def reset_traffic(self) -> None:
        self._traffic = {"reduce_scatter": 0, "all_gather": 0, "all_reduce": 0}

    def add_traffic(self, counted: dict[str, int]) -> None:
        """Add bytes counted elsewhere (a replayed CUDA graph's collectives, counted when it was captured)."""
        for kind, n in counted.items():
            self._traffic[kind] = self._traffic.get(kind, 0) + n

    def _count(self, kind: str, t: torch.Tensor, times: int = 1) -> None:
        """Volume as the ZeRO paper counts it: a reduce-scatter its input, an all-gather its output, an all-reduce
        twice its tensor (a reduce-scatter and an all-gather: 2Ψ); a codec's exchanges under kinds of their own."""
        if not self._local:
            self._traffic[kind] = self._traffic.get(kind, 0) + times * t.numel() * t.element_size()
