"""The OpenAI Responses API: `POST /v1/responses`, `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`.

A request is translated into the server's chat request (ChatCompletionRequest) and answered by
`Serving.chat`, so prompt rendering, tools and forced calls, structured outputs, the reasoning split,
admission, limits and the abort on disconnect are the chat endpoint's own. Its answer is translated back:
the chat body into a Response object, the chat SSE chunks into the Responses event stream (`event:` +
`data:` lines, each event with its `sequence_number`, no `[DONE]`).

Input: a string (one user message) or items: messages (roles user / system / developer / assistant, text
parts only), `function_call`, `function_call_output` and `reasoning` items. Output items: `reasoning` (the
thinking text as one summary part; DeepSeek thinking mode, on when `reasoning` is given with an effort other
than "none"), `message` (one `output_text` part) and `function_call` items.

`store` (default true, as at OpenAI) keeps a finished response in memory, in a bounded LRU (ResponseStore:
DEEPINFER_RESPONSES_STORE_ENTRIES, default 1000, 0 turns storing off; DEEPINFER_RESPONSES_STORE_BYTES, default
256 MiB), so `previous_response_id` can continue its conversation and GET / DELETE can find it. A stored
response belongs to the API key that created it (with API keys configured): others get a 404 / 400 as for an
unknown id; over a bound the key holding the most loses its least recently used response. The store does
not survive a restart, and an evicted response is as unknown as a deleted one.

Invariants:
- streamed and non-streamed output items are built by the same code (ResponseDraft) from the same deltas
  (the non-streamed chat message is replayed as one reasoning, one content and its call deltas), so a stream's
  completed items equal the non-streamed ones of the same generation (ids aside), in one order: the reasoning,
  the message (all of the content, text written after a call included), then the function calls (a streamed
  call's events come when the generation ends, as the whole message's calls do);
- every streamed event carries sequence_number 0, 1, 2, ... in order; the stream starts with
  response.created and response.in_progress and ends with exactly one of response.completed,
  response.incomplete and response.failed (after an `error` event), and every item added is done before it;
- a stored conversation is never modified: a new turn copies its history and appends to the copy.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from deepinfer.server import schemas
from deepinfer.server.errors import APIError, bad_request
from deepinfer.server.protocol import ChatCompletionRequest
from deepinfer.server.responses_protocol import (
    DeletedResponse,
    FunctionCallInput,
    FunctionCallOutputInput,
    FunctionTool,
    InputMessage,
    ReasoningInput,
    ResponseObject,
    ResponsesRequest,
)
from deepinfer.server.serving import Serving, encode_text

STORE_ENTRIES_ENV, STORE_BYTES_ENV = "DEEPINFER_RESPONSES_STORE_ENTRIES", "DEEPINFER_RESPONSES_STORE_BYTES"
DEFAULT_STORE_ENTRIES, DEFAULT_STORE_BYTES = 1000, 256 * 2**20
SUPPORTED_INCLUDE = ("reasoning.encrypted_content",)  # accepted; reasoning is returned as text, never encrypted
MAX_METADATA = 16  # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512
_EXTENSIONS = ("top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "ignore_eos", "min_tokens", "priority", "cache_salt", "user")
# chat request fields -> the Responses request field a client sent
_PARAMS = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens",
           "max_completion_tokens": "max_output_tokens", "response_format": "text"}
_TOKEN_LIMIT_WORDS = re.compile(r"\bmax_(completion_)?tokens\b")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _dumps(value: Any) -> str:
    """ASCII JSON: echoed client strings may hold lone surrogates, which UTF-8 cannot encode."""
    return json.dumps(value, separators=(",", ":"))


# --- the request -> a chat request ---------------------------------------------------------------
def check_supported(body: ResponsesRequest) -> None:
    """400 for what this server does not do, naming the field (rather than silently ignoring it)."""
    if body.background:
        raise bad_request("background responses are not supported; send the request without background",
                          param="background")
    if body.conversation is not None:
        raise bad_request("conversations are not supported; use previous_response_id or send the whole input",
                          param="conversation")
    if body.prompt is not None:
        raise bad_request("prompt templates are not supported; send input (and instructions)", param="prompt")
    for value in body.include or ():
        if value not in SUPPORTED_INCLUDE:
            raise bad_request(f"include {value!r} is not supported (supported: {', '.join(SUPPORTED_INCLUDE)})",
                              param="include")
    if body.truncation not in (None, "disabled"):
        raise bad_request(f"truncation {body.truncation!r} is not supported: an input longer than the context is "
                          "a 400 (truncation 'disabled')", param="truncation")
    if body.top_logprobs:
        raise bad_request("logprobs are not supported on /v1/responses (use /v1/chat/completions)",
                          param="top_logprobs")
    if body.max_tool_calls is not None:
        raise bad_request("max_tool_calls is not supported (parallel_tool_calls false allows one call)",
                          param="max_tool_calls")
    if body.context_management:
        raise bad_request("context_management is not supported", param="context_management")
    _check_metadata(body.metadata)


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA:
        raise bad_request(f"metadata holds at most {MAX_METADATA} pairs, got {len(metadata)}", param="metadata")
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise bad_request("metadata keys are at most 64 characters and values at most 512", param="metadata")


def _validation_message(where: str, e: ValidationError) -> str:
    first = e.errors()[0]
    path = ".".join(str(p) for p in first.get("loc", ()))
    return f"{where}{'.' + path if path else ''}: {first.get('msg')}"


def _text_of(parts: str | list[dict[str, Any]], where: str) -> str:
    """A content's text: a string, or text parts (input_text / output_text / text, refusal) joined."""
    if isinstance(parts, str):
        return parts
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type")
        key = "refusal" if kind == "refusal" else "text"
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise bad_request(f"{where}.content[{j}]: only text content is supported, got type {kind!r}",
                              param="input")
        if not isinstance(part.get(key), str):
            raise bad_request(f"{where}.content[{j}].{key} must be a string", param="input")
        texts.append(part[key])
    return "".join(texts)


_ITEMS: dict[str, type[BaseModel]] = {"message": InputMessage, "function_call": FunctionCallInput,
                                      "function_call_output": FunctionCallOutputInput, "reasoning": ReasoningInput}


def _parse_item(i: int, raw: dict[str, Any]) -> BaseModel:
    kind = raw.get("type", "message")
    if kind == "item_reference":
        raise bad_request(f"input[{i}]: item_reference is not supported; send the item itself, or continue a "
                          "stored response with previous_response_id", param="input")
    model = _ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise bad_request(f"input[{i}]: items of type {kind!r} are not supported (message, function_call, "
                          "function_call_output and reasoning are)", param="input")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise bad_request(_validation_message(f"input[{i}]", e), param="input") from None


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: a function_call_output is a tool message; a function call joins the
    assistant message before it (its text, earlier calls); a reasoning item opens the next assistant turn
    (its message or calls) and is that turn's reasoning_content, except between the calls of one turn
    (right after a call), where it is more of that turn's reasoning. Reasoning followed by no assistant
    item belongs to no turn of the prompt and is dropped."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise bad_request("input must not be empty", param="input")
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None  # pending: the next assistant item starts a turn of its own
    for i, raw in enumerate(value):
        item, where = _parse_item(i, raw), f"input[{i}]"
        if isinstance(item, ReasoningInput):
            text = "".join(_reasoning_texts(item, where))
            if reasoning is None and _calling(messages):  # between one turn's calls: still that turn
                messages[-1]["reasoning_content"] = (messages[-1].get("reasoning_content") or "") + text
            else:
                reasoning = (reasoning or "") + text
            continue
        message = _item_message(item, where)
        if message["role"] != "assistant":
            reasoning = None
        elif reasoning is not None:
            message["reasoning_content"], reasoning = reasoning, None
        elif "tool_calls" in message and messages and messages[-1]["role"] == "assistant":
            messages[-1].setdefault("tool_calls", []).extend(message["tool_calls"])
            continue
        messages.append(message)
    return messages


def _calling(messages: list[dict[str, Any]]) -> bool:
    """The last message is an assistant turn with calls and no results yet (the turn is not over)."""
    return bool(messages) and messages[-1]["role"] == "assistant" and bool(messages[-1].get("tool_calls"))


def _item_message(item: BaseModel, where: str) -> dict[str, Any]:
    if isinstance(item, FunctionCallOutputInput):
        return {"role": "tool", "tool_call_id": item.call_id, "content": _text_of(item.output, where)}
    if isinstance(item, FunctionCallInput):
        call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    return {"role": "system" if item.role == "developer" else item.role, "content": _text_of(item.content, where)}


def _reasoning_texts(item: ReasoningInput, where: str) -> list[str]:
    parts = item.content if item.content else item.summary
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}: reasoning parts need a string text (part {j})", param="input")
        texts.append(part["text"])
    return texts


def function_tools(tools: list[dict[str, Any]] | None) -> list[FunctionTool]:
    checked = []
    for i, raw in enumerate(tools or ()):
        if raw.get("type") != "function":
            raise bad_request(f"tools[{i}]: only function tools are supported, got type {raw.get('type')!r} "
                              "(built-in tools such as web_search or file_search are not)", param="tools")
        try:
            checked.append(FunctionTool.model_validate(raw))
        except ValidationError as e:
            raise bad_request(_validation_message(f"tools[{i}]", e), param="tools") from None
    return checked


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """auto | none | required pass as they are (the chat checks them); {"type": "function", "name": ...} is
    the chat's {"type": "function", "function": {"name": ...}}."""
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind != "function":
        raise bad_request(f"tool_choice of type {kind!r} is not supported: give auto, none, required or "
                          "{'type': 'function', 'name': ...}", param="tool_choice")
    if not isinstance(choice.get("name"), str):
        raise bad_request("tool_choice {'type': 'function'} needs the function's name", param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise bad_request("text.format.schema is required for type json_schema", param="text")
        spec = {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}
    raise bad_request(f"text.format.type must be text, json_object or json_schema, got {fmt.type!r}", param="text")


# OpenAI's effort names -> the chat template's reasoning_effort (V4.1's levels; medium is its default, high)
EFFORTS = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "xhigh", "max": "max"}


def template_kwargs(body: ResponsesRequest) -> dict[str, Any] | None:
    """Thinking is on only with `reasoning` (effort "none": off), whose effort goes on as reasoning_effort
    (which V4.1's template renders and V4's reads for "max"); explicit chat_template_kwargs win."""
    kwargs: dict[str, Any] = {"thinking": False, "enable_thinking": False}  # as documented (V4.1 would think)
    if body.reasoning is not None:
        effort = body.reasoning.effort
        on = effort != "none"
        kwargs = {"thinking": on, "enable_thinking": on}
        if on and effort is not None:
            if effort not in EFFORTS:
                raise bad_request(f"reasoning.effort must be none or one of {', '.join(EFFORTS)}, got {effort!r}",
                                  param="reasoning.effort")
            kwargs["reasoning_effort"] = EFFORTS[effort]
    kwargs.update(body.chat_template_kwargs or {})
    return kwargs


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]],
                 tools: list[FunctionTool]) -> ChatCompletionRequest:
    payload: dict[str, Any] = {"model": body.model, "messages": messages, "stream": bool(body.stream)}
    if body.stream:
        payload["stream_options"] = {"include_usage": True}
    optional = {"max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
                "top_p": body.top_p, "tool_choice": chat_tool_choice(body.tool_choice),
                "parallel_tool_calls": body.parallel_tool_calls, "response_format": response_format(body),
                "chat_template_kwargs": template_kwargs(body),
                "tools": [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                          for t in tools] or None,
                **{name: getattr(body, name) for name in _EXTENSIONS}}
    payload.update({k: v for k, v in optional.items() if v is not None})
    try:
        return ChatCompletionRequest.model_validate(payload)
    except ValidationError as e:
        field = str(e.errors()[0].get("loc", ("",))[0])
        raise bad_request(_validation_message("", e).lstrip(".: "), param=_PARAMS.get(field, field)) from None


def responses_error(e: APIError) -> APIError:
    """A chat error in the Responses request's terms (its field names)."""
    message = _TOKEN_LIMIT_WORDS.sub("max_output_tokens", e.message).replace("response_format", "text.format")
    return APIError(e.status, message, _PARAMS.get(e.param, e.param), e.code, e.headers)


# --- the response being built ----------------------------------------------------------------------
class ResponseDraft:
    """A response built from chat deltas (reasoning, content, whole tool calls), with the stream's events
    when `stream`. Items are opened by their first delta and done when another kind of item starts or the
    response finishes; function calls wait for the end (so content after a call stays in the one message)
    and are then added and done at once (the chat parsers send calls whole)."""

    def __init__(self, response: dict[str, Any], stream: bool):
        self.response, self.stream = response, stream
        self.output: list[dict[str, Any]] = response["output"]
        self.current: dict[str, Any] | None = None
        self.sequence = 0
        self.pending: list[str] = []  # SSE events not yet sent
        self.calls: list[tuple[str, str, str]] = []  # (call_id, name, arguments), added by finish
        self.finish_reason: str | None = None
        self.usage: dict[str, int] | None = None
        self.error: dict[str, Any] | None = None
        self.finished = False

    # events
    def emit(self, kind: str, **fields: Any) -> None:
        if self.stream:
            payload = _dumps({"type": kind, "sequence_number": self.sequence, **fields})
            self.pending.append(f"event: {kind}\ndata: {payload}\n\n")
            self.sequence += 1

    def take(self) -> str:
        events, self.pending = "".join(self.pending), []
        return events

    def opening(self) -> None:
        self.emit("response.created", response=self.response)
        self.emit("response.in_progress", response=self.response)

    # deltas
    def reasoning(self, text: str) -> None:
        if not text:
            return
        item = self.current
        if item is None or item["type"] != "reasoning":
            item = self._open({"id": _id("rs"), "type": "reasoning", "status": "in_progress", "summary": []})
            part = {"type": "summary_text", "text": ""}
            self.emit("response.reasoning_summary_part.added", item_id=item["id"], output_index=self._index,
                      summary_index=0, part=part)
            item["summary"].append(dict(part))
        item["summary"][0]["text"] += text
        self.emit("response.reasoning_summary_text.delta", item_id=item["id"], output_index=self._index,
                  summary_index=0, delta=text)

    def content(self, text: str) -> None:
        if not text:
            return
        item = self.current
        if item is None or item["type"] != "message":
            item = self._open_message()
        item["content"][0]["text"] += text
        self.emit("response.output_text.delta", item_id=item["id"], output_index=self._index, content_index=0,
                  delta=text, logprobs=[])

    def call(self, call_id: str, name: str, arguments: str) -> None:
        self.calls.append((call_id, name, arguments))

    def _add_call(self, call_id: str, name: str, arguments: str) -> None:
        item = self._open({"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": call_id,
                           "name": name, "arguments": ""})
        if arguments:
            self.emit("response.function_call_arguments.delta", item_id=item["id"], output_index=self._index,
                      delta=arguments)
        item["arguments"] = arguments
        self._close("completed")

    def chat_message(self, message: dict[str, Any]) -> None:
        """A whole (non-streamed) chat message, as the stream would have delivered it."""
        self.reasoning(message.get("reasoning_content") or "")
        self.content(message.get("content") or "")
        for call in message.get("tool_calls") or ():
            self.call(call["id"], call["function"]["name"], call["function"]["arguments"])

    def chat_chunk(self, chunk: dict[str, Any]) -> None:
        if "error" in chunk:
            self.fail(chunk["error"])
            return
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            self.reasoning(delta.get("reasoning_content") or "")
            self.content(delta.get("content") or "")
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                self.call(call.get("id") or _id("call"), function.get("name") or "", function.get("arguments") or "")
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if chunk.get("usage"):
            self.usage = chunk["usage"]

    def fail(self, error: dict[str, Any]) -> None:
        if self.error is None:
            self.error = {"code": error.get("code") or "server_error", "message": error.get("message") or "failed"}
            self.emit("error", code=self.error["code"], message=self.error["message"], param=error.get("param"))

    # the end
    def finish(self, reasoning_tokens: int = 0) -> dict[str, Any]:
        """Closes the open item and the response; the final response object."""
        self.finished = True
        if self.error is None and self.finish_reason in ("abort", "error"):
            reason = "aborted (the server is shutting down)" if self.finish_reason == "abort" else "failed"
            self.fail({"code": "server_error", "message": f"the request was {reason}"})
        incomplete = self.error is None and self.finish_reason == "length"
        self._close("incomplete" if incomplete or self.error is not None else "completed")
        for call in self.calls:  # whole calls: completed even when the response is not
            self._add_call(*call)
        if self.error is None and not any(i["type"] in ("message", "function_call") for i in self.output):
            self._open_message()
            self._close("incomplete" if incomplete else "completed")
        status = "failed" if self.error is not None else "incomplete" if incomplete else "completed"
        self.response.update(status=status, completed_at=int(time.time()), error=self.error,
                             incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
                             usage=_usage(self.usage, reasoning_tokens))
        self.emit(f"response.{status}", response=self.response)
        return self.response

    # items
    @property
    def _index(self) -> int:
        return len(self.output) - 1

    def _open(self, item: dict[str, Any]) -> dict[str, Any]:
        self._close("completed")
        self.output.append(item)
        self.current = item
        self.emit("response.output_item.added", output_index=self._index, item=item)
        return item

    def _open_message(self) -> dict[str, Any]:
        item = self._open({"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                           "content": []})
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.emit("response.content_part.added", item_id=item["id"], output_index=self._index, content_index=0,
                  part=part)
        item["content"].append(dict(part))
        return item

    def _close(self, status: str) -> None:
        item, self.current = self.current, None
        if item is None:
            return
        item["status"] = status
        ids = {"item_id": item["id"], "output_index": self._index}
        if item["type"] == "reasoning":
            part = item["summary"][0]
            self.emit("response.reasoning_summary_text.done", **ids, summary_index=0, text=part["text"])
            self.emit("response.reasoning_summary_part.done", **ids, summary_index=0, part=part)
        elif item["type"] == "message":
            part = item["content"][0]
            self.emit("response.output_text.done", **ids, content_index=0, text=part["text"], logprobs=[])
            self.emit("response.content_part.done", **ids, content_index=0, part=part)
        else:
            self.emit("response.function_call_arguments.done", **ids, arguments=item["arguments"])
        self.emit("response.output_item.done", output_index=self._index, item=item)

    def reasoning_text(self) -> str:
        return "".join(i["summary"][0]["text"] for i in self.output if i["type"] == "reasoning" and i["summary"])


def _usage(usage: dict[str, int] | None, reasoning_tokens: int) -> dict[str, Any] | None:
    if usage is None:
        return None
    output = usage["completion_tokens"]
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0,
                                                                             "cache_write_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, output)},
            "total_tokens": usage["total_tokens"]}


def assistant_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as one assistant chat message (for the conversation that follows it)."""
    texts = [i["content"][0]["text"] for i in output if i["type"] == "message" and i["content"]]
    reasoning = [i["summary"][0]["text"] for i in output if i["type"] == "reasoning" and i["summary"]]
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or (None if calls else "")}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


# --- the store -------------------------------------------------------------------------------------
@dataclass
class Stored:
    response: dict[str, Any]
    history: list[dict[str, Any]]  # the conversation through this response (chat messages, no instructions)
    size: int


class ResponseStore:
    """Finished responses by id, bounded by count and by (JSON) size over all tenants (API keys). Over a
    bound, the tenant holding the most (responses, or bytes for the byte bound) loses its least recently used
    response: a tenant's traffic evicts its own responses first, and one holding at most its fair share
    (bound / tenants) is never evicted by another's; the response being stored is never the one evicted.
    Invariant: len <= max_entries and the sizes sum to <= max_bytes; each tenant's responses are in least
    recently used order."""

    def __init__(self, max_entries: int = DEFAULT_STORE_ENTRIES, max_bytes: int = DEFAULT_STORE_BYTES):
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("the response store's bounds must be >= 0")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._tenants: dict[str | None, OrderedDict[str, Stored]] = {}
        self._tenant_bytes: dict[str | None, int] = {}
        self.bytes = 0

    @classmethod
    def from_env(cls) -> ResponseStore:
        def read(name: str, default: int) -> int:
            value = os.environ.get(name, "").strip()
            if not value:
                return default
            if not value.isdigit():
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
            return int(value)

        return cls(read(STORE_ENTRIES_ENV, DEFAULT_STORE_ENTRIES), read(STORE_BYTES_ENV, DEFAULT_STORE_BYTES))

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return sum(map(len, self._tenants.values()))

    def held(self, tenant: str | None) -> int:
        """How many responses `tenant` has stored."""
        return len(self._tenants.get(tenant, ()))

    def put(self, tenant: str | None, response: dict[str, Any], history: list[dict[str, Any]]) -> bool:
        """Keeps the response (evicting as above); False when it alone exceeds the byte bound."""
        size = len(_dumps(response)) + len(_dumps(history))
        if not self.enabled or size > self.max_bytes:
            return False
        self.delete(tenant, response["id"])
        self._tenants.setdefault(tenant, OrderedDict())[response["id"]] = Stored(response, history, size)
        self._account(tenant, size)
        while len(self) > self.max_entries:
            self._evict(self._heaviest(tenant, self.held))
        while self.bytes > self.max_bytes:
            self._evict(self._heaviest(tenant, self._tenant_bytes.__getitem__))
        return True

    def _heaviest(self, putting: str | None, weight) -> str | None:
        """The tenant holding the most that has a response older than the one being put (which stays: it
        alone fits both bounds, so another always exists while a bound is exceeded)."""
        return max((t for t in self._tenants if t != putting or len(self._tenants[t]) > 1), key=weight)

    def get(self, tenant: str | None, response_id: str) -> Stored | None:
        entries = self._tenants.get(tenant)
        if entries is None or response_id not in entries:
            return None
        entries.move_to_end(response_id)
        return entries[response_id]

    def delete(self, tenant: str | None, response_id: str) -> bool:
        entry = self.get(tenant, response_id)
        if entry is None:
            return False
        self._remove(tenant, response_id)
        return True

    def _evict(self, tenant: str | None) -> None:
        self._remove(tenant, next(iter(self._tenants[tenant])))

    def _remove(self, tenant: str | None, response_id: str) -> None:
        entry = self._tenants[tenant].pop(response_id)
        self._account(tenant, -entry.size)
        if not self._tenants[tenant]:
            del self._tenants[tenant], self._tenant_bytes[tenant]

    def _account(self, tenant: str | None, size: int) -> None:
        self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + size
        self.bytes += size


# --- the endpoint ----------------------------------------------------------------------------------
class ResponsesAPI:
    def __init__(self, serving: Serving, store: ResponseStore):
        self.serving, self.store = serving, store

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        check_supported(body)
        tenant = getattr(request.state, "tenant", None)
        history = self._history(body.previous_response_id, tenant)
        conversation = history + input_messages(body.input)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        tools = function_tools(body.tools)
        req = chat_request(body, system + conversation, tools)
        store = body.store is not False and self.store.enabled
        draft = ResponseDraft(self._skeleton(body, tools, store), bool(body.stream))
        try:
            answer = await self.serving.chat(req, request)
        except APIError as e:
            raise responses_error(e) from None
        finish = lambda: self._finish(draft, conversation, tenant, store)
        if body.stream:
            return ResponsesStream(answer, draft, finish)
        if answer.status_code != 200:
            return answer  # 499: the client left
        chat = json.loads(answer.body)
        choice = chat["choices"][0]
        draft.chat_message(choice["message"])
        draft.finish_reason, draft.usage = choice["finish_reason"], chat.get("usage")
        return Response(_dumps(await finish()), media_type="application/json")

    def _history(self, previous_id: str | None, tenant: str | None) -> list[dict[str, Any]]:
        if previous_id is None:
            return []
        if not self.store.enabled:
            raise bad_request(f"this server keeps no responses ({STORE_ENTRIES_ENV}=0), so previous_response_id "
                              "cannot be used; send the whole conversation as input", param="previous_response_id")
        entry = self.store.get(tenant, previous_id)
        if entry is None:
            raise APIError(400, f"previous response with id {previous_id!r} not found (it was never stored, was "
                                "deleted, or was evicted from the in-memory store)", param="previous_response_id",
                           code="previous_response_not_found")
        return list(entry.history)

    def _skeleton(self, body: ResponsesRequest, tools: list[FunctionTool], store: bool) -> dict[str, Any]:
        reasoning = body.reasoning
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        return {"id": _id("resp"), "object": "response", "created_at": int(time.time()), "completed_at": None,
                "status": "in_progress", "error": None, "incomplete_details": None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "model": self.serving.settings.model_name, "output": [],
                "parallel_tool_calls": body.parallel_tool_calls is not False,
                "previous_response_id": body.previous_response_id,
                "reasoning": {"effort": reasoning.effort if reasoning else None,
                              "summary": (reasoning.summary or reasoning.generate_summary) if reasoning else None},
                "store": store, "background": False, "temperature": body.temperature, "top_p": body.top_p,
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
                "tool_choice": copy.deepcopy(body.tool_choice) if body.tool_choice is not None else "auto",
                "tools": [t.model_dump(exclude_none=True) for t in tools], "truncation": "disabled",
                "usage": None, "user": body.user, "metadata": dict(body.metadata or {})}

    async def _finish(self, draft: ResponseDraft, conversation: list[dict[str, Any]], tenant: str | None,
                      store: bool) -> dict[str, Any]:
        response = draft.finish(await self._reasoning_tokens(draft.reasoning_text()))
        if store and response["status"] != "failed":
            self.store.put(tenant, response, [*conversation, assistant_turn(response["output"])])
        return response

    async def _reasoning_tokens(self, text: str) -> int:
        """The reasoning text's token count, re-tokenised off the event loop."""
        tokenizer = self.serving.tokenizer
        if not text or tokenizer is None:
            return 0
        try:
            return len(await asyncio.to_thread(encode_text, tokenizer, text, False))
        except APIError:
            return 0

    def retrieve(self, response_id: str, request: Request) -> dict[str, Any]:
        entry = self.store.get(getattr(request.state, "tenant", None), response_id)
        if entry is None:
            raise _not_found(response_id)
        return entry.response

    def delete(self, response_id: str, request: Request) -> dict[str, Any]:
        if not self.store.delete(getattr(request.state, "tenant", None), response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no stored response has the id {response_id!r}", param="response_id")


class ResponsesStream(Response):
    """Runs the chat's SSE response (its admission release and stream closing stay its own) and rewrites what
    it sends: each chat chunk becomes Responses events; its `[DONE]` finishes the response."""

    def __init__(self, chat: Response, draft: ResponseDraft, finish):
        super().__init__(media_type="text/event-stream")
        self.chat, self.draft, self.finish = chat, draft, finish

    async def __call__(self, scope, receive, send) -> None:
        buffered = b""

        async def relay(message) -> None:
            nonlocal buffered
            if message["type"] != "http.response.body":
                await send(message)
                if message["type"] == "http.response.start":
                    self.draft.opening()
                    await send({"type": "http.response.body", "body": self.draft.take().encode(), "more_body": True})
                return
            buffered += message.get("body", b"")
            *events, buffered = buffered.split(b"\n\n")
            for event in events:
                await self._chat_event(event)
            more = message.get("more_body", False)
            if not more and not self.draft.finished:
                await self.finish()
            out = self.draft.take()
            if out or not more:
                await send({"type": "http.response.body", "body": out.encode(), "more_body": more})

        await self.chat(scope, receive, relay)

    async def _chat_event(self, event: bytes) -> None:
        data = event.decode("utf-8").strip().removeprefix("data:").strip()
        if not data or self.draft.finished:
            return
        if data == "[DONE]":
            await self.finish()
            return
        self.draft.chat_chunk(json.loads(data))


def add_routes(app: FastAPI, serving: Serving) -> ResponsesAPI:
    """POST /v1/responses, GET and DELETE /v1/responses/{response_id}."""
    api = ResponsesAPI(serving, ResponseStore.from_env())
    app.state.responses = api
    lookup = schemas.route(ResponseObject, 401, 500)
    lookup["responses"][404] = {"model": schemas.ErrorResponse, "description": "No stored response has this id"}
    deletion = schemas.route(DeletedResponse, 401, 500)
    deletion["responses"][404] = lookup["responses"][404]

    @app.post("/v1/responses", **schemas.route(ResponseObject, *schemas.GENERATION_ERRORS, stream=True))
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API (stateless core, plus `previous_response_id` over an in-memory store)."""
        return await api.create(body, request)

    @app.get("/v1/responses/{response_id}", **lookup)
    async def retrieve_response(response_id: str, request: Request) -> Response:
        # ASCII JSON, as POST answers: a stored echo of the client's text may hold lone surrogates
        return Response(_dumps(api.retrieve(response_id, request)), media_type="application/json")

    @app.delete("/v1/responses/{response_id}", **deletion)
    async def delete_response(response_id: str, request: Request) -> dict:
        return api.delete(response_id, request)

    return api
