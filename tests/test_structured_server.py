"""Structured outputs and tool calling through the real server process (bundled model) and the official
`openai` client: forced tool calls always validate against their schemas, streaming and not; response
formats, regex / choice extras; every bad constraint or tool spec answers 400 before anything streams."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_server import running_server

from deepinfer.llm import default_model_path
from deepinfer.server.tools import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    ToolCallStream,
    message_tool_calls,
    parse_tool_calls,
)

# Argument schemas whose worst case (6 bytes per string character, one whitespace between JSON tokens,
# the markers) fits FORCED_MAX_TOKENS, so a forced call always completes.
FORCED_MAX_TOKENS = 160
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                        "b": {"type": "integer", "minimum": -999, "maximum": 999}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
QUESTIONS = ["What's the weather in Paris?", "Add 2 and 3", "Forecast for Tokyo for 3 days", "What is 10 + 32?",
             "Is it raining in Lima?", "Sum -4 and 9"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("structured-server") / "server.log"
    with running_server(default_model_path(), log, "--served-model-name", "m") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, question: str, **kw):
    kw.setdefault("max_tokens", 96)
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}], **kw)


def _check_calls(calls: list, allowed: set[str]) -> None:
    assert calls, "finish_reason tool_calls needs a non-empty list"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", pytest.param({"type": "function", "function": {"name": "add"}},
                                                              marks=pytest.mark.slow)])
def test_forced_tool_calls_validate(client, choice):
    """One call (parallel_tool_calls=False): always a valid call and finish_reason tool_calls."""
    allowed = {"add"} if isinstance(choice, dict) else set(SCHEMAS)
    for i, question in enumerate(QUESTIONS):
        r = _chat(client, question, tools=TOOLS, tool_choice=choice, temperature=0.0 if i % 2 else 0.8, seed=i,
                  parallel_tool_calls=False, max_tokens=FORCED_MAX_TOKENS)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c.message
        assert len(c.message.tool_calls) == 1
        _check_calls(c.message.tool_calls, allowed)


def test_parallel_forced_tool_calls_all_validate(client):
    """Parallel calls: the model decides when to stop calling; every call it completes validates (a
    small model may keep calling until max_tokens, which is finish_reason length, never an empty list)."""
    for i, question in enumerate(QUESTIONS[:3]):
        c = _chat(client, question, tools=TOOLS, tool_choice="required", temperature=0.8, seed=i,
                  max_tokens=FORCED_MAX_TOKENS).choices[0]
        assert c.finish_reason in ("tool_calls", "length")
        _check_calls(c.message.tool_calls, set(SCHEMAS))


def _collect_stream(stream) -> tuple[str, list, str | None]:
    """Reassembles content and tool calls from streamed deltas, the OpenAI way (by index)."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        content += delta.content or ""
        for d in delta.tool_calls or ():
            first = d.index not in calls  # a call's id and name come once, in its first delta
            assert (d.id is not None) == first and (d.function.name is not None) == first
            entry = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            entry["arguments"] += d.function.arguments or ""
    merged = [openai.types.chat.ChatCompletionMessageToolCall(
        id=v["id"], type="function", function={"name": v["name"], "arguments": v["arguments"]})
        for _, v in sorted(calls.items())]
    return content, merged, finish


@pytest.mark.parametrize("choice", [pytest.param("required", marks=pytest.mark.slow),
                                    {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_validate_streaming(client, choice):
    allowed = {"get_weather"} if isinstance(choice, dict) else set(SCHEMAS)
    for i, question in enumerate(QUESTIONS):
        stream = _chat(client, question, tools=TOOLS, tool_choice=choice, stream=True, temperature=0.7, seed=i,
                       parallel_tool_calls=False, max_tokens=FORCED_MAX_TOKENS)
        content, calls, finish = _collect_stream(stream)
        assert finish == "tool_calls" and not content.strip()
        _check_calls(calls, allowed)


def test_each_of_n_choices_gets_its_own_calls(client):
    kw = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=3, temperature=1.0, seed=5,
              max_tokens=FORCED_MAX_TOKENS)
    r = _chat(client, QUESTIONS[0], **kw)
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "tool_calls"
        _check_calls(c.message.tool_calls, set(SCHEMAS))
    calls: dict[int, dict[int, list]] = {}  # choice -> call index -> [name, arguments]
    finishes = {}
    for chunk in _chat(client, QUESTIONS[0], stream=True, **kw):
        for choice in chunk.choices:
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
            for d in choice.delta.tool_calls or ():
                entry = calls.setdefault(choice.index, {}).setdefault(d.index, [d.function.name, ""])
                entry[1] += d.function.arguments or ""
    assert finishes == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
    assert len(calls) == 3 and all(list(by_call) == [0] for by_call in calls.values())
    for by_call in calls.values():
        name, arguments = by_call[0]
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_auto_and_none_tool_choice_never_return_an_empty_list(client):
    for choice in ("auto", "none"):
        for question in QUESTIONS[:3]:
            c = _chat(client, question, tools=TOOLS, tool_choice=choice, temperature=0.0, max_tokens=48).choices[0]
            assert c.message.tool_calls is None or len(c.message.tool_calls) > 0
            assert (c.finish_reason == "tool_calls") == bool(c.message.tool_calls)
            assert choice == "auto" or c.message.tool_calls is None


def test_tool_results_round_trip_through_the_template(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [{"role": "user", "content": "Add 1 and 2"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_response_formats(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    for stream in (False, True):
        for i in range(3):
            r = _chat(client, f"Answer in JSON #{i}", response_format=fmt, stream=stream, temperature=0.8, seed=i)
            text, finish = (_collect_stream(r)[::2] if stream else (r.choices[0].message.content,
                                                                  r.choices[0].finish_reason))
            assert finish == "stop"
            jsonschema.validate(json.loads(text), schema)
    r = _chat(client, "JSON object please", response_format={"type": "json_object"}, max_tokens=200)
    text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop" and isinstance(json.loads(text), dict)  # unbounded, but closed within the budget


# Unbounded numbers, strings and arrays: without budget-aware decoding the bundled model writes digits until
# max_tokens ends the output mid-structure (about half of these requests).
UNBOUNDED = {"type": "object", "properties": {"id": {"type": "integer"}, "score": {"type": "number"},
                                              "tags": {"type": "array", "items": {"type": "string"}}},
             "required": ["id", "score", "tags"]}
UNBOUNDED_TOOL = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
    "required": ["query", "limit"]}}}]


@pytest.mark.parametrize("stream", [False, True])
def test_unbounded_schemas_close_within_small_budgets(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": UNBOUNDED}}
    for i, budget in enumerate((18, 24, 40, 64)):
        r = _chat(client, f"Record #{i}", response_format=fmt, stream=stream, temperature=1.0, seed=i,
                  max_tokens=budget)
        text, finish = _collect_stream(r)[::2] if stream else (r.choices[0].message.content, r.choices[0].finish_reason)
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), UNBOUNDED)


@pytest.mark.parametrize("stream", [False, True])
def test_generated_schemas_close_within_small_budgets(client, stream):
    """Generated schemas (unbounded fields, nested objects) at 20 tokens over their closing need, n = 2,
    temperature 1: every choice validates and ends with "stop"."""
    from test_structured_budget import SCHEMAS

    for i, schema in enumerate(SCHEMAS[:4]):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
        budget = 20 + len(json.dumps(schema)) // 8  # comfortably above the closing need of these schemas
        if stream:
            r = _chat(client, f"Item {i}", response_format=fmt, stream=True, temperature=1.0, seed=i,
                      max_tokens=budget)
            text, _, finish = _collect_stream(r)
            outputs = [(text, finish)]
        else:
            r = _chat(client, f"Item {i}", response_format=fmt, n=2, temperature=1.0, seed=i, max_tokens=budget)
            outputs = [(c.message.content, c.finish_reason) for c in r.choices]
        for text, finish in outputs:
            assert finish == "stop", (schema, text)
            jsonschema.validate(json.loads(text), schema)


def test_a_budget_below_the_closing_need_is_a_400(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": UNBOUNDED}}
    for field, body in (("max_tokens", {"response_format": fmt, "max_tokens": 3}),
                        ("max_completion_tokens", {"tools": UNBOUNDED_TOOL, "tool_choice": "required",
                                                   "max_completion_tokens": 5})):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == field and "needs" in error["message"]
    r = httpx.post(server.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1,
                                                         "structured_outputs": {"regex": "[a-z]{4}"}}, timeout=60)
    assert r.status_code == 400 and "cannot hold" in r.json()["error"]["message"]  # 4 letters + EOS need more


@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_with_unbounded_arguments_close_within_the_budget(client, stream):
    for i, budget in enumerate((32, 48, 120)):
        r = _chat(client, f"Look up item {i}", tools=UNBOUNDED_TOOL, tool_choice="required", stream=stream,
                  parallel_tool_calls=False, temperature=1.0, seed=i, max_tokens=budget)
        content, calls, finish = _collect_stream(r) if stream else (
            r.choices[0].message.content or "", r.choices[0].message.tool_calls, r.choices[0].finish_reason)
        assert finish == "tool_calls" and not content.strip() and len(calls) == 1
        assert CALLS_BEGIN not in content
        jsonschema.validate(json.loads(calls[0].function.arguments), UNBOUNDED_TOOL[0]["function"]["parameters"])


def test_thinking_mode_leaves_the_reasoning_unconstrained(client):
    """The bundled model does not close its reasoning within 24 tokens: the reasoning is free text and the
    JSON constraint (which applies after `</think>`) has not started."""
    r = _chat(client, "Think about it", response_format={"type": "json_object"}, max_tokens=24, temperature=0.0,
              extra_body={"chat_template_kwargs": {"thinking": True}})
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and message.content is None
    assert message.reasoning_content and not message.reasoning_content.startswith("{")


def test_completions_regex_choice_and_guided_json(client):
    for i in range(3):
        r = client.completions.create(model="m", prompt=f"def f{i}(", max_tokens=24, temperature=0.9, seed=i,
                                      extra_body={"structured_outputs": {"regex": r"[a-z_]{1,8}\) -> (int|str):"}})
        assert re.fullmatch(r"[a-z_]{1,8}\) -> (int|str):", r.choices[0].text)
        r = client.completions.create(model="m", prompt="x = ", max_tokens=8, temperature=0.9, seed=i,
                                      extra_body={"guided_choice": ["None", "True", "[]"]})
        assert r.choices[0].text in ("None", "True", "[]") and r.choices[0].finish_reason == "stop"
    stream = client.completions.create(model="m", prompt="config = ", max_tokens=48, stream=True,
                                       extra_body={"guided_json": {"type": "object", "properties": {
                                           "debug": {"type": "boolean"}}, "required": ["debug"]}})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert isinstance(json.loads(text)["debug"], bool)


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema is required"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(a"}}, "parenthesis"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, "not defined"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"structured_outputs": {"yaml": "a"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "at most one"),
    ({"guided_json": '{"type": "object"', "stream": True}, "not valid JSON"),
    ({"guided_choice": []}, "non-empty list"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "must match"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]}, "parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "at most one"),
    ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens cannot"),
]


@pytest.mark.parametrize("extra, reason", BAD)
def test_bad_constraints_answer_400(server, extra, reason):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]["message"]


def test_bad_constraint_on_completions_answers_400(server):
    body = {"model": "m", "prompt": "x", "max_tokens": 4, "stream": True, "structured_outputs": {"regex": "[z-a]"}}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and "regex" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # nothing leaked, still serving


# --- the parser, without a server --------------------------------------------------------------------
def _call_text(name: str, args: str, fenced: bool = False) -> str:
    if fenced:  # DeepSeek V3 / R1 style
        return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{args}\n```{CALL_END}"
    return f"{CALL_BEGIN}{name}{SEP}{args}{CALL_END}"


def test_parser_reads_both_deepseek_call_styles():
    text = "ok " + CALLS_BEGIN + _call_text("f", '{"a": 1}') + _call_text("g", '{"b": [2]}', fenced=True) + CALLS_END
    content, calls = parse_tool_calls(text)
    assert content == "ok " and [(c.name, c.arguments, c.complete) for c in calls] == [
        ("f", '{"a": 1}', True), ("g", '{"b": [2]}', True)]


_TEXT = st.builds(lambda pre, calls: pre + (CALLS_BEGIN + "".join(_call_text(*c) for c in calls) + CALLS_END
                                            if calls else ""),
                  st.text(max_size=20), st.lists(st.tuples(st.sampled_from(["f", "get_weather"]),
                                                           st.text(max_size=20), st.booleans()), max_size=3))


@settings(max_examples=200, deadline=None)
@given(_TEXT, st.lists(st.integers(0, 200), max_size=8))
def test_streamed_tool_deltas_reassemble_the_whole_parse(text, cuts):
    content, calls = parse_tool_calls(text)
    stream, got_content, got = ToolCallStream(), "", {}
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    for i, (a, b) in enumerate(zip(bounds, bounds[1:] + [len(text)])):
        piece, deltas = stream.feed(text[a:b], final=i == len(bounds) - 1)
        got_content += piece
        for d in deltas:
            entry = got.setdefault(d["index"], {"name": d["function"].get("name"), "arguments": ""})
            entry["arguments"] += d["function"]["arguments"]
    assert got_content == content
    assert [(v["name"], v["arguments"]) for _, v in sorted(got.items())] == [(c.name, c.arguments) for c in calls]


@settings(max_examples=200, deadline=None)
@given(_TEXT, st.integers(0, 200), st.lists(st.integers(0, 200), max_size=6))
def test_a_truncated_call_never_leaks_markup_or_a_partial_call(text, cut, cuts):
    """max_tokens can end the output anywhere: content never holds tool-call markup, and neither the
    message nor the stream carries a call that did not reach its end marker."""
    text = text[:cut]
    content, calls = message_tool_calls(text)
    assert CALLS_BEGIN not in (content or "") and all(m not in (content or "") for m in (CALL_BEGIN, SEP))
    complete = [c for c in parse_tool_calls(text)[1] if c.complete and c.name]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (c.name, c.arguments) for c in complete]
    stream, sent = ToolCallStream(), []
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    for i, (a, b) in enumerate(zip(bounds, bounds[1:] + [len(text)])):
        sent += stream.feed(text[a:b], final=i == len(bounds) - 1)[1]
    assert [(d["function"]["name"], d["function"]["arguments"]) for d in sent] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_a_constraint_slower_than_the_time_limit_is_a_400():
    import asyncio
    import time

    from deepinfer.server.errors import APIError
    from deepinfer.server.structured import check_spec
    from deepinfer.structured import StructuredOutputsParams

    class SlowChecker:  # the real checker kills the compile at the limit: test_grammar_hardening.py
        async def check(self, spec, timeout_s):
            await asyncio.wait_for(asyncio.sleep(1.0), timeout_s)

    started = time.monotonic()
    with pytest.raises(APIError) as err:
        asyncio.run(check_spec(StructuredOutputsParams(regex="a+"), SlowChecker(), 0.05))
    assert err.value.status == 400 and "did not compile within 0.05 s" in err.value.message
    assert time.monotonic() - started < 0.5
