"""The CPU engine's allocator thresholds (worker/host_memory.py)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from deepinfer.worker.host_memory import should_tune


def test_only_glibc_and_never_over_the_users_settings():
    assert should_tune({}, "glibc")
    assert not should_tune({}, "")  # musl, macOS, Windows: left alone
    assert not should_tune({"MALLOC_MMAP_THRESHOLD_": "65536"}, "glibc")
    assert not should_tune({"MALLOC_TRIM_THRESHOLD_": "0"}, "glibc")
    assert not should_tune({"DEEPINFER_HOST_MALLOC": "0"}, "glibc")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_applied_in_a_fresh_process():
    code = "from deepinfer.worker.host_memory import keep_freed_memory as k; print(k())"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"})
    assert run.stdout.strip() == "True"
