"""The pure parts of benchmarks/peers.py and benchmarks/server_profile.py: the summary and its ratios, the
command lines the results show, and the profile's categories (the servers themselves are not started here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
peers = pytest.importorskip("peers")
server_profile = pytest.importorskip("server_profile")


def _run(engine: str, c: int, r: int, tok_s: float, tpot: float) -> dict:
    return {"checkpoint": "tiny-v3", "engine": engine, "concurrency": c, "round": r, "output_tok_s": tok_s,
            "tpot_p50_ms": tpot, "tpot_p99_ms": tpot, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0}


def test_summary_takes_the_median_of_rounds_and_deepinfers_ratio_to_each_peer():
    runs = [_run("deepinfer", 16, 0, 300, 4), _run("deepinfer", 16, 1, 100, 6), _run("deepinfer", 16, 2, 200, 5),
            _run("llama.cpp", 16, 0, 100, 2), _run("llama.cpp", 16, 1, 100, 2)]
    rows = {r["engine"]: r for r in peers.summary(runs)}
    assert rows["deepinfer"]["output_tok_s"] == 200 and rows["deepinfer"]["rounds"] == 3
    assert rows["llama.cpp"]["deepinfer_throughput_ratio"] == 2.0
    assert rows["llama.cpp"]["deepinfer_tpot_ratio"] == 2.5
    assert "deepinfer_throughput_ratio" not in rows["deepinfer"]


def test_results_show_no_local_paths(tmp_path):
    ckpt, work = tmp_path / "ckpt" / "tiny-v3", tmp_path / "work"
    argv = [sys.executable, "-m", "deepinfer", "serve", str(ckpt), "-m", str(work / "tiny-v3.gguf")]
    shown = peers.public_argv(argv, "tiny-v3", ckpt, work)
    assert shown == ["python", "-m", "deepinfer", "serve", "<tiny-v3>", "-m", "<work>/tiny-v3.gguf"]
    assert peers.public_argv(["/opt/llama/bin/llama-server", "-t", "2"], "x", ckpt, work)[0] == "llama-server"


def test_profile_categories_take_the_innermost_known_frame():
    engine = "process 7:\"python -m deepinfer serve\";process 9:\"python -c spawn_main\";run_engine " \
             "(deepinfer/engine/engine_proc.py:369)"
    lines = [f"{engine};step (deepinfer/engine/core.py:10);execute (deepinfer/worker/model_runner.py:5);"
             "forward (deepinfer/models/deepseek_v3.py:1);linear (torch/nn/modules/linear.py:2) 30",
             f"{engine};step (deepinfer/engine/core.py:10);sample (deepinfer/worker/sampler.py:4) 5",
             f"{engine};send (zmq/sugar/socket.py:700) 2",
             "process 7:\"python -m deepinfer serve\";run (asyncio/runners.py:1);handle (uvicorn/x.py:2) 4",
             "process 7:\"python -m deepinfer serve\";stream (deepinfer/server/serving.py:9);"
             "decode (tokenizers/__init__.py:3) 1",
             "not a sample line"]
    samples = server_profile.parse_collapsed("\n".join(lines), api_pid=7)
    assert samples["engine"] == {"forward": 30, "sampler": 5, "IPC": 2}
    assert samples["api"] == {"HTTP": 4, "detokenize": 1}
    assert server_profile.category(["main (x.py:1)"]) == "other"


def test_a_deepinfer_variant_is_deepinfer_with_its_environment_and_options():
    base = peers.Engine("deepinfer", "0.1.0", lambda *a: ["serve"])
    variant = peers.deepinfer_variant("all-threads:DEEPINFER_SMALL_STEP_TOKENS=0,X=1", base)
    assert (variant.name, variant.env) == ("all-threads", {"DEEPINFER_SMALL_STEP_TOKENS": "0", "X": "1"})
    assert variant.command("tiny", None, 1) == ["serve"] and "DEEPINFER_SMALL_STEP_TOKENS=0" in variant.version
    flagged = peers.deepinfer_variant("async:--async-scheduling,X=1", base)
    assert flagged.command("tiny", None, 1) == ["serve", "--async-scheduling"] and flagged.env == {"X": "1"}
    for bad in ("no-assignments", "name:", "name:neither-flag-nor-assignment"):
        with pytest.raises(SystemExit):
            peers.deepinfer_variant(bad, base)
