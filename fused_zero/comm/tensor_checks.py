"""What a collective's tensors must be, checked before it starts (no torch.distributed here).

Tensors must be contiguous: gloo's all_reduce of a strided tensor silently returns wrong values
(measured on torch 2.13: [3, 3, 1, 1] for [3, 3, 3, 3]). They must be on CPU for gloo and on CUDA
for nccl. A reduce-scatter's or all-gather's two tensors share dtype and device, one holds world_size
times the other, and they overlap only where the small one is this rank's slice of the big one.
"""
from __future__ import annotations

import torch

from ..sharding.intervals import overlaps

_DEVICE_FOR_BACKEND = {"gloo": "cpu", "nccl": "cuda"}


class TensorChecks:
    """``Comm``'s argument checks (a mixin: they read the communicator's rank, world size and backend)."""

    def _check_tensor(self, what: str, t: object) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{what} must be contiguous; pass a flat buffer or .contiguous()")
        need = _DEVICE_FOR_BACKEND.get(self.backend)
        if not self._local and need is not None and t.device.type != need:
            raise ValueError(f"{what} is on {t.device}, but the {self.backend} backend needs {need} tensors")
        return t

    def _check_pair(self, name: str, big_name: str, big: torch.Tensor,
                    small_name: str, small: torch.Tensor) -> None:
        """``big`` holds world_size × ``small``; the only overlap allowed is small = this rank's slice."""
        self._check_tensor(f"{name} {big_name}", big)
        self._check_tensor(f"{name} {small_name}", small)
        if big.dtype != small.dtype:
            raise TypeError(f"{name} {big_name} is {big.dtype} but {small_name} is {small.dtype}; "
                            "they must match")
        if big.device != small.device:
            raise ValueError(f"{name} {big_name} is on {big.device} but {small_name} is on {small.device}")
        if big.numel() != self.world_size * small.numel():
            raise ValueError(
                f"{name} {big_name} has {big.numel()} elements; it must be world_size ({self.world_size}) "
                f"× {small_name} ({small.numel()}) = {self.world_size * small.numel()}"
            )
        own = big.data_ptr() + self.rank * small.numel() * small.element_size()
        if overlaps(big, small) and small.data_ptr() != own:
            raise ValueError(
                f"{name} {small_name} overlaps {big_name} but is not its slice "
                f"[rank*n:(rank+1)*n] = [{self.rank * small.numel()}:{(self.rank + 1) * small.numel()}]; "
                f"pass a separate buffer or exactly that slice"
            )
