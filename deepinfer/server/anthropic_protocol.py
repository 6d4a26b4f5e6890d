"""Pydantic models of the Anthropic Messages API (`POST /v1/messages`): the request body, and (for the OpenAPI
document only) the message it answers, its stream events and its error body.

The request follows protocol.py's rules: unknown fields are ignored (`cache_control`, `metadata`, `citations`,
...), known fields are typed strictly (no coercion across JSON types), floats are finite, integers bounded.
Content blocks, tools, `tool_choice` and `thinking` are unions told apart by their `type`; a block type the
server recognises parses even where it cannot serve it (`document`; `image` for a text-only model), and
server/anthropic_api.py answers that with a 400 naming the block. Class names carry an `Anthropic` prefix so the
OpenAPI components never collide with the OpenAI API's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator

from deepinfer.server.protocol import MAX_INT, BoundedInt, _Body

Count = Annotated[int, Field(ge=0, le=MAX_INT)]


# --- content blocks ------------------------------------------------------------------------------
class AnthropicTextBlock(_Body):
    type: Literal["text"]
    text: str


class AnthropicToolUseBlock(_Body):
    """An assistant turn's tool call, as the server returned it."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class AnthropicToolResultBlock(_Body):
    """A user turn's answer to a tool call; `content` text only."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[AnthropicTextBlock] | None = None
    is_error: bool = False


class AnthropicThinkingBlock(_Body):
    """An assistant turn's reasoning (it becomes the turn's reasoning_content; the signature is not checked)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class AnthropicRedactedThinkingBlock(_Body):
    """Accepted and dropped: this server never redacts, so it cannot read one."""

    type: Literal["redacted_thinking"]
    data: str


class AnthropicMediaBlock(_Body):
    """`image` (vision models, user turns: base64 or url sources) / `document` (refused with a 400)."""

    type: Literal["image", "document"]
    source: dict[str, Any] | None = None


ContentBlock = Annotated[AnthropicTextBlock | AnthropicToolUseBlock | AnthropicToolResultBlock
                         | AnthropicThinkingBlock | AnthropicRedactedThinkingBlock | AnthropicMediaBlock,
                         Field(discriminator="type")]


BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", "document")


class AnthropicMessageParam(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data: Any) -> Any:
        """An unknown block type is named as such (not as a failed match of every union member)."""
        content = data.get("content") if isinstance(data, dict) else None
        for j, block in enumerate(content if isinstance(content, list) else ()):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in BLOCK_TYPES:
                raise ValueError(f"content[{j}] has the unsupported block type {kind!r} (supported: "
                                 f"{', '.join(BLOCK_TYPES[:5])})")
            inner = block.get("content") if kind == "tool_result" else None
            for k, part in enumerate(inner if isinstance(inner, list) else ()):
                if isinstance(part, dict) and isinstance(part.get("type"), str) and part["type"] != "text":
                    raise ValueError(f"content[{j}].content[{k}]: a tool result's {part['type']} blocks are not "
                                     "supported (text only)")
        return data


# --- tools ---------------------------------------------------------------------------------------
class AnthropicTool(_Body):
    """A client tool (`type` absent or `custom`); server tools (web search, code execution, ...) are refused."""

    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "custom":
            raise ValueError(f"the server tool {kind!r} is not supported: only client tools (name, description, "
                             "input_schema), whose calls the client runs")
        return data


class AnthropicToolChoiceAuto(_Body):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class AnthropicToolChoiceAny(_Body):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class AnthropicToolChoiceTool(_Body):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class AnthropicToolChoiceNone(_Body):
    type: Literal["none"]


ToolChoice = Annotated[AnthropicToolChoiceAuto | AnthropicToolChoiceAny | AnthropicToolChoiceTool
                       | AnthropicToolChoiceNone, Field(discriminator="type")]


# --- thinking ------------------------------------------------------------------------------------
class AnthropicThinkingEnabled(_Body):
    """The model's thinking mode; `budget_tokens` is accepted but not enforced (max_tokens bounds thinking and
    answer together, as in Anthropic's API)."""

    type: Literal["enabled"]
    budget_tokens: Count


class AnthropicThinkingAdaptive(_Body):
    """Served as `enabled`: a DeepSeek model in thinking mode decides how long it thinks."""

    type: Literal["adaptive"]


class AnthropicThinkingDisabled(_Body):
    type: Literal["disabled"]


Thinking = Annotated[AnthropicThinkingEnabled | AnthropicThinkingAdaptive | AnthropicThinkingDisabled,
                     Field(discriminator="type")]


# --- the request ---------------------------------------------------------------------------------
class AnthropicMessagesRequest(_Body):
    model: str
    messages: list[AnthropicMessageParam]
    max_tokens: Annotated[int, Field(ge=1, le=MAX_INT)]
    system: str | list[AnthropicTextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: BoundedInt | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    # deepinfer's extensions (vLLM's sampling fields, as on /v1/chat/completions)
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1 - MAX_INT)] | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: BoundedInt = 0
    priority: BoundedInt = 0
    cache_salt: Annotated[str, Field(min_length=1)] | None = None


# --- the answer (OpenAPI document only) ----------------------------------------------------------
class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class AnthropicTextOut(BaseModel):
    type: Literal["text"]
    text: str


class AnthropicThinkingOut(BaseModel):
    type: Literal["thinking"]
    thinking: str
    signature: str = Field(description="always empty: nothing to verify")


class AnthropicToolUseOut(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class AnthropicMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicThinkingOut | AnthropicTextOut | AnthropicToolUseOut]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicErrorInfo(BaseModel):
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, "
                                  "request_too_large, overloaded_error or api_error")
    message: str


class AnthropicError(BaseModel):
    """Every non-2xx answer on /v1/messages (and an `error` event of a stream)."""

    type: Literal["error"]
    error: AnthropicErrorInfo
