"""The OpenAI-compatible server, end to end: the real `python -m deepinfer serve` process on a free loopback
port, a tiny random DeepSeek-V4 checkpoint with a tiny tokenizer, and the official `openai` client.

Two servers per module: `server` (the main one) and `guarded` (API key, --max-queue 1). Tests run in
file order; the last test of each server stops it (SIGTERM drain; engine kill), so they come last.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import make_reference, save_reference, write_tokenizer

from deepinfer.server.reasoning import ReasoningStream, split_reasoning, thinking_enabled

SERVED_NAME = "tiny"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
# One intra-op thread: the tiny model gains nothing from more, and spinning OpenMP threads on a small,
# shared machine slow every step down by an order of magnitude.
SERVER_ENV = {"OMP_NUM_THREADS": "1"}
BASE_FLAGS = ["--no-load-progress", "--no-access-log", "--kv-cache-memory-bytes", str(16 * 2**20),
              "--max-model-len", "1024", "--block-size", "16", "--log-level", "warning"]


# --- the server process ----------------------------------------------------------------------------
def tiny_checkpoint(tmp_path_factory) -> Path:
    """One tiny V4 checkpoint + tokenizer per pytest session (shared by the server test modules)."""
    path = tmp_path_factory.getbasetemp() / "server-ckpt" / "model"
    if not (path / "tokenizer.json").exists():
        save_reference(make_reference("v4", seed=3), path)
        write_tokenizer(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m deepinfer serve` in a subprocess; its output goes to a log file (never a pipe that fills)."""

    def __init__(self, ckpt: Path, log: Path, *flags: str, env: dict | None = None, port: int | None = None):
        self.port, self.log_path = port or free_port(), log
        cmd = [sys.executable, "-m", "deepinfer", "serve", str(ckpt), "--port", str(self.port), *BASE_FLAGS, *flags]
        with open(log, "wb") as out:
            env = {**os.environ, **SERVER_ENV, **(env or {})}
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        self._ready = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while not self._ready:
            assert self.proc.poll() is None, f"server exited with {self.proc.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"server not ready after {timeout} s:\n{self.log()}"
            self._ready = _get_status(self.url + "/health") == 200
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def running_server(ckpt: Path, log: Path, *flags: str, env: dict | None = None):
    """A ready ServerProcess, stopped when the block ends however it ends."""
    server = ServerProcess(ckpt, log, *flags, env=env)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def _get_status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def servers(ckpt, tmp_path_factory):
    """Both servers start together (their start-up overlaps); each test waits for the one it uses."""
    logs = tmp_path_factory.mktemp("server-logs")
    main = ServerProcess(ckpt, logs / "main.log", "--served-model-name", SERVED_NAME, "--max-body-bytes", "100000",
                         "--drain-timeout", "30")
    guarded = ServerProcess(ckpt, logs / "guarded.log", "--max-queue", "1", env={"DEEPINFER_API_KEY": "sesame"})
    yield {"main": main, "guarded": guarded}
    main.stop()
    guarded.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers["main"].wait_ready()


@pytest.fixture(scope="module")
def guarded(servers):
    return servers["guarded"].wait_ready()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(url: str) -> dict[str, float]:
    """Samples of /metrics by name, summed over the engine label (a series with other labels is left out)."""
    return _engine_sums(httpx.get(url + "/metrics", timeout=10).text)


def _engine_sums(text: str) -> dict[str, float]:
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if set(sample.labels) <= {"engine"}:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def token_ids(logprobs) -> list[int]:
    """Token ids from logprobs requested with return_tokens_as_token_ids."""
    tokens = logprobs.tokens if hasattr(logprobs, "tokens") else [c.token for c in logprobs.content]
    return [int(t.removeprefix("token_id:")) for t in tokens]


# --- reasoning split (unit) ------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("abc</think>answer", ("abc", "answer")),
    ("<think>abc</think>answer", ("abc", "answer")),
    ("still thinking", ("still thinking", None)),
    ("</think>", ("", "")),
    ("a</think>b</think>c", ("a", "b</think>c")),
    ("", ("", None)),
])
def test_split_reasoning(text, expected):
    assert split_reasoning(text) == expected


def test_thinking_is_detected_from_the_prompt_end():
    assert thinking_enabled("<｜User｜>hi<｜Assistant｜><think>")
    assert thinking_enabled("x<think>\n")
    assert not thinking_enabled("<｜User｜>hi<｜Assistant｜></think>")
    assert not thinking_enabled("<think>x")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="<>/thinkab", max_size=40), st.lists(st.integers(0, 40), max_size=8))
def test_streamed_split_equals_whole_split(text, cuts):
    """Any cutting of the output into deltas gives the same reasoning/content as the whole text."""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    stream, reasoning, content = ReasoningStream(), "", ""
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    for i, piece in enumerate(pieces):
        r, c = stream.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    want_reasoning, want_content = split_reasoning(text)
    assert (reasoning, content) == (want_reasoning, want_content or "")


# --- command line (unit) ---------------------------------------------------------------------------
def test_serve_flags_and_settings(monkeypatch, tmp_path):
    from deepinfer import cli
    from deepinfer.server import launch

    args = cli.build_parser().parse_args(["serve", str(tmp_path), "--max-queue", "3", "--max-num-seqs", "2"])
    assert (args.host, args.port, args.max_queue, cli.engine_kwargs(args)["max_num_seqs"]) == ("127.0.0.1", 8000, 3, 2)
    assert launch.model_path(args) == str(tmp_path)
    monkeypatch.setenv("DEEPINFER_API_KEY", "from-env")
    settings_ = launch.settings_from(args, tmp_path, bundled=False)
    assert (settings_.model_name, settings_.api_keys, settings_.max_queue) == (tmp_path.name, ("from-env",), 3)
    assert launch.settings_from(args, tmp_path, bundled=True).model_name == "deepinfer-default"
    args = cli.build_parser().parse_args(["serve", "a", "--model", "b"])
    with pytest.raises(ValueError, match="two models"):
        launch.model_path(args)


# --- basics ----------------------------------------------------------------------------------------
def test_models_health_version(client, server):
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    version = httpx.get(server.url + "/version").json()
    assert version["engine_pid"] > 0 and version["server_pid"] == server.proc.pid


def test_completion_usage_equals_token_counts(client, server):
    prompt = "hello world, how are you"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    out = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=6, logprobs=0,
                                    **_with_ids(GREEDY))
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 6
    assert out.usage.total_tokens == len(ids) + 6 and out.choices[0].finish_reason == "length"
    assert len(token_ids(out.choices[0].logprobs)) == 6
    text = httpx.post(server.url + "/detokenize", json={"tokens": token_ids(out.choices[0].logprobs)}).json()
    assert text["prompt"] == out.choices[0].text


def test_token_id_prompts_and_prompt_lists(client):
    out = client.completions.create(model=SERVED_NAME, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 6


def test_echo_prepends_the_prompt_and_scores_it(client):
    out = client.completions.create(model=SERVED_NAME, prompt="hello world", max_tokens=3, echo=True, **GREEDY)
    assert out.choices[0].text.startswith("hello world")
    out = client.completions.create(model=SERVED_NAME, prompt="hello world", max_tokens=2, echo=True, logprobs=1,
                                    **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == out.usage.prompt_tokens + 2 and lp.token_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and lp.text_offset[1] == 0  # BOS has no visible text


def test_streaming_several_prompts_with_n2(client):
    chunks = list(client.completions.create(model=SERVED_NAME, prompt=["hello", "world"], n=2, max_tokens=3,
                                            stream=True, **GREEDY))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length", 2: "length", 3: "length"}


def test_chat_content_parts(server):
    def tokens(content):
        body = {"messages": [{"role": "user", "content": content}]}
        return httpx.post(server.url + "/tokenize", json=body).json()["tokens"]

    assert tokens([{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]) == tokens("hello world")
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert _assert_error(httpx.post(server.url + "/v1/chat/completions", json=body), 400)["param"] == "messages"


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "how are you today"}]
    whole = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=8, **GREEDY)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    chunks = list(client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert whole.usage.completion_tokens == 8


def test_n2_and_seed_reproducibility(client):
    def run(seed):
        out = client.completions.create(model=SERVED_NAME, prompt="the quick brown fox", max_tokens=6, n=2,
                                        temperature=1.0, seed=seed, logprobs=0,
                                        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        assert sorted(c.index for c in out.choices) == [0, 1] and out.usage.completion_tokens == 12
        return [token_ids(c.logprobs) for c in sorted(out.choices, key=lambda c: c.index)]

    first = run(7)
    assert run(7) == first
    assert run(8) != first


def test_streaming_n2_reports_both_choices(client):
    chunks = list(client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, n=2, stream=True, **GREEDY))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "hello"}],
                                         max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs))


def test_completion_logprobs(client):
    out = client.completions.create(model=SERVED_NAME, prompt="hello", max_tokens=4, logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) >= 1 for top in lp.top_logprobs)


def test_stop_string_truncates_and_finishes(client):
    base = client.completions.create(model=SERVED_NAME, prompt="hello world", max_tokens=24, **GREEDY)
    text = base.choices[0].text
    visible = [i for i, ch in enumerate(text) if ch.isprintable() and ch != "\ufffd" and i > 0]
    if not visible:
        pytest.skip(f"the random model produced no usable text: {text!r}")
    stop = text[visible[len(visible) // 2]]
    out = client.completions.create(model=SERVED_NAME, prompt="hello world", max_tokens=24, stop=[stop], **GREEDY)
    assert out.choices[0].text == text[:text.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=SERVED_NAME, prompt="hello world", max_tokens=24, stop=[stop],
                                         stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text


def test_reasoning_fields_follow_thinking_mode(client):
    messages = [{"role": "user", "content": "hi"}]
    on = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=6,
                                        extra_body={"chat_template_kwargs": {"thinking": True}, "ignore_eos": True},
                                        temperature=0)
    message = on.choices[0].message
    reasoning = message.model_extra.get("reasoning_content")
    assert isinstance(reasoning, str)
    assert (reasoning, message.content) == split_reasoning(reasoning + ("</think>" + message.content
                                                                        if message.content is not None else ""))
    off = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=6, **GREEDY)
    assert "reasoning_content" not in (off.choices[0].message.model_extra or {})
    assert isinstance(off.choices[0].message.content, str)


def test_streamed_reasoning_matches_non_stream(client):
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "temperature": 0, "extra_body": {"chat_template_kwargs": {"thinking": True}, "ignore_eos": True}}
    whole = client.chat.completions.create(**body).choices[0].message
    deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **body)]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert reasoning == whole.model_extra["reasoning_content"] and content == (whole.content or "")


# --- concurrency and disconnects -------------------------------------------------------------------
def _with_ids(options: dict) -> dict:
    return {**options, "extra_body": {**options.get("extra_body", {}), "return_tokens_as_token_ids": True}}


PROMPTS = ["hello world", "the quick brown fox", "how are you today", "world, hello"]


def test_64_concurrent_streams_equal_solo_runs(client, aclient):
    solo = {p: token_ids(client.completions.create(model=SERVED_NAME, prompt=p, max_tokens=8, logprobs=0,
                                                   **_with_ids(GREEDY)).choices[0].logprobs) for p in PROMPTS}

    async def one(prompt):
        stream = await aclient.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=8, logprobs=0,
                                                  stream=True, **_with_ids(GREEDY))
        ids = []
        async for chunk in stream:
            ids += token_ids(chunk.choices[0].logprobs) if chunk.choices[0].logprobs else []
        return prompt, ids

    async def all_of_them():
        return await asyncio.gather(*(one(PROMPTS[i % len(PROMPTS)]) for i in range(64)))

    results = asyncio.run(all_of_them())
    assert len(results) == 64
    for prompt, ids in results:
        assert ids == solo[prompt]


def _sse_events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]


def test_prefix_cache_hits_and_reset(server, client):
    """A repeated long prompt hits the prefix cache (visible in /metrics); after POST /reset_prefix_cache the
    same prompt finds nothing."""
    prompt = list(range(3, 3 + 80))  # five full 16-token blocks

    def hits_after_request() -> float:
        before = metrics(server.url)["deepinfer:prefix_cache_hits_total"]
        client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=1, temperature=0)
        _wait_for(lambda: metrics(server.url)["deepinfer:prefix_cache_hits_total"] >= before, 2.0)
        time.sleep(0.5)  # engine stats arrive every 0.25 s
        return metrics(server.url)["deepinfer:prefix_cache_hits_total"] - before

    hits_after_request()
    assert hits_after_request() >= 64
    assert httpx.post(server.url + "/reset_prefix_cache", timeout=10).json() == {"status": "ok"}
    assert hits_after_request() == 0


def test_disconnect_aborts_and_frees_blocks(server, client):
    total = metrics(server.url)["deepinfer:kv_cache_total_blocks"]
    # 1000 tokens take seconds even on a fast machine: the request cannot end by itself in the window below
    body = {"model": SERVED_NAME, "prompt": "hello world", "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    other = client.completions.create(model=SERVED_NAME, prompt="the quick brown fox", max_tokens=12, stream=True,
                                      **_with_ids({**GREEDY}), logprobs=0)
    with httpx.Client(timeout=60) as http, http.stream("POST", server.url + "/v1/completions", json=body) as resp:
        events = _sse_events(resp)
        for _ in range(3):
            next(events)
        # engine stats arrive every 0.25 s while it is busy
        _wait_for(lambda: metrics(server.url)["deepinfer:kv_cache_free_blocks"] < total, 2.0)
    t0 = time.monotonic()
    while metrics(server.url)["deepinfer:num_requests_running"] + metrics(server.url)[
            "deepinfer:num_requests_waiting"] > 1:
        assert time.monotonic() - t0 < 1.5, "the disconnected request still runs"
        time.sleep(0.05)
    ids = []
    for chunk in other:
        ids += token_ids(chunk.choices[0].logprobs) if chunk.choices[0].logprobs else []
    alone = client.completions.create(model=SERVED_NAME, prompt="the quick brown fox", max_tokens=12, logprobs=0,
                                      **_with_ids(GREEDY))
    assert ids == token_ids(alone.choices[0].logprobs)
    _wait_for(lambda: metrics(server.url)["deepinfer:kv_cache_free_blocks"] == total, 2.0)


def test_non_streaming_disconnect_aborts(server):
    body = {"prompt": "hello world", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    _wait_for(lambda: metrics(server.url)["deepinfer:num_requests_running"] == 0, 1.5)
    total = metrics(server.url)["deepinfer:kv_cache_total_blocks"]
    _wait_for(lambda: metrics(server.url)["deepinfer:kv_cache_free_blocks"] == total, 1.0)


def _wait_for(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


# --- errors ----------------------------------------------------------------------------------------
def _assert_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "hi", "temperature": -1}, 400, None),
    ({"prompt": "hi", "top_p": 0}, 400, None),
    ({"prompt": "hi", "n": 1000}, 400, "n"),
    ({"prompt": "hi", "max_tokens": 0}, 400, None),
    ({"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
    ({"prompt": [7] * 1100}, 400, "prompt"),
    ({"prompt": [100000]}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ({}, 400, "prompt"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
])
def test_completion_errors(server, body, status, param):
    error = _assert_error(httpx.post(server.url + "/v1/completions", json=body, timeout=30), status)
    assert error["param"] == param


def test_malformed_json_and_oversized_body(server):
    resp = httpx.post(server.url + "/v1/chat/completions", content=b'{"messages": [', timeout=30,
                      headers={"content-type": "application/json"})
    assert "JSON" in _assert_error(resp, 400)["message"]
    resp = httpx.post(server.url + "/v1/completions", json={"prompt": "x" * 200_000}, timeout=30)
    _assert_error(resp, 413)
    _assert_error(httpx.get(server.url + "/v1/nothing-here"), 404)


def test_unknown_fields_are_ignored(server):
    resp = httpx.post(server.url + "/v1/completions", timeout=30,
                      json={"prompt": "hi", "max_tokens": 2, "frobnicate": {"x": 1}, "logit_bias": {"5": 3}})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "x"}], top_p=5)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):  # over the context: 1024 tokens
        client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "hello " * 2000}],
                                       max_tokens=4)


def test_sigterm_drains_in_flight_requests(server):
    """Last test of `server`: SIGTERM lets the running stream finish, refuses new work, exits 0."""
    body = {"prompt": "hello world", "max_tokens": 20, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", server.url + "/v1/completions", json=body) as resp:
        events = _sse_events(resp)
        next(events)
        server.proc.send_signal(signal.SIGTERM)
        rest = list(events)
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(20) == 0, server.log()
    assert _get_status(server.url + "/health") is None


# --- the guarded server: API key, queue limit, engine death ---------------------------------------
def test_api_key_required_on_v1(guarded):
    bad = openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    _assert_error(httpx.get(guarded.url + "/v1/models"), 401)
    good = openai.OpenAI(base_url=guarded.url + "/v1", api_key="sesame", max_retries=0)
    assert [m.id for m in good.models.list().data] == ["model"]  # default name: the model directory's
    assert httpx.get(guarded.url + "/health").status_code == 200  # not under /v1
    _assert_error(httpx.post(guarded.url + "/reset_prefix_cache"), 401)  # an admin action: guarded too
    auth = {"Authorization": "Bearer sesame"}
    assert httpx.post(guarded.url + "/reset_prefix_cache", headers=auth).status_code == 200


def test_queue_full_answers_429(guarded):
    headers = {"Authorization": "Bearer sesame"}
    body = {"prompt": "hello", "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, headers=headers) as http:
        with http.stream("POST", guarded.url + "/v1/completions", json=body) as resp:
            events = _sse_events(resp)  # kept referenced: a collected iterator closes the stream
            assert "error" not in next(events)
            full = http.post(guarded.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert _assert_error(full, 429)["type"] == "rate_limit_error"
            assert int(full.headers["Retry-After"]) >= 1
        _wait_for(lambda: http.post(guarded.url + "/v1/completions",
                                    json={"prompt": "hi", "max_tokens": 2}).status_code == 200, 5.0)


def test_engine_death_fails_requests_and_exits_nonzero(guarded):
    """Last test of `guarded`: kill -9 the engine mid-stream."""
    headers = {"Authorization": "Bearer sesame"}
    engine_pid = httpx.get(guarded.url + "/version").json()["engine_pid"]
    body = {"prompt": "hello", "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, headers=headers) as http, \
            http.stream("POST", guarded.url + "/v1/completions", json=body) as resp:
        events = _sse_events(resp)
        next(events)
        os.kill(engine_pid, signal.SIGKILL)
        rest = list(events)
    assert rest[-1] == "[DONE]" and "error" in json.loads(rest[-2])
    statuses = []
    t0 = time.monotonic()
    while guarded.proc.poll() is None and time.monotonic() - t0 < 10:
        statuses.append(_get_status(guarded.url + "/health"))
        time.sleep(0.05)
    assert 503 in statuses
    assert guarded.proc.wait(1) != 0
    assert time.monotonic() - t0 < 10
