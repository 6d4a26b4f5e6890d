"""Speculative decoding through the server: `--speculative-config` JSON, identical greedy completions,
and vLLM-named Prometheus counters (`deepinfer:spec_decode_*`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import openai
import pytest
from test_server import BASE_FLAGS, SERVER_ENV, ServerProcess, metrics, tiny_checkpoint

from deepinfer.engine.messages import EngineStats
from deepinfer.server.metrics import Metrics

PROMPT = "hello world hello world hello world the quick brown fox hello world the quick"


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory)
    logs = tmp_path_factory.mktemp("spec-logs")
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    servers = [ServerProcess(ckpt, logs / "plain.log"),
               ServerProcess(ckpt, logs / "spec.log", "--speculative-config", spec)]
    yield [s.wait_ready() for s in servers]
    for s in servers:
        s.stop()


@pytest.mark.slow
def test_speculative_server_matches_and_reports_counters(spec_server):
    texts = []
    for server in spec_server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=24,
                                        temperature=0, extra_body={"ignore_eos": True})
        texts.append(out.choices[0].text)
    assert texts[0] == texts[1]
    plain, spec = (metrics(s.url) for s in spec_server)
    assert plain["deepinfer:spec_decode_num_drafts_total"] == 0
    assert spec["deepinfer:spec_decode_num_drafts_total"] > 0
    drafted, accepted = (spec[f"deepinfer:spec_decode_num_{n}_tokens_total"] for n in ("draft", "accepted"))
    assert drafted >= accepted
    text = httpx.get(spec_server[1].url + "/metrics", timeout=10).text
    assert 'deepinfer:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in text


def test_bad_speculative_config_fails_fast(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory)
    proc = subprocess.run([sys.executable, "-m", "deepinfer", "serve", str(ckpt), *BASE_FLAGS,
                           "--speculative-config", '{"method": "eagle"}'], capture_output=True, text=True,
                          env={**os.environ, **SERVER_ENV}, timeout=120)
    assert proc.returncode != 0 and "speculative method" in proc.stderr


def test_engine_stats_render_as_vllm_named_counters():
    stats = EngineStats(1, 0, 0.5, 3, 4, 5, 6, 0, 1.0, spec_num_drafts=7, spec_num_draft_tokens=21,
                        spec_num_accepted_tokens=12, spec_accepted_per_pos=[6, 4, 2])
    text = Metrics(lambda: {"0": stats}).render().decode()
    for line in ['deepinfer:spec_decode_num_drafts_total{engine="0"} 7.0',
                 'deepinfer:spec_decode_num_draft_tokens_total{engine="0"} 21.0',
                 'deepinfer:spec_decode_num_accepted_tokens_total{engine="0"} 12.0',
                 'deepinfer:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="2"} 2.0']:
        assert line in text
