"""Triton kernels for the CUDA path, each module holding its kernel, its launcher and the torch reference it is
tested against.

Dispatch rule (one place, here): a kernel runs when Triton is importable, the tensors are on a CUDA device and
``DEEPINFER_TRITON`` is not ``0``; everything else takes the torch path the models already have. On CPU the
kernels are exercised only by the tests, under Triton's interpreter (``TRITON_INTERPRET=1``, which must be set
before ``triton`` is imported; tests/conftest.py does so when no GPU is present). The interpreter runs each
program in numpy: tiny shapes only, and ``tl.dot`` on bf16 is not exact there, so tests feed float32.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is optional: absent, every caller uses its torch reference
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAS_TRITON = False


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_enabled(t: torch.Tensor) -> bool:
    """Whether the Triton kernels serve tensors like `t` (CUDA, Triton present, not turned off)."""
    return triton_on(t.device)


def triton_on(device: torch.device) -> bool:
    """Whether the Triton kernels serve tensors on `device` (CUDA, Triton present, DEEPINFER_TRITON not 0)."""
    return HAS_TRITON and device.type == "cuda" and os.environ.get("DEEPINFER_TRITON", "1") != "0"


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1) (Triton block shapes must be powers of two)."""
    return 1 << max(int(n) - 1, 0).bit_length()
