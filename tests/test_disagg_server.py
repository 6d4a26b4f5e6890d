"""1P1D through `deepinfer router --prefill URL --decode URL` in front of `deepinfer serve
--disaggregation-mode prefill|decode` (bundled model, Mooncake over TCP where it loads, else the local
transport), through the official `openai` client: the same answers as a colocated server, the transfer
counters, and a killed decode instance failing its request while the prefill instance frees its hold."""

from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest
from test_disagg import MOONCAKE_MISSING
from test_router_http import AUTH, KEY, WORKER_FLAGS, RouterProcess
from test_server import ServerProcess, _engine_sums

from deepinfer.llm import default_model_path

BACKEND = "local" if MOONCAKE_MISSING else "mooncake"
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n" * 6, "The quick brown fox"]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd")
    pd = ("--disaggregation-transfer-backend", BACKEND)
    servers = {"prefill": ServerProcess(default_model_path(), logs / "prefill.log", *WORKER_FLAGS, *pd,
                                        "--disaggregation-mode", "prefill", "--disaggregation-lease-s", "2"),
               "decode": ServerProcess(default_model_path(), logs / "decode.log", *WORKER_FLAGS, *pd,
                                       "--disaggregation-mode", "decode"),
               "colocated": ServerProcess(default_model_path(), logs / "colocated.log", *WORKER_FLAGS)}
    router = None
    try:
        for s in servers.values():
            s.wait_ready()
        router = RouterProcess([], logs / "router.log", pools=["--prefill", servers["prefill"].url,
                                                               "--decode", servers["decode"].url]).wait_ready()
        yield servers, router
    finally:
        if router is not None:
            router.stop()
        for s in servers.values():
            s.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _sums(server) -> dict[str, float]:
    return _engine_sums(httpx.get(server.url + "/metrics", headers=AUTH).text)


def _streamed(client, **kw) -> str:
    return "".join(c.choices[0].text or "" for c in client.completions.create(stream=True, **kw) if c.choices)


def test_answers_equal_a_colocated_server(deployment):
    servers, router = deployment
    pd, ref = _client(router.url), _client(servers["colocated"].url)
    for prompt in PROMPTS:
        kw = dict(model="m", prompt=prompt, max_tokens=16, temperature=0)
        assert pd.completions.create(**kw).choices[0].text == ref.completions.create(**kw).choices[0].text
        assert _streamed(pd, **kw) == _streamed(ref, **kw)
    chat = dict(model="m", messages=[{"role": "user", "content": "Write a haiku about caches."}], max_tokens=20,
                temperature=0, logprobs=True, top_logprobs=2)
    mine, theirs = pd.chat.completions.create(**chat).choices[0], ref.chat.completions.create(**chat).choices[0]
    assert mine.message.content == theirs.message.content
    assert [t.token for t in mine.logprobs.content] == [t.token for t in theirs.logprobs.content]
    assert abs(mine.logprobs.content[0].logprob - theirs.logprobs.content[0].logprob) < 1e-4  # the prefill's token
    prefill, decode = _sums(servers["prefill"]), _sums(servers["decode"])
    requests = 2 * len(PROMPTS) + 1
    assert prefill["deepinfer:kv_transfers_sent_total"] == requests == decode["deepinfer:kv_transfers_received_total"]
    assert decode["deepinfer:kv_transfer_bytes_total"] > 0
    # the decode engine's release reaches the prefill engine asynchronously (after the answer may have been
    # sent): the holds drop to 0 well inside the 2 s lease, and by release, not by lease expiry
    deadline = time.monotonic() + 1.5
    while (held := _sums(servers["prefill"]))["deepinfer:kv_transfers_held"]:
        assert time.monotonic() < deadline, "the prefill instance kept a hold its decode instance had read"
        time.sleep(0.05)
    assert held["deepinfer:kv_transfer_leases_expired_total"] == prefill["deepinfer:kv_transfer_leases_expired_total"]


def test_a_lost_decode_instance_fails_its_request_and_the_prefill_frees_by_lease(deployment):
    """The decode instance stops answering (SIGSTOP) right as a request comes: the prefill instance has
    computed the prompt and holds its cache, the router gives the decode instance up and answers 503, and the
    hold is freed by its 2 s lease since nobody reads it."""
    servers, router = deployment
    expired = _sums(servers["prefill"])["deepinfer:kv_transfer_leases_expired_total"]
    servers["decode"].proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(openai.APIStatusError) as err:
            _client(router.url).completions.create(model="m", prompt="Hello there " * 20, max_tokens=8, temperature=0)
        assert err.value.status_code == 503
        deadline = time.monotonic() + 10
        while _sums(servers["prefill"])["deepinfer:kv_transfer_leases_expired_total"] == expired:
            assert time.monotonic() < deadline, "the prefill instance kept the hold past its lease"
            time.sleep(0.2)
    finally:
        servers["decode"].proc.send_signal(signal.SIGKILL)
    sums = _sums(servers["prefill"])
    assert sums["deepinfer:kv_transfers_held"] == 0
    assert sums["deepinfer:kv_cache_free_blocks"] == sums["deepinfer:kv_cache_total_blocks"]
