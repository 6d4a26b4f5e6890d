"""`POST /v1/messages`: the Anthropic Messages API over the chat machinery, so Claude-style clients (the
`anthropic` SDKs, agents built on them) can talk to a DeepSeek model as they can to DeepSeek's own API.

A request is translated into a ChatCompletionRequest (system and content blocks into chat messages, tools into
function tools, `tool_choice` any / tool into the grammar-forced `required` / named function, `thinking` into
the template's thinking mode) and runs `Serving.chat_as`: the same prompt rendering, tool formats, reasoning
split, structured constraint, admission and abort-on-disconnect as /v1/chat/completions. MessagesShape renders
the job as an Anthropic message, or as its event stream (message_start, ping, content_block_start /
_delta / _stop, message_delta, message_stop).

Invariants: every non-2xx answer on /v1/messages (the Gate's 401 / 413 / 529 included) has Anthropic's body
`{"type": "error", "error": {"type", "message"}}`, and a failure after the stream started is an `error` event;
the streamed blocks, concatenated, equal the non-streamed message's (one parse of the same output); a tool_use
block's `input` is always a JSON object (arguments that are not one read as `{}`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer.server.anthropic_protocol import (
    AnthropicError,
    AnthropicMessage,
    AnthropicMessageParam,
    AnthropicMessagesRequest,
    AnthropicTool,
    AnthropicToolChoiceAny,
    AnthropicToolChoiceNone,
    AnthropicToolChoiceTool,
)
from deepinfer.server.errors import APIError, _validation_error, bad_request
from deepinfer.server.protocol import ChatCompletionRequest, ChatMessage, FunctionDefinition, ImageURL, TextPart, Tool
from deepinfer.server.serving import ChatShape, Choice, Job, Serving, sse
from deepinfer.server.tools import loads_strict

logger = logging.getLogger("deepinfer")

PATH = "/v1/messages"
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_DONE = sse("[DONE]")  # respond()'s OpenAI end-of-stream marker, which Anthropic streams do not have


# --- errors --------------------------------------------------------------------------------------
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 529: "overloaded_error"}


def error_status(error: APIError) -> tuple[int, str]:
    """Anthropic's (status, error type) for one of the server's errors: a full queue (429) or a lost replica is
    `overloaded_error` with Anthropic's 529 (clients retry it); 5xx is `api_error` (503: the engine is gone)."""
    if error.status == 429 or error.code == "replica_lost":
        return 529, "overloaded_error"
    if error.status >= 500:
        return error.status, "api_error"
    return error.status, _ERROR_TYPES.get(error.status, "invalid_request_error")


def error_body(error: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_status(error)[1], "message": error.message}}


def error_response(error: APIError) -> Response:
    """ASCII JSON, as errors.py's (a message may quote client input holding lone surrogates)."""
    return Response(json.dumps(error_body(error), ensure_ascii=True), status_code=error_status(error)[0],
                    headers=error.headers, media_type="application/json")


class _AnthropicRoute(APIRoute):
    """A route whose every failure (body validation, our checks, anything unexpected) answers Anthropic's error
    body instead of the app-wide OpenAI one."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as e:
                return error_response(e)
            except RequestValidationError as e:
                return error_response(_validation_error(e))
            except StarletteHTTPException as e:
                return error_response(APIError(e.status_code, str(e.detail), headers=getattr(e, "headers", None)))
            except Exception as e:
                logger.exception("unexpected error while handling a request", exc_info=e)
                return error_response(APIError(500, f"internal server error ({type(e).__name__})"))

        return route


# --- request translation -------------------------------------------------------------------------
def _joined(texts: list[str]) -> str:
    return "\n\n".join(texts)


def _system(system) -> str:
    return system if isinstance(system, str) else _joined([block.text for block in system])


def _result_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return _joined([block.text for block in content])


def _refuse(where: str, block) -> APIError:
    if block.type in ("image", "document"):
        return bad_request(f"{where}: {block.type} blocks are not supported here (images: in user turns, as base64 "
                           "or url sources, for vision models)", param="messages")
    return bad_request(f"{where}: {block.type} blocks are not allowed in a user turn", param="messages")


def _image_part(where: str, block) -> TextPart:
    """An image block as the chat API's image_url part (whether the model takes images is checked later)."""
    src = block.source or {}
    if src.get("type") == "base64" and isinstance(src.get("data"), str):
        url = f"data:{src.get('media_type') or 'image/png'};base64,{src['data']}"
    elif src.get("type") == "url" and isinstance(src.get("url"), str):
        url = src["url"]
    else:
        raise bad_request(f"{where}: an image source must be {{type: base64, media_type, data}} or {{type: url, "
                          "url}}", param="messages")
    return TextPart(type="image_url", image_url=ImageURL(url=url))


def _user_message(items: list) -> ChatMessage:
    """Text blocks joined by blank lines; with images, as content parts in their order."""
    if all(isinstance(x, str) for x in items):
        return ChatMessage(role="user", content=_joined(items))
    parts = []
    for k, x in enumerate(items):
        if k and isinstance(x, str) and isinstance(items[k - 1], str):
            parts.append(TextPart(text="\n\n"))
        parts.append(TextPart(text=x) if isinstance(x, str) else x)
    return ChatMessage(role="user", content=parts)


def _user_turn(i: int, message: AnthropicMessageParam) -> list[ChatMessage]:
    """Text and image blocks become user messages and each tool_result a tool message, in their order."""
    if isinstance(message.content, str):
        return [ChatMessage(role="user", content=message.content)]
    out, items = [], []
    for j, block in enumerate(message.content):
        where = f"messages[{i}].content[{j}]"
        if block.type == "text":
            items.append(block.text)
        elif block.type == "image":
            items.append(_image_part(where, block))
        elif block.type == "tool_result":
            if items:
                out.append(_user_message(items))
                items = []
            out.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id,
                                   content=_result_text(block.content)))
        else:
            raise _refuse(where, block)
    if items or not out:
        out.append(_user_message(items))
    return out


def _assistant_turn(i: int, message: AnthropicMessageParam) -> ChatMessage:
    """Text blocks become the content, thinking blocks the reasoning_content, tool_use blocks the tool_calls."""
    if isinstance(message.content, str):
        return ChatMessage(role="assistant", content=message.content)
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(message.content):
        if block.type == "text":
            texts.append(block.text)
        elif block.type == "thinking":
            thoughts.append(block.thinking)
        elif block.type == "tool_use":
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif block.type != "redacted_thinking":
            where = f"messages[{i}].content[{j}]"
            if block.type in ("image", "document"):
                raise _refuse(where, block)
            raise bad_request(f"{where}: {block.type} blocks are not allowed in an assistant turn", param="messages")
    return ChatMessage(role="assistant", content=_joined(texts) if texts or not calls else None,
                       reasoning_content=_joined(thoughts) if thoughts else None, tool_calls=calls or None)


def _tool(i: int, tool: AnthropicTool) -> Tool:
    if not _TOOL_NAME.match(tool.name):
        raise bad_request(f"tools[{i}].name must match ^[A-Za-z0-9_-]{{1,64}}$, got {tool.name!r}", param="tools")
    return Tool(type="function", function=FunctionDefinition(name=tool.name, description=tool.description,
                                                             parameters=tool.input_schema))


def _tool_choice(body: AnthropicMessagesRequest) -> tuple[str | dict[str, Any] | None, bool]:
    """(OpenAI tool_choice, parallel calls allowed)."""
    choice = body.tool_choice
    if choice is None:
        return None, True
    if isinstance(choice, AnthropicToolChoiceNone):
        return "none", True
    if not body.tools and isinstance(choice, AnthropicToolChoiceAny | AnthropicToolChoiceTool):
        raise bad_request(f"tool_choice {{'type': '{choice.type}'}} needs tools", param="tool_choice")
    parallel = not choice.disable_parallel_tool_use
    if isinstance(choice, AnthropicToolChoiceTool):
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return ("required" if isinstance(choice, AnthropicToolChoiceAny) else "auto"), parallel


def chat_request(body: AnthropicMessagesRequest) -> ChatCompletionRequest:
    """The chat request a Messages request means (400 for what cannot be served)."""
    if not body.messages:
        raise bad_request("messages must not be empty", param="messages")
    if body.messages[-1].role == "assistant":
        raise bad_request("the last message must be a user turn: continuing an assistant turn (prefill) is not "
                          "supported", param="messages")
    messages = [ChatMessage(role="system", content=_system(body.system))] if body.system else []
    for i, message in enumerate(body.messages):
        if message.role == "user":
            messages.extend(_user_turn(i, message))
        else:
            messages.append(_assistant_turn(i, message))
    tool_choice, parallel = _tool_choice(body)
    thinking = body.thinking is not None and body.thinking.type != "disabled"
    extras = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "seed", "min_p", "presence_penalty",
                                            "frequency_penalty", "repetition_penalty", "cache_salt")
              if getattr(body, k) is not None}
    return ChatCompletionRequest(
        model=body.model, messages=messages, max_tokens=body.max_tokens, stop=list(body.stop_sequences or []),
        stream=body.stream, tools=[_tool(i, t) for i, t in enumerate(body.tools)] if body.tools else None,
        tool_choice=tool_choice, parallel_tool_calls=parallel, chat_template_kwargs={"thinking": thinking},
        ignore_eos=body.ignore_eos, min_tokens=body.min_tokens, priority=body.priority, **extras)


# --- the answer ----------------------------------------------------------------------------------
def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as Anthropic's `input` object; text that is not a JSON object reads as {} (only
    unforced calls can be malformed: any / tool calls follow their schema by grammar)."""
    try:
        value = loads_strict(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def event(name: str, data: dict[str, Any], ascii_only: bool = False) -> str:
    payload = json.dumps(data, ensure_ascii=ascii_only, separators=(",", ":"))
    return f"event: {name}\ndata: {payload}\n\n"


class _Blocks:
    """A stream's content blocks: each chat delta (reasoning, content) continues the open block of its kind or
    closes it and opens the next. Tool calls wait for the end, as in the whole message (thinking, text, then
    tool_use: text written after a call stays in the one text block); each goes out as a tool_use block with
    one input_json_delta (calls arrive whole, and a continuation delta would only extend the arguments)."""

    def __init__(self, single_call: bool):
        self.single_call, self.index, self.kind = single_call, -1, None
        self.pending: list[dict[str, Any]] = []  # tool_use blocks (with their arguments) for close()
        self.calls, self.skipping = 0, False

    def feed(self, delta: dict[str, Any]) -> list[str]:
        out = []
        if delta.get("reasoning_content"):
            out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            self._call(call)
        return out

    def _call(self, call: dict[str, Any]) -> None:
        function = call.get("function") or {}
        if call.get("id") is None:  # a continuation of the last call
            if self.pending and not self.skipping:
                self.pending[-1]["arguments"] += function.get("arguments") or ""
            return
        self.calls += 1
        self.skipping = self.single_call and self.calls > 1  # disable_parallel_tool_use: the first call only
        if not self.skipping:
            self.pending.append({"id": call["id"], "name": function.get("name"),
                                 "arguments": function.get("arguments") or ""})

    def close(self) -> list[str]:
        out = self._stop()
        for call in self.pending:
            out += self._open("tool_use", {"type": "tool_use", "id": call["id"], "name": call["name"], "input": {}})
            partial = json.dumps(tool_input(call["arguments"]), ensure_ascii=False)
            out.append(self._delta({"type": "input_json_delta", "partial_json": partial}))
            out += self._stop()
        self.pending = []
        return out

    def _stop(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        if kind == self.kind and kind != "tool_use":
            return []
        out = self._stop()
        self.index, self.kind = self.index + 1, kind
        out.append(event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                 "content_block": block}))
        return out

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})


class MessagesShape(ChatShape):
    """A chat job rendered as an Anthropic message (non-streaming) or its event stream."""

    def __init__(self, serving: Serving, req: ChatCompletionRequest, stop_sequences: list[str] | None,
                 single_call: bool):
        super().__init__(serving, req)
        self.stop_sequences, self.single_call = set(stop_sequences or ()), single_call

    def response(self, job: Job) -> dict[str, Any]:
        choice = job.choices[0]
        message = self.final_choice(job, choice)["message"]
        calls = message.get("tool_calls") or []
        if self.single_call:
            calls = calls[:1]
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        content += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                     "input": tool_input(c["function"]["arguments"])} for c in calls]
        return self._message(job, content, *self._stop(choice, bool(calls)), choice.num_tokens)

    async def events(self, job: Job) -> AsyncIterator[str]:
        choice = job.choices[0]
        yield event("message_start", {"type": "message_start", "message": self._message(job, [], None, None, 0)})
        yield event("ping", {"type": "ping"})
        blocks = _Blocks(self.single_call)
        try:
            async with contextlib.aclosing(job.updates()) as updates:
                async for update in updates:
                    for item in blocks.feed(self._delta(update)):
                        yield item
            stop_reason, stop_sequence = self._stop(choice, blocks.calls > 0)
        except APIError as e:
            yield event("error", error_body(e), ascii_only=True)
            return
        except Exception as e:
            logger.exception("a streaming request failed")
            yield event("error", error_body(APIError(500, f"internal server error ({type(e).__name__})")), True)
            return
        for item in blocks.close():
            yield item
        usage = self._usage(job, choice.num_tokens)
        yield event("message_delta", {"type": "message_delta", "usage": usage,
                                      "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}})
        yield event("message_stop", {"type": "message_stop"})

    def _stop(self, choice: Choice, called: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of a finished choice."""
        if choice.finish_reason == "length":
            return "max_tokens", None
        if choice.finish_reason != "stop":  # aborted (a drain ran out) or failed inside the engine
            raise APIError(503 if choice.finish_reason == "abort" else 500,
                           f"the request ended without an answer (finish reason {choice.finish_reason!r})",
                           code="replica_lost" if choice.finish_reason == "abort" else None)
        if called:
            return "tool_use", None
        if isinstance(choice.stop_reason, str) and choice.stop_reason in self.stop_sequences:
            return "stop_sequence", choice.stop_reason
        return "end_turn", None

    @staticmethod
    def _usage(job: Job, output_tokens: int) -> dict[str, int]:
        return {"input_tokens": len(job.prompts[0].token_ids), "output_tokens": output_tokens}

    def _message(self, job: Job, content: list, stop_reason: str | None, stop_sequence: str | None,
                 output_tokens: int) -> dict[str, Any]:
        return {"id": job.request_id, "type": "message", "role": "assistant",
                "model": self.serving.settings.model_name, "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": self._usage(job, output_tokens)}


async def _without_done(events: AsyncIterator[str]) -> AsyncIterator[str]:
    async with contextlib.aclosing(events):
        async for item in events:
            if item != _DONE:
                yield item


async def create_message(serving: Serving, body: AnthropicMessagesRequest, request: Request) -> Response:
    req = chat_request(body)
    single_call = body.tool_choice is not None and getattr(body.tool_choice, "disable_parallel_tool_use", False)
    shape = MessagesShape(serving, req, body.stop_sequences, single_call)
    response = await serving.chat_as(req, request, shape, f"msg_{uuid.uuid4().hex}")
    if isinstance(response, StreamingResponse):
        response.body_iterator = _without_done(response.body_iterator)
    return response


# --- the route -----------------------------------------------------------------------------------
_ERROR_DOCS = {
    400: "invalid_request_error: malformed JSON, a field of the wrong type, a value out of range, an unsupported "
         "block (document; image for a text-only model), a bad image, a prompt too long",
    401: "authentication_error: missing or wrong API key, `x-api-key` or `Authorization: Bearer` (only when the "
         "server has API keys)",
    404: "not_found_error: `model` is not the served model",
    413: "request_too_large: the request body exceeds --max-body-bytes",
    500: "api_error: the request failed inside the engine, or the server failed unexpectedly",
    503: "api_error: the engine process is not running",
    529: "overloaded_error: --max-queue sequences are in flight (or a replica was lost); retry after `Retry-After`",
}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
_SSE_EVENT = {"type": "object", "required": ["event", "data"], "description": "one Server-Sent Event",
              "properties": {"event": {"type": "string", "description": (
                  "message_start, ping, content_block_start, content_block_delta, content_block_stop, message_delta, "
                  "message_stop, or error")}, "data": {"type": "string", "description": "the event as JSON"}}}
RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": AnthropicMessage, "description": "The message as JSON, or with `stream: true` its events",
          "content": {"text/event-stream": {"schema": _SSE_EVENT}}},
    **{status: {"model": AnthropicError, "description": text, **({"headers": _RETRY_AFTER} if status == 529 else {})}
       for status, text in _ERROR_DOCS.items()},
}


def add_routes(app: FastAPI, serving: Serving) -> None:
    router = APIRouter(route_class=_AnthropicRoute)

    @router.post(PATH, response_model=None, responses=RESPONSES)
    async def messages(body: AnthropicMessagesRequest, request: Request) -> Response:
        """The Anthropic Messages API (text, tools, thinking; streaming and not)."""
        return await create_message(serving, body, request)

    # Undocumented answers, so that every non-2xx under /v1/messages has Anthropic's body.
    @router.api_route(PATH, methods=["GET", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def wrong_method(request: Request) -> Response:
        raise APIError(405, f"{request.method} is not allowed on {PATH}: use POST")

    @router.api_route(PATH + "/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                      include_in_schema=False)
    async def not_implemented(rest: str) -> Response:
        raise APIError(404, f"{PATH}/{rest} is not implemented here (count_tokens, batches): only POST {PATH}")

    app.include_router(router)
