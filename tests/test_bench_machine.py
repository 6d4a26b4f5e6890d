"""The machine facts and the peak-memory helper benchmarks record."""

import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.bench.machine import peak_rss_bytes


def _current_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_peak_rss_is_bytes_and_bounds_the_current_rss():
    before = peak_rss_bytes()
    buffer = bytearray(64 * 2**20)  # zero-filled: every page touched
    peak = peak_rss_bytes()
    assert peak >= before and peak > len(buffer)
    # The kernel folds per-thread RSS counters into the high-water mark lazily: allow a little lag.
    assert peak >= 0.95 * _current_rss_bytes()


def test_peak_rss_of_children():
    code = "b = bytearray(48 * 2**20)"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert peak_rss_bytes(children=True) > 48 * 2**20


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="needs Linux /proc")
def test_simd_flags_are_the_cpuinfo_flags_that_matter():
    from deepinfer.bench.machine import SIMD_FLAGS, machine_facts, simd_flags

    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    assert simd_flags() == [f for f in SIMD_FLAGS if f in flags]
    assert machine_facts()["cpu_simd"] == simd_flags()
