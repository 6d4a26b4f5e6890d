"""The rest of `deepinfer bench`: sweep and plot against a real server on the bundled model (token counts
checked against the server's own /metrics), offline throughput and latency, and the pure helpers."""

from __future__ import annotations

import argparse
import json
import math

import pytest
from test_server import metrics, running_server

from deepinfer import cli
from deepinfer.bench.metrics import SpecDecodeStats, spec_decode_delta
from deepinfer.bench.offline import latency_result, throughput_result
from deepinfer.bench.serve import spec_counter_samples
from deepinfer.bench.sweep import load_sweep, parse_values, plot_sweeps, point_args
from deepinfer.llm import default_model_path

INPUT_LEN, OUTPUT_LEN = 24, 5


@pytest.fixture(scope="module")
def bundled_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("bench-suite") / "server.log"
    with running_server(default_model_path(), log, "--served-model-name", "bundled") as server:
        yield server


def _served_tokens(url: str) -> tuple[float, float]:
    m = metrics(url)
    return m["deepinfer:prompt_tokens_total"], m["deepinfer:generation_tokens_total"]


def test_bench_serve_counts_match_the_servers_usage(bundled_server, tmp_path, capsys):
    before = _served_tokens(bundled_server.url)
    result = tmp_path / "serve.json"
    argv = ["bench", "serve", "--base-url", bundled_server.url, "--num-prompts", "6", "--max-concurrency", "3",
            "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
            "--random-range-ratio", "0.5", "--vocab-size", "8192", "--result-json", str(result), "--no-progress"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    data = json.loads(result.read_text())
    summary, records = data["summary"], data["requests"]
    after = _served_tokens(bundled_server.url)
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["total_input_tokens"] == sum(r["prompt_tokens"] for r in records) == after[0] - before[0]
    assert summary["total_output_tokens"] == sum(r["output_tokens"] for r in records) == after[1] - before[1]
    assert {r["prompt_tokens"] for r in records} <= set(range(12, 37))  # lengths spread by the range ratio
    assert data["machine"]["cpu"] and data["machine"]["torch"]
    assert summary["spec_decode"] is None  # this server does not speculate
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert summary[key]["count"] > 0 and summary[key]["median"] > 0


def test_bench_sweep_and_plot(bundled_server, tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["bench", "sweep", "--base-url", bundled_server.url, "--concurrency", "1,2", "--num-prompts", "2",
            "--prompts-per-concurrency", "2", "--random-input-len", "16", "--random-output-len", "4",
            "--vocab-size", "8192", "--goodput", "ttft:60000", "--label", "deepinfer", "--output-dir", str(out),
            "--no-progress"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    doc = load_sweep(out / "sweep.json")
    assert doc["varied"] == "max_concurrency" and doc["label"] == "deepinfer" and doc["model"] == "bundled"
    assert [p["max_concurrency"] for p in doc["points"]] == [1, 2]
    assert [p["num_prompts"] for p in doc["points"]] == [2, 4]
    for point in doc["points"]:
        s = point["summary"]
        assert s["completed"] == point["num_prompts"] and s["total_output_tokens"] == 4 * point["num_prompts"]
        assert s["peak_concurrency"] <= point["max_concurrency"] and s["request_goodput"] > 0
    assert (out / "sweep.png").stat().st_size > 0
    assert sorted(p.name for p in (out / "points").glob("*.json")) == ["max_concurrency-1.json",
                                                                      "max_concurrency-2.json"]
    other = dict(doc, label="other engine")
    (tmp_path / "other.json").write_text(json.dumps(other))
    png = tmp_path / "both.png"
    assert cli.main(["bench", "plot", str(out / "sweep.json"), str(tmp_path / "other.json"), "-o", str(png)]) == 0
    assert png.stat().st_size > 0


def test_sweep_needs_exactly_one_list(capsys):
    argv = ["bench", "sweep", "--base-url", "http://127.0.0.1:9", "--model", "x"]
    assert cli.main(argv) == cli.EXIT_ERROR
    assert "exactly one of --concurrency and --rates" in capsys.readouterr().err


def test_plot_rejects_a_file_that_is_not_a_sweep(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"summary": {}}')
    assert cli.main(["bench", "plot", str(bad)]) == cli.EXIT_ERROR
    assert "not a `deepinfer bench sweep` result" in capsys.readouterr().err


def test_offline_throughput_and_latency(tmp_path, capsys):
    flags = ["--input-len", "12", "--output-len", "4", "--no-progress", "--kv-cache-memory-bytes", str(8 * 2**20),
             "--no-load-progress"]
    tp = tmp_path / "throughput.json"
    assert cli.main(["bench", "throughput", "--num-prompts", "5", "--result-json", str(tp), *flags]) == 0
    result = json.loads(tp.read_text())["result"]
    assert result["num_requests"] == 5 and result["output_tokens"] == 20 and result["prompt_tokens"] == 60
    assert result["output_tokens_per_s"] > 0
    lat = tmp_path / "latency.json"
    argv = ["bench", "latency", "--batch-size", "2", "--num-iters", "2", "--num-iters-warmup", "0",
            "--result-json", str(lat), *flags]
    assert cli.main(argv) == 0
    assert "Latency Result (batch 2)" in capsys.readouterr().out
    result = json.loads(lat.read_text())["result"]
    assert result["iterations"] == 2 and result["prefill_ms"]["count"] == 2
    assert result["decode_per_token_ms"]["mean"] > 0


# --- pure helpers ----------------------------------------------------------------------------------
def test_parse_values_and_point_args():
    assert parse_values("1, 4,16", "concurrency") == [1.0, 4.0, 16.0]
    assert parse_values("0.5,inf", "rates") == [0.5, math.inf]
    for text, kind in (("0,2", "concurrency"), ("1.5", "concurrency"), ("", "rates"), ("a", "rates"),
                       ("0", "rates"), ("inf", "concurrency")):
        with pytest.raises(ValueError):
            parse_values(text, kind)
    args = argparse.Namespace(num_prompts=10, prompts_per_concurrency=4, max_concurrency=None, request_rate=math.inf)
    assert point_args(args, "concurrency", 8).num_prompts == 32 and point_args(args, "concurrency", 8).max_concurrency
    assert point_args(args, "concurrency", 2).num_prompts == 10
    rate = point_args(args, "rates", 3.0)
    assert rate.request_rate == 3.0 and rate.num_prompts == 10 and rate.max_concurrency is None
    assert args.max_concurrency is None  # the sweep's own options are not modified


VLLM_METRICS = """# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 16.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 3.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
"""


def test_spec_counters_from_prometheus_text_and_their_delta():
    after = spec_counter_samples(VLLM_METRICS)
    assert after == {"spec_decode_num_drafts": 10.0, "spec_decode_num_draft_tokens": 30.0,
                     "spec_decode_num_accepted_tokens": 16.0, "spec_decode_num_accepted_tokens_per_pos:0": 8.0,
                     "spec_decode_num_accepted_tokens_per_pos:1": 5.0, "spec_decode_num_accepted_tokens_per_pos:2": 3.0}
    before = {"spec_decode_num_drafts": 2.0, "spec_decode_num_draft_tokens": 6.0,
              "spec_decode_num_accepted_tokens": 4.0, "spec_decode_num_accepted_tokens_per_pos:0": 2.0,
              "spec_decode_num_accepted_tokens_per_pos:1": 1.0, "spec_decode_num_accepted_tokens_per_pos:2": 1.0}
    stats = spec_decode_delta(before, after)
    assert stats == SpecDecodeStats(drafts=8, draft_tokens=24, accepted_tokens=12, accepted_per_position=(6, 4, 2))
    assert stats.mean_accepted_length == 2.5 and stats.acceptance_rate == 0.5
    assert stats.per_position_acceptance() == [0.75, 0.5, 0.25]
    assert spec_decode_delta(after, after) is None and spec_decode_delta({}, {}) is None
    assert spec_counter_samples("not prometheus {{{") == {}


def test_offline_result_maths():
    from deepinfer.bench.datasets import BenchRequest

    reqs = [BenchRequest([1] * 10, 5), BenchRequest([1] * 6, 5)]
    r = throughput_result(reqs, 2.0, 10)
    assert (r["requests_per_s"], r["output_tokens_per_s"], r["total_tokens_per_s"]) == (1.0, 5.0, 13.0)
    lat = latency_result([(0.1, 0.5), (0.2, 0.6)], output_len=5, percentiles=[50])
    assert lat["decode_per_token_ms"]["mean"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4 s
    assert lat["prefill_ms"]["median"] == pytest.approx(150.0) and lat["e2e_ms"]["count"] == 2
    assert latency_result([(0.1, 0.1)], output_len=1, percentiles=[50])["decode_per_token_ms"]["count"] == 0


def test_plot_refuses_mixed_sweeps(tmp_path):
    a = {"label": "a", "varied": "max_concurrency", "points": []}
    with pytest.raises(ValueError):
        plot_sweeps([a, dict(a, varied="request_rate")], tmp_path / "x.png")


@pytest.mark.slow  # acceptance counting is unit-tested in test_bench_serve.py
def test_bench_serve_reports_speculative_acceptance(tmp_path, capsys):
    """Against a server that speculates (ngram), the run's accepted length comes from its /metrics."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    with running_server(default_model_path(), tmp_path / "spec.log", "--speculative-config", spec) as server:
        result = tmp_path / "spec.json"
        argv = ["bench", "serve", "--base-url", server.url, "--num-prompts", "4", "--random-input-len", "32",
                "--random-output-len", "24", "--vocab-size", "4", "--result-json", str(result), "--no-progress"]
        assert cli.main(argv) == 0, capsys.readouterr().err
        assert "Spec decode mean accepted length" in capsys.readouterr().out
    spec_stats = json.loads(result.read_text())["summary"]["spec_decode"]
    assert spec_stats["drafts"] > 0 and spec_stats["draft_tokens"] >= spec_stats["drafts"]
    assert 1.0 <= spec_stats["mean_accepted_length"] <= 4.0
    assert len(spec_stats["per_position_acceptance"]) == 3
