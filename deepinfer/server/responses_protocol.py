"""Pydantic models of the OpenAI Responses API (`/v1/responses`): the request body, and (for the OpenAPI
document only) the response object and the deletion answer.

The request follows protocol.py's rules: unknown fields are ignored, known fields are typed strictly (no
coercion across JSON types), floats are finite, integers bounded. Input items, tools and `tool_choice`
arrive as JSON objects and are checked item by item in server/responses.py, so every problem is a 400
that names the item (`input[2]: ...`) rather than a union-matching error.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deepinfer.server.protocol import MAX_INT, BoundedInt, TokenId, _Body


# --- the request ---------------------------------------------------------------------------------
class TextFormat(_Body):
    """`text.format`: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "schema": ...}."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True, populate_by_name=True)
    type: str = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted, no effect


class ReasoningConfig(_Body):
    """`reasoning`: its presence turns the chat template's thinking mode on (`effort` "none" turns it off);
    the effort goes to the template as reasoning_effort (minimal -> low, medium -> high)."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # the deprecated name of `summary`


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: BoundedInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    store: bool | None = None  # OpenAI's default: true (kept in memory here, bounded)
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Accepted for compatibility, without effect.
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    # Refused unless left at their defaults (server/responses.py: REFUSED).
    include: list[str] | None = None
    background: bool | None = None
    truncation: str | None = None
    top_logprobs: BoundedInt | None = None
    max_tool_calls: BoundedInt | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    context_management: list[Any] | None = None
    # vLLM's sampling extensions, as on /v1/chat/completions.
    top_k: BoundedInt | None = None
    min_p: float | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1 - MAX_INT)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: BoundedInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    priority: BoundedInt | None = None
    cache_salt: str | None = None


# Input items (checked one by one; `type` picks the model).
class InputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class FunctionCallInput(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputInput(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]


class ReasoningInput(_Body):
    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None


class FunctionTool(_Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


# --- what the routes answer (OpenAPI document only) ----------------------------------------------
Status = Literal["completed", "incomplete", "in_progress", "failed"]


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]]
    logprobs: list[dict[str, Any]]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Status
    content: list[OutputText]


class SummaryText(BaseModel):
    type: Literal["summary_text"]
    text: str


class ReasoningOutput(BaseModel):
    id: str
    type: Literal["reasoning"]
    status: Status
    summary: list[SummaryText] = Field(description="the model's thinking (DeepSeek thinking mode), as one part")


class FunctionCallOutput(BaseModel):
    id: str
    type: Literal["function_call"]
    status: Status
    call_id: str
    name: str
    arguments: str = Field(description="the model's JSON text")


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = Field(description="the reasoning text's tokens (re-tokenised)")


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseErrorInfo(BaseModel):
    code: str | None
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """A response: what POST answers without `stream`, what GET returns, and the `response` of the stream's
    lifecycle events."""

    id: str
    object: Literal["response"]
    created_at: int
    completed_at: int | None
    status: Status
    error: ResponseErrorInfo | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputMessage | ReasoningOutput | FunctionCallOutput]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    store: bool
    background: bool
    temperature: float | None
    top_p: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"]
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, str]


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"]
    deleted: bool
