"""`deepinfer bench serve` end to end: a real server subprocess with the tiny V4 checkpoint, the benchmark
run in-process through `cli.main`, and its table, result JSON and plots checked."""

from __future__ import annotations

import json

import pytest
from test_server import running_server, tiny_checkpoint

from deepinfer import cli
from deepinfer.bench.datasets import BenchRequest
from deepinfer.bench.serve import build_payload, parse_goodput, parse_percentiles

NUM_PROMPTS, OUTPUT_LEN = 8, 6


@pytest.fixture(scope="module")
def bench_server(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory)
    with running_server(ckpt, tmp_path_factory.mktemp("bench-logs") / "server.log", "--served-model-name", "tiny") as s:
        yield s


def test_bench_serve_end_to_end(bench_server, tmp_path, capsys):
    result, plots = tmp_path / "result.json", tmp_path / "plots"
    argv = ["bench", "serve", "--base-url", bench_server.url, "--num-prompts", str(NUM_PROMPTS),
            "--random-input-len", "16", "--random-output-len", str(OUTPUT_LEN), "--max-concurrency", "4",
            "--result-json", str(result), "--plot", str(plots), "--goodput", "ttft:10000", "--price-per-hour", "2",
            "--warmup", "1", "--no-progress"]
    assert cli.main(argv) == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    data = json.loads(result.read_text())
    summary, records = data["summary"], data["requests"]
    assert summary["completed"] == NUM_PROMPTS and summary["failed"] == 0
    assert summary["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # ignore_eos: exactly max_tokens each
    assert summary["total_input_tokens"] == NUM_PROMPTS * 16
    assert summary["request_goodput"] > 0 and summary["cost_per_million_output_tokens"] > 0
    assert 1 <= summary["peak_concurrency"] <= 4
    assert data["config"]["model"] == "tiny"
    assert len(records) == NUM_PROMPTS
    for rec in records:
        assert rec["success"] and rec["output_tokens"] == OUTPUT_LEN
        assert 0 < rec["ttft"] <= rec["latency"]
        assert len(rec["itl"]) <= rec["output_tokens"] - 1  # chunks may merge tokens
    assert sorted(p.name for p in plots.glob("*.png")) == ["itl_hist.png", "tpot_cdf.png", "ttft_cdf.png"]


def test_bench_serve_unreachable_server_counts_failures(tmp_path, capsys):
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "x", "--num-prompts", "2",
            "--random-input-len", "4", "--random-output-len", "2", "--no-progress", "--timeout", "5"]
    assert cli.main(argv) == 0
    assert "Failed requests" in capsys.readouterr().out


def test_chat_without_tokenizer_is_a_usage_error(capsys):
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "x", "--endpoint", "chat"]
    assert cli.main(argv) == cli.EXIT_ERROR
    assert "--tokenizer" in capsys.readouterr().err


def test_option_parsing_and_payload():
    assert parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    assert parse_goodput(None) is None
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])
    assert parse_percentiles("50, 99.9") == [50.0, 99.9]
    with pytest.raises(ValueError):
        parse_percentiles("101")
    body = build_payload("m", "completions", BenchRequest([1, 2], 3), None)
    assert body["prompt"] == [1, 2] and body["max_tokens"] == 3 and body["ignore_eos"] and body["stream"]
    assert body["stream_options"] == {"include_usage": True} and body["temperature"] == 0
    chat = build_payload("m", "chat", BenchRequest([1], 2), "hi")
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in chat


def test_bench_serve_chat_endpoint(bench_server, tmp_path_factory, tmp_path, capsys):
    result = tmp_path / "chat.json"
    argv = ["bench", "serve", "--base-url", bench_server.url, "--endpoint", "chat", "--num-prompts", "2",
            "--tokenizer", str(tiny_checkpoint(tmp_path_factory)), "--random-input-len", "8",
            "--random-output-len", "4", "--result-json", str(result), "--no-progress"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    summary = json.loads(result.read_text())["summary"]
    assert summary["completed"] == 2 and summary["total_output_tokens"] == 8
