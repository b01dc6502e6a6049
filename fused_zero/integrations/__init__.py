"""fused_zero in the frameworks people train with, one line away in each.

    from fused_zero.integrations.transformers import ZeroTrainer      # pip install -e '.[hf]'
    from fused_zero.integrations.lightning import ZeroStrategy        # pip install -e '.[lightning]'
    from fused_zero.integrations import accelerate as fz_accelerate   # pip install -e '.[hf]'

(the extras of a fused_zero checkout; or install the framework itself with pip.)

Importing fused_zero (or this package) never imports a framework: each submodule imports
its own framework when it is imported, and says which extra to install if it is missing.
"""
from __future__ import annotations

import importlib


#: what each extra installs (setup.py's extras_require)
_EXTRAS = {"hf": "transformers accelerate", "lightning": "lightning"}


def require(module: str, extra: str):
    """Import a framework module, or raise an ImportError naming what installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"this fused_zero integration needs {module.split('.')[0]}: pip install "
                          f"{_EXTRAS.get(extra, module.split('.')[0])} (or, in the fused_zero checkout, "
                          f"pip install -e '.[{extra}]')") from e
