"""Facts about the machine a benchmark ran on, recorded next to every result."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import torch

from deepinfer import __version__
from deepinfer.config import cpu_flags


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo where there is one, else what `platform` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def simd_flags() -> list[str]:
    """The vector instruction sets of /proc/cpuinfo that decide CPU kernel speed (AVX2 vs AVX-512 / AMX machines
    differ by more than these benchmarks measure); empty where there is no /proc/cpuinfo."""
    flags = set(cpu_flags())
    return [f for f in SIMD_FLAGS if f in flags]


def machine_facts() -> dict:
    """CPU, cores, memory, accelerator and software versions, as a JSON-ready dict."""
    facts = {
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "deepinfer": __version__,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "cpu_simd": simd_flags(),
    }
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        facts["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    if torch.cuda.is_available():
        facts["accelerator"] = torch.cuda.get_device_name(0)
    return facts


def peak_rss_bytes(children: bool = False) -> int:
    """Peak resident set size so far of this process (or, with `children`, of its largest waited-for child), in
    bytes. getrusage's ru_maxrss is KiB on Linux and bytes on macOS; the peak never decreases."""
    import resource  # Unix only: imported where it is used

    usage = resource.getrusage(resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF)
    return usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
