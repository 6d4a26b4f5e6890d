"""`POST /v1/messages` (the Anthropic Messages API) end to end: the real `deepinfer serve` process on the bundled
default model (it has DeepSeek's tool-call tokens and a template with tools and thinking), with an API key and
--max-queue 1, and the official `anthropic` client: text, system, stop sequences, max_tokens, streaming equal to
non-streaming, a tool round trip (forced tool_use, tool_result back, a text answer), thinking blocks, x-api-key
and Bearer auth, Anthropic-shaped errors (400 / 401 / 404 / 529, and an `error` event mid-stream).

Sampling fields go in `extra_body`: recent `anthropic` clients dropped temperature from `messages.create`.
Tests run in file order; the last one kills the engine.
"""

from __future__ import annotations

import json
import os
import signal

import httpx
import jsonschema
import pytest
from test_server import _wait_for, running_server

from deepinfer.llm import default_model_path
from deepinfer.server.anthropic_api import _Blocks, chat_request, error_status
from deepinfer.server.anthropic_protocol import AnthropicMessagesRequest
from deepinfer.server.errors import APIError

anthropic = pytest.importorskip("anthropic")

KEY = "sk-test"
GREEDY = {"temperature": 0, "ignore_eos": True}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                                  "parameters": WEATHER}}]
QUESTION = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("anthropic-server") / "server.log"
    with running_server(default_model_path(), log, "--served-model-name", "m", "--api-key", KEY,
                        "--max-queue", "1") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def _create(client, messages=None, extra: dict | None = None, **kw):
    kw.setdefault("max_tokens", 16)
    return client.messages.create(model="m", messages=messages or [{"role": "user", "content": "hello world"}],
                                  extra_body={**GREEDY, **(extra or {})}, **kw)


def _as_param(message) -> dict:
    """A returned message as the next request's assistant turn (Message.to_param() of recent clients)."""
    return {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]}


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def _chat_prompt_tokens(server, messages: list[dict], **extra) -> tuple[int, dict]:
    """The OpenAI route's prompt_tokens and message for the same conversation (greedy, 16 tokens)."""
    body = {"model": "m", "messages": messages, "max_tokens": 16, **GREEDY,
            "chat_template_kwargs": {"thinking": False}, **extra}
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens"], resp.json()["choices"][0]["message"]


# --- text ----------------------------------------------------------------------------------------
def test_text_equals_the_chat_route(client, server):
    """Same prompt and greedy output as /v1/chat/completions; a system prompt as a string or as text blocks."""
    system = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Answer in English."}]
    message = _create(client, system=system)
    assert message.type == "message" and message.role == "assistant" and message.model == "m"
    assert message.id.startswith("msg_") and [b.type for b in message.content] == ["text"]
    tokens, chat = _chat_prompt_tokens(server, [{"role": "system", "content": "Be brief.\n\nAnswer in English."},
                                                {"role": "user", "content": "hello world"}])
    assert message.usage.input_tokens == tokens and message.usage.output_tokens == 16
    assert _text(message) == chat["content"] and message.stop_reason == "max_tokens"
    as_string = _create(client, system="Be brief.\n\nAnswer in English.")
    assert as_string.usage.input_tokens == tokens and _text(as_string) == _text(message)


def test_max_tokens_and_end_turn(client):
    message = _create(client, max_tokens=5)
    assert (message.stop_reason, message.stop_sequence, message.usage.output_tokens) == ("max_tokens", None, 5)
    natural = _create(client, max_tokens=200, extra={"ignore_eos": False})
    assert natural.stop_reason in ("end_turn", "max_tokens")
    assert natural.stop_reason == "max_tokens" or natural.usage.output_tokens < 200


def test_stop_sequences(client):
    text = _text(_create(client, max_tokens=24))
    visible = [i for i, ch in enumerate(text) if not ch.isspace()]
    stop = text[visible[len(visible) // 2]]
    message = _create(client, max_tokens=24, stop_sequences=["never-generated", stop])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert _text(message) == text[:text.index(stop)]


def test_streaming_equals_non_streaming(client):
    whole = _create(client, max_tokens=20, system="Be brief.")
    with client.messages.stream(model="m", max_tokens=20, system="Be brief.",
                                messages=[{"role": "user", "content": "hello world"}], extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == _text(whole) == _text(final)
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == \
        (whole.stop_reason, whole.usage.input_tokens, whole.usage.output_tokens)


def test_stream_event_order(client):
    events = list(client.messages.create(model="m", max_tokens=6, stream=True, extra_body=GREEDY,
                                         messages=[{"role": "user", "content": "hello world"}]))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:] == ["content_block_start", *["content_block_delta"] * (len(kinds) - 5), "content_block_stop",
                         "message_delta", "message_stop"]
    start = events[0].message
    assert start.content == [] and start.stop_reason is None and start.usage.input_tokens > 0
    assert all(e.delta.type == "text_delta" for e in events if e.type == "content_block_delta")
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 6


def test_raw_stream_has_ping_and_no_done_marker(server):
    body = {"model": "m", "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    resp = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    names = [line.removeprefix("event: ") for line in resp.text.splitlines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    assert "[DONE]" not in resp.text
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            assert json.loads(line.removeprefix("data: "))["type"] in names


# --- tools ---------------------------------------------------------------------------------------
def _forced_call(client, **kw):
    return _create(client, QUESTION, max_tokens=100, tools=TOOLS,
                   tool_choice={"type": "tool", "name": "get_weather"}, **kw)


def test_tool_round_trip(client, server):
    """tool_choice tool forces a valid tool_use; its tool_result goes back and the model answers in text."""
    call = _forced_call(client)
    assert call.stop_reason == "tool_use" and [b.type for b in call.content] == ["tool_use"]
    use = call.content[0]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER)
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 25 C"}]}
    conversation = [*QUESTION, _as_param(call), result]
    answer = _create(client, conversation, tools=TOOLS)
    assert answer.stop_reason in ("end_turn", "max_tokens") and _text(answer)
    openai_call = {"id": use.id, "type": "function",
                   "function": {"name": use.name, "arguments": json.dumps(use.input, ensure_ascii=False)}}
    tokens, chat = _chat_prompt_tokens(server, [*QUESTION, {"role": "assistant", "content": None,
                                                            "tool_calls": [openai_call]},
                                                {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 25 C"}],
                                       tools=OPENAI_TOOLS)
    assert answer.usage.input_tokens == tokens and _text(answer) == chat["content"]


def test_any_tool_choice_and_single_call(client):
    message = _create(client, QUESTION, max_tokens=160, tools=TOOLS,
                      tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert message.stop_reason in ("tool_use", "max_tokens")
    uses = [b for b in message.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER)


def test_streamed_tool_use_equals_non_streamed(client):
    whole = _forced_call(client)
    with client.messages.stream(model="m", messages=QUESTION, max_tokens=100, tools=TOOLS, extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert deltas and all(d.type == "input_json_delta" for d in deltas)
    assert json.loads("".join(d.partial_json for d in deltas)) == whole.content[0].input
    assert [(b.type, b.name, b.input) for b in final.content] == [(b.type, b.name, b.input) for b in whole.content]
    assert final.stop_reason == "tool_use"


def test_tool_choice_none_hides_the_tools(client):
    message = _create(client, QUESTION, tools=TOOLS, tool_choice={"type": "none"})
    assert all(b.type == "text" for b in message.content) and message.stop_reason == "max_tokens"
    assert message.usage.input_tokens == _create(client, QUESTION).usage.input_tokens


# --- thinking ------------------------------------------------------------------------------------
def test_thinking_blocks(client):
    """Thinking off by default; enabled, the reasoning comes as a thinking block, streamed as thinking_delta."""
    question = [{"role": "user", "content": "Think about it"}]
    assert all(b.type != "thinking" for b in _create(client, question, max_tokens=12).content)
    thinking = {"type": "enabled", "budget_tokens": 1024}
    message = _create(client, question, max_tokens=12, thinking=thinking)
    assert message.content[0].type == "thinking" and message.content[0].thinking
    assert message.content[0].signature == ""
    with client.messages.stream(model="m", messages=question, max_tokens=12, thinking=thinking,
                                extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert {e.delta.type for e in events if e.type == "content_block_delta"} <= {"thinking_delta", "text_delta"}
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]
    again = [*question, _as_param(final), {"role": "user", "content": "And now?"}]  # thinking blocks go back in
    assert _create(client, again, max_tokens=4, thinking=thinking).stop_reason == "max_tokens"


def test_openapi_documents_the_route(server):
    operation = httpx.get(server.url + "/openapi.json", timeout=30).json()["paths"]["/v1/messages"]["post"]
    assert set(operation["responses"]) == {"200", "400", "401", "404", "413", "500", "503", "529"}
    assert set(operation["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "Retry-After" in operation["responses"]["529"]["headers"]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    assert schema["$ref"].endswith("/AnthropicMessagesRequest")


# --- auth and errors -----------------------------------------------------------------------------
def _error(resp: httpx.Response, status: int, kind: str) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}
    return body["error"]["message"]


def test_api_keys(server):
    no_key = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        no_key.messages.create(model="m", max_tokens=2, messages=QUESTION)
    assert err.value.status_code == 401 and err.value.body["error"]["type"] == "authentication_error"
    body = {"model": "m", "max_tokens": 2, "messages": QUESTION}
    _error(httpx.post(server.url + "/v1/messages", json=body), 401, "authentication_error")
    bearer = anthropic.Anthropic(base_url=server.url, api_key=None, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(model="m", max_tokens=2, messages=QUESTION).usage.output_tokens <= 2
    # x-api-key works on the OpenAI routes too
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": "wrong"}).status_code == 401


DROP = object()  # the field left out
BAD_REQUESTS = [
    ({"max_tokens": DROP}, "max_tokens: Field required"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages must not be empty"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]}, "image"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "unsupported block type 'audio'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "base64"}}]}]}]}, "a tool result's image blocks are not supported"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "role"),
    ({"messages": [*QUESTION, {"role": "assistant", "content": "The weather"}]}, "prefill"),
    ({"tool_choice": {"type": "any"}}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "not among the tools"),
    ({"tools": [{"name": "bad name", "input_schema": {}}]}, "must match"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
    ({"tools": [{"name": "f", "input_schema": {"type": 3}}]}, "tools"),
    ({"thinking": {"type": "sometimes"}}, "thinking"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "0"}, "temperature"),
    ({"stop_sequences": "x"}, "stop_sequences"),
    ({"max_tokens": 10**6}, "max_tokens"),
]


@pytest.mark.parametrize("extra, reason", BAD_REQUESTS)
def test_bad_requests_answer_400(server, extra, reason):
    body = {k: v for k, v in {"model": "m", "max_tokens": 4, "messages": QUESTION, **extra}.items() if v is not DROP}
    resp = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert reason in _error(resp, 400, "invalid_request_error")


def test_errors_through_the_client(client, server):
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=QUESTION)
    assert err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])
    headers = {"x-api-key": KEY}
    _error(httpx.get(server.url + "/v1/messages", headers=headers), 405, "invalid_request_error")
    count = httpx.post(server.url + "/v1/messages/count_tokens", json={"model": "m", "messages": QUESTION},
                       headers=headers)
    assert "not implemented" in _error(count, 404, "not_found_error")
    resp = httpx.post(server.url + "/v1/messages", content=b"{not json", headers={"x-api-key": KEY,
                                                                                   "content-type": "application/json"})
    assert "malformed JSON" in _error(resp, 400, "invalid_request_error")


def test_queue_full_is_overloaded_529(server):
    """--max-queue 1: while a stream runs, another request is 529 overloaded_error with Retry-After; the stream's
    disconnect frees the slot."""
    body = {"model": "m", "max_tokens": 400, "stream": True, "messages": QUESTION, **GREEDY}
    with httpx.Client(timeout=60, headers={"x-api-key": KEY}) as http:
        with http.stream("POST", server.url + "/v1/messages", json=body) as resp:
            lines = resp.iter_lines()
            assert next(lines) == "event: message_start"
            full = http.post(server.url + "/v1/messages", json={**body, "stream": False, "max_tokens": 2})
            _error(full, 529, "overloaded_error")
            assert int(full.headers["Retry-After"]) >= 1
        small = {**body, "stream": False, "max_tokens": 2}
        _wait_for(lambda: http.post(server.url + "/v1/messages", json=small).status_code == 200, 10.0)


def test_engine_death_is_an_error_event(server, client):
    """Last test: kill -9 the engine mid-stream; the stream ends with an `error` event, which the client raises."""
    engine_pid = httpx.get(server.url + "/version").json()["engine_pid"]
    with pytest.raises(anthropic.APIStatusError) as err, \
            client.messages.stream(model="m", messages=QUESTION, max_tokens=400, extra_body=GREEDY) as stream:
        for i, _ in enumerate(stream.text_stream):
            if i == 2:
                os.kill(engine_pid, signal.SIGKILL)
    assert err.value.body["error"]["type"] == "api_error"
    _error(httpx.post(server.url + "/v1/messages", json={"model": "m", "max_tokens": 2, "messages": QUESTION},
                      headers={"x-api-key": KEY}, timeout=30), 503, "api_error")


# --- translation units (no server) ---------------------------------------------------------------
def _request(**body) -> AnthropicMessagesRequest:
    return AnthropicMessagesRequest.model_validate({"model": "m", "max_tokens": 8, **body})


def test_content_blocks_become_chat_messages():
    req = chat_request(_request(system="S", thinking={"type": "enabled", "budget_tokens": 2048}, messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "x"},
                                          {"type": "redacted_thinking", "data": "?"},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "r"}]},
                                     {"type": "text", "text": "then?"}]}]))
    assert [m.model_dump(exclude_none=True) for m in req.messages] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "a\n\nb"},
        {"role": "assistant", "reasoning_content": "hmm", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "r", "tool_call_id": "t1"},
        {"role": "user", "content": "then?"}]
    assert req.chat_template_kwargs == {"thinking": True} and req.max_tokens == 8 and req.tools is None
    assert chat_request(_request(messages=QUESTION)).chat_template_kwargs == {"thinking": False}


def test_tool_choices_map_to_chat_tool_choices():
    def mapped(choice):
        req = chat_request(_request(messages=QUESTION, tools=TOOLS, tool_choice=choice))
        return req.tool_choice, req.parallel_tool_calls

    assert mapped({"type": "auto"}) == ("auto", True)
    assert mapped({"type": "any", "disable_parallel_tool_use": True}) == ("required", False)
    assert mapped({"type": "tool", "name": "get_weather"}) == (
        {"type": "function", "function": {"name": "get_weather"}}, True)
    assert mapped({"type": "none"}) == ("none", True)
    tool = chat_request(_request(messages=QUESTION, tools=TOOLS)).tools[0]
    assert tool.function.parameters == WEATHER and tool.function.name == "get_weather"


def _events(items: list[str]) -> list[dict]:
    return [json.loads(item.split("data: ", 1)[1]) for item in items]


def test_blocks_stream_shapes():
    blocks = _Blocks(single_call=True)
    items = blocks.feed({"reasoning_content": "r"}) + blocks.feed({"content": "c"})
    items += blocks.feed({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f", "arguments": '{"x"'}}]})
    items += blocks.feed({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]})  # a continuation
    items += blocks.feed({"tool_calls": [{"index": 1, "id": "b", "function": {"name": "g", "arguments": "{}"}}]})
    items += blocks.close()
    events = _events(items)
    assert [(e["type"], e.get("index")) for e in events] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2)]
    assert events[6]["content_block"] == {"type": "tool_use", "id": "a", "name": "f", "input": {}}
    assert events[7]["delta"] == {"type": "input_json_delta", "partial_json": '{"x": 1}'}  # the second call dropped
    bad = _Blocks(single_call=False)
    items = bad.feed({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f", "arguments": "[1"}}]})
    assert _events(items + bad.close())[1]["delta"]["partial_json"] == "{}"


def test_text_after_a_call_stays_in_the_one_text_block_before_the_tool_use():
    """The streamed blocks are the whole message's: thinking, text (all of it), then tool_use."""
    blocks = _Blocks(single_call=False)
    items = blocks.feed({"content": "a"})
    items += blocks.feed({"tool_calls": [{"index": 0, "id": "t", "function": {"name": "f", "arguments": "{}"}}]})
    items += blocks.feed({"content": "b"}) + blocks.close()
    events = _events(items)
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    texts = [e["delta"]["text"] for e in events if e["type"] == "content_block_delta" and e["index"] == 0]
    assert starts == ["text", "tool_use"] and texts == ["a", "b"]
    assert [e["type"] for e in events[-3:]] == ["content_block_start", "content_block_delta", "content_block_stop"]


def test_tool_input_takes_json_proper_only():
    from deepinfer.server.anthropic_api import tool_input

    assert tool_input('{"x": 1.5}') == {"x": 1.5}
    for bad in ('{"x": NaN}', '{"x": Infinity}', '{"x": 1e999}', "[1]", "{"):
        assert tool_input(bad) == {}


def test_error_statuses():
    assert error_status(APIError(400, "x")) == (400, "invalid_request_error")
    assert error_status(APIError(401, "x")) == (401, "authentication_error")
    assert error_status(APIError(404, "x")) == (404, "not_found_error")
    assert error_status(APIError(413, "x")) == (413, "request_too_large")
    assert error_status(APIError(429, "x")) == (529, "overloaded_error")
    assert error_status(APIError(503, "x", code="replica_lost")) == (529, "overloaded_error")
    assert error_status(APIError(503, "x", code="engine_dead")) == (503, "api_error")
    assert error_status(APIError(500, "x")) == (500, "api_error")
