"""Test set-up: run Triton kernels under the interpreter where there is no GPU.

TRITON_INTERPRET must be set before triton is first imported, so it is set
here, before any test module loads.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
