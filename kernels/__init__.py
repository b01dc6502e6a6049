"""Triton kernels of fused_zero, installed as ``fused_zero.kernels``.

Each module holds ``@triton.jit`` kernels and their launchers; the launchers
take validated, contiguous tensors (``fused_zero.ops`` checks them). Their
pure-torch twins live beside each op in ``fused_zero.ops``; ``fused_zero.ops._backend``
is the only place in the package that imports them, on first use.
"""
