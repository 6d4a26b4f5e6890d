"""`/v1/responses` (OpenAI Responses API) through the real server process (bundled model, which has DeepSeek's
tool-call tokens and a thinking mode) and the official `openai` client, streaming and not; plus the pure parts
(input items -> chat messages, the event builder, the bounded store) without a server.

Greedy requests (temperature 0, ignore_eos) make a Responses answer comparable with the chat answer for the
same conversation, and a streamed answer with a non-streamed one.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from test_server import _wait_for, metrics, running_server

from deepinfer.llm import default_model_path
from deepinfer.server.errors import APIError
from deepinfer.server.responses import ResponseDraft, ResponseStore, assistant_turn, input_messages

MODEL = "m"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "add", "description": "Add two numbers", "parameters": ADD},
         {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
SCHEMAS = {"add": ADD, "get_weather": WEATHER}
FORCED_MAX_TOKENS = 120  # fits the worst case of one forced call of either schema


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("responses-server") / "server.log"
    with running_server(default_model_path(), log, "--served-model-name", MODEL) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _collect(stream) -> tuple[list, object]:
    """The events of a stream, checked against the Responses event grammar; (events, final response)."""
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete", "response.failed")
    assert sum(e.type.startswith(("response.completed", "response.incomplete", "response.failed")) for e in events) == 1
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
    added, done, texts = {}, {}, {}
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert e.output_index == len(added) and e.output_index not in done
            assert all(i in done for i in added), "an item starts only once the previous one is done"
            added[e.output_index] = e.item
        elif e.type == "response.output_item.done":
            assert e.output_index in added and e.item.id == added[e.output_index].id
            done[e.output_index] = e.item
        elif e.type.endswith(".delta"):
            assert e.output_index in added and e.output_index not in done
            texts[e.output_index] = texts.get(e.output_index, "") + e.delta
        elif e.type in ("response.output_text.done", "response.reasoning_summary_text.done"):
            assert e.text == texts.get(e.output_index, "")
        elif e.type == "response.function_call_arguments.done":
            assert e.arguments == texts.get(e.output_index, "")
    assert added.keys() == done.keys()
    final = last.response
    assert [i.id for i in final.output] == [done[i].id for i in sorted(done)]
    return events, final


def _items(response) -> list[dict]:
    """Output items without their ids (they differ between two responses); call ids dropped too."""
    return [{k: v for k, v in item.model_dump(exclude_none=True).items() if k not in ("id", "call_id")}
            for item in response.output]


# --- text, instructions, streaming -----------------------------------------------------------------
def test_text_input(client):
    r = client.responses.create(model=MODEL, input="Hello, who are you?", max_output_tokens=16, **GREEDY)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert isinstance(r.output_text, str) and r.output_text == r.output[0].content[0].text
    assert r.usage.output_tokens == 16 and r.usage.total_tokens == r.usage.input_tokens + 16
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello, who are you?"}],
                                          max_tokens=16, **GREEDY)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_stream_events_concatenate_to_the_non_stream_answer(client):
    body = dict(model=MODEL, input="Tell me about Paris", max_output_tokens=24, **GREEDY)
    whole = client.responses.create(**body)
    events, final = _collect(client.responses.create(stream=True, **body))
    assert [e.type for e in events[2:5]] == ["response.output_item.added", "response.content_part.added",
                                            "response.output_text.delta"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == final.output_text
    assert events[-1].type == "response.incomplete" and final.status == whole.status == "incomplete"
    assert _items(final) == _items(whole) and final.usage == whole.usage
    with client.responses.stream(**body) as stream:  # the client's own accumulator accepts the stream
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert text == whole.output_text


def test_instructions_are_a_system_message(client, server):
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, **GREEDY)
    told = client.responses.create(model=MODEL, input="Hi", instructions="Answer in French.", max_output_tokens=4,
                                   **GREEDY)
    messages = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    count = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["count"]
    assert told.usage.input_tokens == count > plain.usage.input_tokens
    assert told.instructions == "Answer in French."
    developer = client.responses.create(model=MODEL, input=[{"role": "developer", "content": "Answer in French."},
                                                            {"role": "user", "content": "Hi"}],
                                        max_output_tokens=4, **GREEDY)
    assert developer.usage.input_tokens == count and developer.output_text == told.output_text


# --- tools -----------------------------------------------------------------------------------------
def _check_call(item) -> None:
    assert item.type == "function_call" and item.status == "completed" and item.call_id.startswith("call_")
    jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])


def test_tool_choice_required_gives_a_valid_function_call(client):
    for i, question in enumerate(["Add 2 and 3", "Weather in Paris?"]):
        r = client.responses.create(model=MODEL, input=question, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=FORCED_MAX_TOKENS,
                                    temperature=0.7, extra_body={"seed": i})
        assert r.status == "completed" and [o.type for o in r.output] == ["function_call"], r.output
        _check_call(r.output[0])
        assert r.output_text == ""
    named = client.responses.create(model=MODEL, input="Weather?", tools=TOOLS, max_output_tokens=FORCED_MAX_TOKENS,
                                    tool_choice={"type": "function", "name": "get_weather"})
    assert named.output[0].name == "get_weather" and named.tool_choice.name == "get_weather"
    _check_call(named.output[0])


def test_streamed_function_call(client):
    body = dict(model=MODEL, input="Add 2 and 3", tools=TOOLS, tool_choice={"type": "function", "name": "add"},
                max_output_tokens=FORCED_MAX_TOKENS, temperature=0)
    whole = client.responses.create(**body)
    events, final = _collect(client.responses.create(stream=True, **body))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert final.status == "completed" and _items(final) == _items(whole)
    _check_call(final.output[0])


def test_function_call_round_trip(client):
    """A function_call + function_call_output history is the chat's assistant tool call + tool message."""
    call = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'}
    items = [{"role": "user", "content": "Add 2 and 3"}, call,
             {"type": "function_call_output", "call_id": "call_1", "output": "5"}]
    r = client.responses.create(model=MODEL, input=items, tools=TOOLS, max_output_tokens=12, **GREEDY)
    messages = [{"role": "user", "content": "Add 2 and 3"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": call["arguments"]}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS, max_tokens=12, **GREEDY)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == (chat.choices[0].message.content or "")


# --- structured outputs ----------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}


def test_json_schema_text_format(client):
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}
    for stream in (False, True):
        body = dict(model=MODEL, input="Give me JSON", text=fmt, max_output_tokens=48, temperature=0.5,
                    extra_body={"seed": 1})
        r = _collect(client.responses.create(stream=True, **body))[1] if stream else client.responses.create(**body)
        assert r.status == "completed" and r.text.format.type == "json_schema"
        jsonschema.validate(json.loads(r.output_text), SCHEMA)


class Answer(BaseModel):
    ok: bool
    n: int


def test_responses_parse_with_a_pydantic_format(client):
    r = client.responses.parse(model=MODEL, input="Give me JSON", text_format=Answer, max_output_tokens=48)
    assert isinstance(r.output_parsed, Answer)


# --- reasoning -------------------------------------------------------------------------------------
def test_reasoning_summary_is_the_thinking_text(client):
    body = dict(model=MODEL, input="hi", reasoning={"effort": "low", "summary": "auto"}, max_output_tokens=24,
                **GREEDY)
    r = client.responses.create(**body)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=24,
                                          temperature=0, extra_body={"ignore_eos": True,
                                                                     "chat_template_kwargs": {"thinking": True}})
    thought = chat.choices[0].message.model_extra["reasoning_content"]
    assert thought and r.output[0].type == "reasoning" and r.output[0].summary[0].text == thought
    assert r.output_text == (chat.choices[0].message.content or "")
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens
    events, final = _collect(client.responses.create(stream=True, **body))
    summary = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    assert summary == thought and _items(final) == _items(r)
    assert "response.reasoning_summary_part.added" in [e.type for e in events]
    off = client.responses.create(model=MODEL, input="hi", reasoning={"effort": "none"}, max_output_tokens=4)
    assert [o.type for o in off.output] == ["message"]


# --- limits and errors -----------------------------------------------------------------------------
def test_max_output_tokens_makes_the_response_incomplete(client):
    r = client.responses.create(model=MODEL, input="Count to one hundred", max_output_tokens=5, **GREEDY)
    assert (r.status, r.incomplete_details.reason, r.usage.output_tokens) == ("incomplete", "max_output_tokens", 5)
    assert r.output[0].status == "incomplete"
    events, final = _collect(client.responses.create(model=MODEL, input="Count to one hundred", max_output_tokens=5,
                                                     stream=True, **GREEDY))
    assert events[-1].type == "response.incomplete" and final.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"max_output_tokens": 10**8}, "max_output_tokens"),
    ({"max_output_tokens": "8"}, "max_output_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"input": []}, "input"),
    ({"input": [{"type": "computer_call"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"metadata": {"k": "v" * 600}}, "metadata"),
])
def test_unsupported_or_bad_fields_are_400s(server, extra, param):
    resp = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": "hi", **extra}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"], error


def test_errors_reach_the_client_typed(client):
    with pytest.raises(openai.BadRequestError, match="only function tools"):
        client.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other", input="hi")


# --- previous_response_id and the store ------------------------------------------------------------
def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, input="Add 2 and 3", tools=TOOLS, max_output_tokens=FORCED_MAX_TOKENS,
                                    tool_choice={"type": "function", "name": "add"}, temperature=0)
    call = first.output[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
    chained = client.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=TOOLS,
                                      max_output_tokens=10, **GREEDY)
    assert chained.previous_response_id == first.id
    explicit = client.responses.create(model=MODEL, input=[
        {"role": "user", "content": "Add 2 and 3"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        result], tools=TOOLS, max_output_tokens=10, **GREEDY)
    assert chained.usage.input_tokens == explicit.usage.input_tokens
    assert chained.output_text == explicit.output_text
    echoed = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Add 2 and 3"}, *first.output,
                                                         result], tools=TOOLS, max_output_tokens=10, **GREEDY)
    assert echoed.usage.input_tokens == explicit.usage.input_tokens  # output items are valid input items
    third = client.responses.create(model=MODEL, previous_response_id=chained.id, input="And 4 + 4?", tools=TOOLS,
                                    max_output_tokens=4, **GREEDY)
    whole = client.responses.create(model=MODEL, input=[
        {"role": "user", "content": "Add 2 and 3"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        result, {"role": "assistant", "content": chained.output_text}, {"role": "user", "content": "And 4 + 4?"}],
        tools=TOOLS, max_output_tokens=4, **GREEDY)
    assert third.usage.input_tokens == whole.usage.input_tokens and third.output_text == whole.output_text
    # instructions are not carried over (as at OpenAI)
    told = client.responses.create(model=MODEL, input="Hi", instructions="Be brief.", max_output_tokens=2, **GREEDY)
    after = client.responses.create(model=MODEL, previous_response_id=told.id, input="Again", max_output_tokens=2,
                                    **GREEDY)
    again = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Hi"},
                                                        {"role": "assistant", "content": told.output_text},
                                                        {"role": "user", "content": "Again"}], max_output_tokens=2,
                                    **GREEDY)
    assert after.usage.input_tokens == again.usage.input_tokens


def test_streamed_responses_are_stored_and_store_false_is_not(client):
    _, final = _collect(client.responses.create(model=MODEL, input="hi", max_output_tokens=3, stream=True, **GREEDY))
    assert client.responses.retrieve(final.id).output_text == final.output_text
    client.responses.delete(final.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(final.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model=MODEL, previous_response_id=final.id, input="hi", max_output_tokens=1)
    unstored = client.responses.create(model=MODEL, input="hi", max_output_tokens=1, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_stored_response_echoing_a_lone_surrogate_is_retrievable(server):
    """Echoed metadata holds text UTF-8 cannot encode (sent as a JSON escape; the openai client cannot send
    it; prompts holding it are 400s): GET answers ASCII JSON, as POST does."""
    body = json.dumps({"model": MODEL, "input": "hi", "metadata": {"k": "a\ud800b"}, "max_output_tokens": 1})
    made = httpx.post(server.url + "/v1/responses", content=body, headers={"content-type": "application/json"},
                      timeout=120)
    assert made.status_code == 200, made.text
    assert made.json()["metadata"] == {"k": "a\ud800b"}
    got = httpx.get(server.url + f"/v1/responses/{made.json()['id']}", timeout=30)
    assert got.status_code == 200 and got.json()["metadata"] == {"k": "a\ud800b"}


# --- disconnects ----------------------------------------------------------------------------------
def _idle(server) -> bool:
    m = metrics(server.url)
    return m["deepinfer:num_requests_running"] + m["deepinfer:num_requests_waiting"] == 0


def test_disconnect_aborts_the_generation(server):
    """A client that leaves (streaming or not) ends its engine request: nothing keeps running for nobody."""
    body = {"model": MODEL, "input": "hello", "max_output_tokens": 1000, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", server.url + "/v1/responses",
                                                       json={**body, "stream": True}) as resp:
        lines = resp.iter_lines()
        assert resp.status_code == 200
        while "response.output_text.delta" not in next(lines):
            pass
    _wait_for(lambda: _idle(server), 2.0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/responses", json=body, timeout=httpx.Timeout(10, read=0.5))
    _wait_for(lambda: _idle(server), 2.0)


# --- without a server --------------------------------------------------------------------------------
def test_input_items_become_chat_messages():
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add "},
                                                               {"type": "input_text", "text": "1 and 2"}]},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "use add"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
             {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "3"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "3"}]}]
    calls = [{"id": c, "type": "function", "function": {"name": "add", "arguments": "{}"}} for c in ("c1", "c2")]
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 1 and 2"},
        {"role": "assistant", "content": "Sure.", "reasoning_content": "use add", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}, {"role": "tool", "tool_call_id": "c2", "content": "3"}]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    for bad in ([], [{"type": "item_reference", "id": "x"}], [{"role": "user", "content": 3}], [{"type": 7}]):
        with pytest.raises(APIError) as e:
            input_messages(bad)
        assert e.value.status == 400 and e.value.param == "input"


def test_a_reasoning_item_opens_the_assistant_turn_after_it():
    call = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"}
    said = {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]}
    think = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "use add"}]}
    messages = input_messages([{"role": "user", "content": "hi"}, said, {"role": "user", "content": "add"},
                               said, think, call])
    assert [m.get("reasoning_content") for m in messages] == [None, None, None, None, "use add"]
    assert "tool_calls" not in messages[3] and messages[4]["tool_calls"][0]["id"] == "c1"
    # reasoning of a turn with no output reaches no later turn
    messages = input_messages([{"role": "user", "content": "a"}, think, {"role": "user", "content": "b"}, said])
    assert [m.get("reasoning_content") for m in messages] == [None, None, None]
    messages = input_messages([think, think, call, {**call, "call_id": "c2"}])  # one turn: joined, both calls
    assert len(messages) == 1 and messages[0]["reasoning_content"] == "use adduse add"
    assert [c["id"] for c in messages[0]["tool_calls"]] == ["c1", "c2"]
    # reasoning before each of one turn's parallel calls: still one turn, its results after it
    result = {"type": "function_call_output", "call_id": "c1", "output": "3"}
    messages = input_messages([{"role": "user", "content": "a"}, think, call, think, {**call, "call_id": "c2"},
                               result, {**result, "call_id": "c2"}])
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[1]["reasoning_content"] == "use adduse add"


def _draft(stream: bool) -> ResponseDraft:
    return ResponseDraft({"id": "resp_x", "output": []}, stream)


def _chunk(**delta) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


@settings(max_examples=60, deadline=None)
@given(reasoning=st.text(max_size=12), content=st.text(max_size=12), ncalls=st.integers(0, 2),
       finish=st.sampled_from(["stop", "length", "tool_calls"]), cuts=st.lists(st.integers(1, 5), max_size=8),
       after=st.sampled_from(["", "ab", "x"]))
def test_streamed_items_equal_the_whole_message_items(reasoning, content, ncalls, finish, cuts, after):
    """Any cutting of the deltas gives the items of the whole message, in its order (reasoning, message,
    calls) even when content follows a call; the events follow the grammar."""
    after = after if ncalls == 2 else after[:1] if ncalls else ""  # after[i::2] over the calls spells it
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "add", "arguments": '{"a":1}'}}
             for i in range(ncalls)]
    whole = _draft(False)
    whole.chat_message({"reasoning_content": reasoning, "content": content + after, "tool_calls": calls})
    whole.finish_reason = finish
    streamed = _draft(True)
    streamed.opening()
    for text, key in ((reasoning, "reasoning_content"), (content, "content")):
        start = 0
        for cut in [*cuts, len(text)]:
            streamed.chat_chunk(_chunk(**{key: text[start:start + cut]}))
            start += cut
        streamed.chat_chunk(_chunk(**{key: text[start:]}))
    for i, call in enumerate(calls):
        streamed.chat_chunk(_chunk(tool_calls=[{"index": i, **call}]))
        streamed.chat_chunk(_chunk(content=after[i::2]))  # text between and after the calls (DSML allows it)
    streamed.chat_chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})
    a, b = whole.finish(), streamed.finish()
    strip = lambda items: [{k: v for k, v in i.items() if k != "id"} for i in items]
    assert strip(a["output"]) == strip(b["output"])
    assert a["status"] == b["status"] == ("incomplete" if finish == "length" else "completed")
    assert any(i["type"] in ("message", "function_call") for i in a["output"])
    events = [json.loads(e.split("data: ", 1)[1]) for e in streamed.take().split("\n\n") if e]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    opened = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    closed = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert opened == closed == list(range(len(b["output"])))
    kinds = [i["type"] for i in b["output"]]
    assert kinds == sorted(kinds, key=["reasoning", "message", "function_call"].index)
    assert b["usage"]["output_tokens"] == 4 and events[-1]["type"] == f"response.{b['status']}"


def test_a_chat_error_fails_the_streamed_response():
    draft = _draft(True)
    draft.opening()
    draft.chat_chunk(_chunk(content="partial"))
    draft.chat_chunk({"error": {"message": "the engine died", "type": "server_error", "param": None,
                                "code": "engine_dead"}})
    response = draft.finish()
    events = [json.loads(e.split("data: ", 1)[1]) for e in draft.take().split("\n\n") if e]
    assert [e["type"] for e in events[-2:]] == ["response.output_item.done", "response.failed"]
    assert "error" in [e["type"] for e in events]
    assert response["status"] == "failed" and response["error"]["code"] == "engine_dead"
    assert response["output"][0]["status"] == "incomplete"


def test_store_is_bounded_lru_and_per_key():
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    resp = lambda i: {"id": f"resp_{i}", "output": []}
    for i in range(3):
        assert store.put("alice", resp(i), [{"role": "user", "content": str(i)}])
    assert len(store) == 2 and store.get("alice", "resp_0") is None  # evicted
    assert store.get("bob", "resp_1") is None and not store.delete("bob", "resp_1")  # another key sees nothing
    assert store.get("alice", "resp_1") is not None  # now most recently used
    store.put("alice", resp(3), [])
    assert store.get("alice", "resp_2") is None and store.get("alice", "resp_1") is not None
    assert not store.put("alice", resp(4), [{"role": "user", "content": "x" * 20_000}])  # alone over the byte bound
    small = ResponseStore(max_entries=100, max_bytes=300)
    for i in range(10):
        small.put(None, resp(i), [{"role": "user", "content": "y" * 50}])
    assert small.bytes <= 300 and 0 < len(small) < 10
    assert not ResponseStore(max_entries=0).enabled


def test_one_key_evicts_its_own_responses_before_anyone_elses():
    store = ResponseStore(max_entries=4, max_bytes=10_000)
    resp = lambda i: {"id": f"resp_{i}", "output": []}
    store.put("bob", resp("b0"), [])
    for i in range(20):  # alice floods the store
        assert store.put("alice", resp(i), [])
    assert store.get("bob", "resp_b0") is not None and store.held("alice") == 3 and len(store) == 4
    assert store.get("alice", "resp_19") is not None and store.get("alice", "resp_16") is None
    small = ResponseStore(max_entries=100, max_bytes=400)
    small.put("bob", resp("b1"), [{"role": "user", "content": "b" * 50}])
    for i in range(10):
        small.put("alice", resp(i), [{"role": "user", "content": "a" * 50}])
    assert small.bytes <= 400 and small.get("bob", "resp_b1") is not None and small.held("alice") >= 1
    assert small.delete("bob", "resp_b1") and small.held("bob") == 0 and small.bytes == sum(
        e.size for e in small._tenants["alice"].values())


def test_the_response_being_stored_is_kept():
    store = ResponseStore(max_entries=100, max_bytes=600)
    for i in range(3):
        store.put("A", {"id": f"a{i}", "x": "y" * 100}, [])
    assert store.put("B", {"id": "b0", "x": "z" * 400}, [])
    assert store.get("B", "b0") is not None and store.bytes <= 600 and store.get("A", "a0") is None
    store.put("B", {"id": "b1", "x": "z" * 400}, [])  # B's own older response goes first
    assert store.get("B", "b1") is not None and store.get("B", "b0") is None and store.held("A") >= 1
    one = ResponseStore(max_entries=1)
    one.put("A", {"id": "a"}, [])
    assert one.put("B", {"id": "b"}, []) and one.get("B", "b") is not None and len(one) == 1


def test_store_bounds_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("DEEPINFER_RESPONSES_STORE_ENTRIES", "5")
    monkeypatch.setenv("DEEPINFER_RESPONSES_STORE_BYTES", "1234")
    store = ResponseStore.from_env()
    assert (store.max_entries, store.max_bytes) == (5, 1234)
    monkeypatch.setenv("DEEPINFER_RESPONSES_STORE_ENTRIES", "many")
    with pytest.raises(ValueError, match="non-negative integer"):
        ResponseStore.from_env()


def test_assistant_turn_of_an_output():
    output = [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
              {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]
    assert assistant_turn(output) == {"role": "assistant", "content": None, "reasoning_content": "think",
                                      "tool_calls": [{"id": "c", "type": "function",
                                                      "function": {"name": "f", "arguments": "{}"}}]}


def test_reasoning_effort_reaches_the_template_as_reasoning_effort():
    from deepinfer.server.responses import template_kwargs
    from deepinfer.server.responses_protocol import ResponsesRequest

    def kwargs(reasoning, extra=None):
        return template_kwargs(ResponsesRequest(model=MODEL, input="hi", reasoning=reasoning,
                                                chat_template_kwargs=extra))

    assert kwargs({"effort": "medium"}) == {"thinking": True, "enable_thinking": True, "reasoning_effort": "high"}
    assert kwargs({"effort": "minimal"})["reasoning_effort"] == "low"
    assert kwargs({"effort": "none"}) == {"thinking": False, "enable_thinking": False}
    assert kwargs({}) == {"thinking": True, "enable_thinking": True}
    assert kwargs(None) == {"thinking": False, "enable_thinking": False}  # V4.1 would think by default
    assert kwargs(None, {"thinking": True})["thinking"] is True
    assert kwargs({"effort": "max"}, {"reasoning_effort": 60})["reasoning_effort"] == 60  # explicit kwargs win
    with pytest.raises(APIError, match="reasoning.effort"):
        kwargs({"effort": "extreme"})
