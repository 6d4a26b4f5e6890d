"""Test-session setup that must happen before any test module imports triton."""

import os

import torch

if not torch.cuda.is_available():  # Triton kernels run under the interpreter on CPU machines
    os.environ.setdefault("TRITON_INTERPRET", "1")
