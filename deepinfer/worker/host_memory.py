"""The host allocator of a CPU engine: freed step buffers stay with the process.

glibc's malloc hands an allocation above its mmap threshold (dynamic, from 128 KiB) its own fresh pages and gives
them back to the kernel when freed, and trims the heap top above 128 KiB. An eager step allocates and frees the
same megabytes of activations every step (a V4 prompt chunk's [T, H, 512] tensors are 16 MiB each at 2,048
tokens), so every step paid the kernel's page faults and zeroing again: an element-wise op over fresh pages ran at
a quarter of its speed. With the thresholds raised, freed buffers are reused from the heap (measured with
benchmarks/v4_prefill.py: 1.2-1.9x on V4 prompt steps). Allocations above 32 MiB (glibc's cap for the mmap
threshold) still map pages of their own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger("deepinfer")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's upper limit (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 1 << 30  # free heap top kept before giving memory back
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def should_tune(env: dict[str, str], libc: str) -> bool:
    """Only glibc, and never over a user's own malloc settings (or DEEPINFER_HOST_MALLOC=0)."""
    return libc == "glibc" and env.get("DEEPINFER_HOST_MALLOC", "1") != "0" and not any(k in env for k in USER_SETTINGS)


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True when applied."""
    if not should_tune(dict(os.environ), platform.libc_ver()[0]):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        logger.warning("mallopt refused the allocator thresholds; eager steps may run slower")
    return ok
