"""Fuzzed request bodies against the real server: never a 5xx, never a hung connection.

Bodies mix plausible values, arbitrary JSON (NaN and Infinity included: Python's json accepts them) and
unknown extra fields. The context is 64 tokens, so even an accepted request generates little.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_server import ServerProcess, tiny_checkpoint

EXAMPLES = 50
TIMEOUT_S = 30.0  # far above any legitimate answer here: hitting it means a hung connection

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 40),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
json_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                           max_leaves=8)

_messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
     "content": st.one_of(st.text(max_size=20), st.lists(st.fixed_dictionaries(
         {"type": st.just("text"), "text": st.text(max_size=10)}), max_size=2), st.none())}), max_size=3)

_text_prompt = st.text(max_size=30)
_id_prompt = st.lists(st.integers(0, 511), min_size=1, max_size=12)
_valid_messages = st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=20)}),
                           min_size=1, max_size=2)

# Values the server must accept (the outcome may still be a 400 for context length).
_VALID = {
    "model": st.just("model"),
    "max_tokens": st.integers(1, 8),
    "max_completion_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 600),
    "min_p": st.floats(0, 1),
    "n": st.integers(1, 4),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 600), max_size=3),
    "seed": st.integers(-(2**62), 2**62),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 2),
    "logprobs": st.integers(0, 5),
    "top_logprobs": st.integers(0, 5),
    "echo": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 1),
    "chat_template_kwargs": st.fixed_dictionaries({"thinking": st.booleans()}),
    "priority": st.integers(-5, 5),
    "prompt": st.one_of(_text_prompt, st.lists(_text_prompt, min_size=1, max_size=3), _id_prompt,
                        st.lists(_id_prompt, min_size=1, max_size=3)),
    "messages": _valid_messages,
}

# Near misses: out of range, wrong shape, wrong role.
_EDGY = {
    **_VALID,
    "model": st.sampled_from(["model", "other", ""]),
    "max_tokens": st.integers(-1, 2**40),
    "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-2, 2**40),
    "n": st.integers(-1, 10),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=40)),
    "stop_token_ids": st.lists(st.integers(-5, 2**40), max_size=3),
    "seed": st.integers(-(2**70), 2**70),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 25)),
    "top_logprobs": st.integers(-1, 25),
    "min_tokens": st.integers(-1, 100),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["thinking", "messages", "tokenize", "bos_token", "x"]),
                                            json_values, max_size=2),
    "prompt": st.one_of(_VALID["prompt"], st.lists(st.integers(-3, 2**40), max_size=12), st.just([]),
                        st.lists(st.lists(st.integers(0, 600), max_size=5), max_size=3)),
    "messages": _messages,
}
_CHAT_ONLY = {"messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs"}
_COMPLETION_ONLY = {"prompt", "echo"}
_extra_fields = st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda k: k not in _VALID), json_values,
                                max_size=3)


def _bodies(fields: list[str], required: str, **overrides):
    """Valid bodies (generation runs), near misses, and wild ones; each with random unknown fields."""
    ok = {**_VALID, **overrides}
    others = [f for f in fields if f != required]
    valid = st.fixed_dictionaries({required: ok[required]}, optional={f: ok[f] for f in others})
    edgy = st.fixed_dictionaries({}, optional={f: _EDGY[f] for f in fields})
    wild = st.fixed_dictionaries({}, optional={f: st.one_of(_EDGY[f], json_values) for f in fields})
    return st.builds(lambda known, extra: {**extra, **known}, st.one_of(valid, valid, valid, edgy, wild), _extra_fields)


_COMPLETION_BODIES = _bodies([f for f in _VALID if f not in _CHAT_ONLY], "prompt")
_CHAT_BODIES = _bodies([f for f in _VALID if f not in _COMPLETION_ONLY], "messages", logprobs=st.booleans())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(tiny_checkpoint(tmp_path_factory), tmp_path_factory.mktemp("fuzz") / "server.log",
                         "--max-model-len", "64", "--max-n", "4")
    yield proc.wait_ready()
    proc.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as client:
        yield client


def _post(http: httpx.Client, path: str, body: dict) -> None:
    content = json.dumps(body, allow_nan=True).encode()
    with http.stream("POST", path, content=content, headers={"content-type": "application/json"}) as resp:
        raw = resp.read().decode("utf-8", "replace")
    event(f"status {resp.status_code}")
    assert resp.status_code < 500, (resp.status_code, raw[:500], body)
    if resp.status_code != 200:
        assert set(json.loads(raw)["error"]) == {"message", "type", "param", "code"}
    elif resp.headers["content-type"].startswith("text/event-stream"):
        _check_stream(raw, body)
    else:
        assert json.loads(raw)["usage"]["total_tokens"] >= 1


def _check_stream(raw: str, body: dict) -> None:
    events = [line[len("data: "):] for line in raw.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", (raw[-500:], body)
    for data in events[:-1]:
        error = json.loads(data).get("error")
        assert error is None or error.get("type") != "server_error", (error, body)


_FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                              HealthCheck.data_too_large])


@_FUZZ
@given(body=_COMPLETION_BODIES)
def test_fuzzed_completions_never_fail_the_server(http, body):
    _post(http, "/v1/completions", body)


@pytest.mark.slow  # the completions fuzz runs by default
@_FUZZ
@given(body=_CHAT_BODIES)
def test_fuzzed_chat_never_fails_the_server(http, body):
    _post(http, "/v1/chat/completions", body)


ODD_BODIES = [b"", b"null", b"[]", b"42", b'"x"', b"{", b'{"prompt": NaN}', b"\xff\xfe", b'{"prompt": "\\ud800"}',
              b'{"messages": [{"role": "user", "content": "\\udfff"}]}']


@pytest.mark.parametrize("content", ODD_BODIES)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_odd_bodies_get_a_4xx(http, path, content):
    resp = http.post(path, content=content, headers={"content-type": "application/json"})
    assert 400 <= resp.status_code < 500, resp.text
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_server_still_healthy_after_fuzzing(http):
    assert http.get("/health").status_code == 200
    out = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "temperature": 0}).json()
    assert out["usage"]["completion_tokens"] >= 1 and not math.isnan(out["created"])
