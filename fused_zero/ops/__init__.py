"""The fused ops of fused_zero: argument checks, then the backend for the tensors' device.

One module per op (``adamw``, ``norm``, ``cast``, ``pack``, ``quant``), each with its
pure-torch twin beside it (``adamw_twin``, ``pack_twin``, or in the module) and
its registration in ``_backend``: CUDA tensors run the Triton kernels in
``fused_zero.kernels`` (imported on first use only), CPU tensors torch's own
fused CPU AdamW (``adamw_``) or the twins; ``FUSED_ZERO_BACKEND=triton|torch``
forces one.
"""
from .adamw import adamw_, adamw_checked_, check_hyper
from .cast import cast_
from .norm import NormStats, norm_stats, norm_stats_many
from .pack import PackPlan, pack_, pack_checked_, pack_plan, unpack_
from .quant import dequantize_, payload_bytes, quantize_

__all__ = ["NormStats", "PackPlan", "adamw_", "adamw_checked_", "cast_", "check_hyper", "dequantize_", "norm_stats",
           "norm_stats_many", "pack_", "pack_checked_", "pack_plan", "payload_bytes", "quantize_", "unpack_"]
