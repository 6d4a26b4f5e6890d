"""`deepinfer serve` on several ranks: same tokens as one process through the official client, per-replica
stats in /metrics, and a killed rank failing in-flight requests, /health 503 and a non-zero exit."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import openai
import pytest
from test_server import _get_status, _sse_events, running_server, tiny_checkpoint

from deepinfer import LLM, SamplingParams

# async scheduling: rank stats requests then interleave with steps in flight; live EPLB with redundant experts
# rebalances every 2 steps while the completions below run (tokens must not change)
LAYOUT = ["--data-parallel-size", "2", "--enable-expert-parallel", "--async-scheduling",
          "--distributed-timeout-s", "30", "--enable-eplb", "--eplb-step-interval", "2",
          "--num-redundant-experts", "2"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    with running_server(ckpt, tmp_path_factory.mktemp("parlog") / "server.log", *LAYOUT) as srv:
        yield srv


def _rank_processes(pid: int) -> list[int]:
    """The engine process's children but multiprocessing's resource tracker."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    return [c for c in children if b"resource_tracker" not in open(f"/proc/{c}/cmdline", "rb").read()]


def test_completions_match_one_process(server, ckpt):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    prompts = ["hello world", "the quick brown fox", "a"]
    got = [client.completions.create(model=client.models.list().data[0].id, prompt=p, max_tokens=8,
                                     temperature=0, extra_body={"ignore_eos": True}).choices[0].text
           for p in prompts]
    llm = LLM(ckpt, load_progress=False, kv_cache_memory_bytes=16 * 2**20, max_model_len=1024, block_size=16)
    want = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8,
                                                                             ignore_eos=True), use_tqdm=False)]
    assert got == want
    deadline = time.monotonic() + 10  # the engine reports stats about once a second
    while "rank_peak_rss_bytes" not in (metrics := httpx.get(server.url + "/metrics").text):
        assert time.monotonic() < deadline, metrics
        time.sleep(0.2)
    for rank in (0, 1):
        assert f'deepinfer:rank_steps_total{{dp_rank="{rank}",engine="0",rank="{rank}",tp_rank="0"}}' in metrics
        assert f'deepinfer:replica_num_requests_running{{dp_rank="{rank}",engine="0"}}' in metrics
    balance = [line for line in metrics.splitlines() if line.startswith('deepinfer:eplb_balancedness{engine="0"} ')]
    assert balance and 0 < float(balance[0].split()[1]) <= 1  # the EP stats window reached /metrics
    assert 'deepinfer:eplb_balancedness_per_layer{engine="0",layer="0"}' in metrics
    rebalances = [line for line in metrics.splitlines()
                  if line.startswith('deepinfer:eplb_rebalances_total{engine="0"} ')]
    assert rebalances and float(rebalances[0].split()[1]) >= 1  # live EPLB ran during the completions
    for name in ("eplb_layers_moved_total", "eplb_experts_moved_total", "eplb_move_seconds_total"):
        assert f'deepinfer:{name}{{engine="0"}} ' in metrics
    assert 'deepinfer:eplb_last_rebalance_balancedness{engine="0",when="after"}' in metrics
    # what `deepinfer eplb --stats` reads
    assert 'deepinfer:eplb_expert_load{engine="0",expert="7",layer="0"}' in metrics


def test_killed_rank_fails_requests_and_the_server_exits(server):
    """Last test: SIGKILL one rank mid-stream."""
    engine_pid = httpx.get(server.url + "/version").json()["engine_pid"]
    ranks = _rank_processes(engine_pid)
    assert len(ranks) == 2
    body = {"prompt": "hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", server.url + "/v1/completions", json=body) as resp:
        events = _sse_events(resp)
        next(events)
        os.kill(ranks[-1], signal.SIGKILL)
        rest = list(events)
    assert rest[-1] == "[DONE]" and "error" in json.loads(rest[-2])
    statuses, t0 = [], time.monotonic()
    while server.proc.poll() is None and time.monotonic() - t0 < 20:
        statuses.append(_get_status(server.url + "/health"))
        time.sleep(0.05)
    assert server.proc.wait(5) != 0
    assert time.monotonic() - t0 < 20
