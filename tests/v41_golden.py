"""Shared by the V4.1 parity tests: where the goldens live and the thread count they were generated with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

GOLDEN = Path(__file__).parent / "golden" / "v41"
GOLDEN_THREADS = 2  # the reference's float32 GEMMs split work by intra-op threads (tests/golden/v41/README.md)


@pytest.fixture(autouse=True)
def golden_threads():
    """Every test of a module that imports this runs at the goldens' thread count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(GOLDEN_THREADS)
    yield
    torch.set_num_threads(previous)
