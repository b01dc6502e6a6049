"""fused_zero: ZeRO stages 1-3 with fused Triton AdamW, a drop-in for torch.optim."""
from .config import ZeroConfig
from .joint_clip import clip_grad_norm_
from .optimizer import ShardedOptimizer
from .state_views import StateShard

__all__ = ["ShardedOptimizer", "StateShard", "ZeroConfig", "clip_grad_norm_"]
