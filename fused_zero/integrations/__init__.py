"""fused_zero in the frameworks people train with, one line away in each.

    from fused_zero.integrations.transformers import ZeroTrainer      # pip install fused_zero[hf]
    from fused_zero.integrations.lightning import ZeroStrategy        # pip install fused_zero[lightning]
    from fused_zero.integrations import accelerate as fz_accelerate   # pip install fused_zero[hf]

Importing fused_zero (or this package) never imports a framework: each submodule imports
its own framework when it is imported, and says which extra to install if it is missing.
"""
from __future__ import annotations

import importlib


def require(module: str, extra: str):
    """Import a framework module, or raise an ImportError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"this fused_zero integration needs {module.split('.')[0]}: "
                          f"pip install 'fused_zero[{extra}]'") from e
