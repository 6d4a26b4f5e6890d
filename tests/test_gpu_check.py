"""The prepared device check: benchmarks/gpu_kernels.py --smoke runs every section on CPU (Triton interpreter),
and the shell scripts parse."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("device", "attention", "mla", "indexer", "moe", "fp8_gemm", "graphs")
CUDA_ONLY = {"graphs"}  # off CUDA: the engine's graph run is skipped (it would compile), replays are eager


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("gpu") / "x.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "benchmarks/gpu_kernels.py", "--smoke", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"report": json.loads(out.read_text()), "dir": out.parent}


def test_smoke_has_every_section_with_entries(smoke):
    report = smoke["report"]
    assert report["meta"]["smoke"] is True and report["meta"]["device"] == "cpu"
    assert {"torch", "triton", "timestamp", "peaks"} <= set(report["meta"])
    for name in SECTIONS:
        section = report["sections"][name]
        assert section["status"] == "ok", (name, section.get("error"))
        assert section["entries"], name


def test_smoke_points_are_measured_without_errors(smoke):
    sections = smoke["report"]["sections"]
    for name in set(SECTIONS) - CUDA_ONLY:
        for entry in sections[name]["entries"]:
            assert "error" not in entry, (name, entry)
            assert entry.get("status") != "skipped", (name, entry)
    timed = [e for name in ("attention", "mla", "indexer", "moe", "fp8_gemm") for e in sections[name]["entries"]
             if "ms" in e]
    assert timed and all(e["ms"] > 0 and e["GBps"] > 0 for e in timed)
    checked = [e for e in timed if "max_abs_err" in e]
    assert checked and all(e["max_abs_err"] < 1e-3 for e in checked)
    quants = {e.get("quant") for e in sections["moe"]["entries"] if "ms" in e}
    assert quants == {"bf16", "fp8", "mxfp4", "int4"}
    int4_gemm = [e for e in sections["fp8_gemm"]["entries"] if e.get("quant") == "int4"]
    assert int4_gemm and all(e["max_abs_err"] < 1e-3 for e in int4_gemm)
    graphs = sections["graphs"]["entries"]
    assert not [e for e in graphs if "error" in e]
    assert any(e.get("mode") == "eager" and "ms" in e for e in graphs)
    replays = [e for e in graphs if str(e.get("mode", "")).startswith("graphs")]
    assert replays and all(e["max_abs_err"] < 1e-3 for e in replays)  # StepGraphs.run from plain no_grad code


def test_smoke_writes_the_plot_when_matplotlib_imports(smoke):
    pytest.importorskip("matplotlib")
    assert (smoke["dir"] / "x.png").stat().st_size > 0


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh"])
def test_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / script)], check=True)
