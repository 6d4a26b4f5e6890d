"""The OpenAPI document's responses: pydantic models of what each route returns, and its error answers.

These models only describe: routes still build their bodies themselves (serving.py, app.py), and nothing is
validated against them at run time. Invariants: every status a route can answer is documented with the body it
carries (errors: errors.py's OpenAI body), and 422 is never documented, because validation errors are 400s.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, Field


# --- errors --------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, "
                                  "rate_limit_error or server_error")
    param: str | None = Field(description="the request field at fault, if one is")
    code: str | None


class ErrorResponse(BaseModel):
    """Every non-2xx answer of the server."""

    error: ErrorInfo


_ERRORS = {
    400: "Invalid request: malformed JSON, a field of the wrong type, a value out of range, a prompt too long",
    401: "Missing or wrong `Authorization: Bearer` API key (only when the server has API keys)",
    404: "`model` is not the served model",
    413: "The request body exceeds --max-body-bytes",
    429: "--max-queue sequences (prompts x n) are in flight; retry after `Retry-After` seconds",
    500: "The request failed inside the engine, or the server failed unexpectedly",
    503: "The engine process is not running",
}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
GENERATION_ERRORS = (400, 401, 404, 413, 429, 500, 503)
TOKENIZER_ERRORS = (400, 401, 404, 413, 500, 503)  # /tokenize and /detokenize need the key too
# One event of a stream (before OpenAPI 3.2's itemSchema, an event stream's `schema` describes each event).
_SSE_EVENT = {"type": "object", "required": ["data"], "description": "one Server-Sent Event",
              "properties": {"data": {"type": "string", "description": (
                  "a chunk as JSON (the response's shape, with `delta`s or text pieces), a failure after the first "
                  "event as the error body, and last always `[DONE]`")}}}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses` entries for these error statuses, each with the OpenAI error body."""
    return {status: {"model": ErrorResponse, "description": _ERRORS[status],
                     **({"headers": _RETRY_AFTER} if status == 429 else {})} for status in statuses}


def route(model: type[BaseModel], *errors: int, stream: bool = False) -> dict[str, Any]:
    """A JSON route's documentation (decorator keywords): its 200 body (or SSE when the request streams) and
    its error answers. `response_model=None`: the route's own body goes out as it is, never re-validated."""
    ok: dict[str, Any] = {"model": model, "description": "Success"}
    if stream:
        ok["description"] = "The whole answer as JSON, or with `stream: true` Server-Sent Events"
        ok["content"] = {"text/event-stream": {"schema": _SSE_EVENT}}
    return {"response_model": None, "responses": {200: ok, **error_responses(*errors)}}


# --- completions and chat ------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape; with echo the first prompt token's entries are null."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str = Field(description="stop, length, abort or error")
    stop_reason: int | str | None = Field(description="the stop string or token id that ended the choice")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the model's JSON text")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = Field(None, description="only when thinking is on")
    tool_calls: list[ToolCall] | None = Field(None, description="only when the model called tools")


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str = Field(description="stop, length, tool_calls, abort or error")
    stop_reason: int | str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


# --- service routes ------------------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class StatusResponse(BaseModel):
    status: Literal["ok"]


class RouterStateResponse(BaseModel):
    """What `deepinfer router` polls (server/router_state.py)."""

    instance: str = Field(description="changes whenever the server restarts")
    block_size: int
    prefix_cache_isolation: Literal["none", "key"]
    kv_events: bool = Field(description="whether prefix-cache events are published (engine option --kv-events)")
    alive: bool
    engine_silent_s: float = Field(description="seconds since the engine's last message (it reports every ~0.25 s)")
    load_tokens: int = Field(description="prompt + max_tokens x n of every open engine request")
    num_requests: int
    last_event: int = Field(description="the number of the newest prefix-cache event")
    complete: bool = Field(description="false when some events after `since` are no longer kept")
    events: list[list[str | None]] = Field(description='["stored" | "evicted", block hash hex] or ["cleared", null]')


class VersionResponse(BaseModel):
    version: str
    server_pid: int
    engine_pid: int | None


# /metrics answers text, so FastAPI would file an error `model` under text/plain: the 500 names its JSON body by
# reference (ErrorResponse is in the document through the other routes).
METRICS_RESPONSES = {
    200: {"description": "Prometheus text exposition format",
          "content": {"text/plain": {"schema": {"type": "string"}}}},
    500: {"description": _ERRORS[500],
          "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}},
}


# --- the document --------------------------------------------------------------------------------
def install_openapi(app: FastAPI) -> None:
    """Serve FastAPI's document without the 422 it adds to every route with a body (never sent)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _drop_validation_errors(FastAPI.openapi(app))  # FastAPI.openapi caches into app.openapi_schema
        return app.openapi_schema

    app.openapi = openapi


def _drop_validation_errors(document: dict[str, Any]) -> None:
    for path in document.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        document.get("components", {}).get("schemas", {}).pop(name, None)
