"""fused_zero: ZeRO stages 1-3 with fused Triton AdamW, a drop-in for torch.optim."""
from .config import ZeroConfig
from .optimizer import ShardedOptimizer

__all__ = ["ShardedOptimizer", "ZeroConfig"]
