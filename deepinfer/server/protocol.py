"""Request bodies of the OpenAI-compatible API (pydantic), plus vLLM's sampling extensions.

Invariants: unknown fields are ignored (as vLLM does); values are never coerced across JSON types
(strict mode: `"stream": "yes"` or `"n": "2"` is a 400 naming the field, as OpenAI answers; an integer
is still a valid float, so `"temperature": 1` works); floats are finite (NaN / Infinity are rejected
at parsing, so they never reach the sampler); every integer that travels to the engine is bounded
so it fits the wire format. Semantic checks (ranges of temperature, top_p, ...) stay in
SamplingParams, whose ValueError the server answers with 400.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from deepinfer.multimodal.prompts import IMAGE_SENTINEL

# Token ids and counts travel as msgpack integers; anything past int32 is a client error anyway.
MAX_INT = 2**31 - 1
BoundedInt = Annotated[int, Field(ge=-MAX_INT, le=MAX_INT)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]
MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs; vLLM's default max_logprobs


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class StreamOptions(_Body):
    include_usage: bool = False




class ImageURL(_Body):
    url: str
    detail: str | None = None  # accepted and ignored: the image processor's own size rules apply


class TextPart(_Body):
    """A content part: `text`, or `image_url` (vision models; serving answers 400 for other types)."""

    type: str = "text"
    text: str | None = None
    image_url: ImageURL | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls, as OpenAI returned them
    tool_call_id: str | None = None  # a tool result's call

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: content parts joined into one string, an image part as
        IMAGE_SENTINEL (serving splits the rendered prompt there and puts the image's placeholder token in)."""
        data = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            data["content"] = "".join(IMAGE_SENTINEL if part.type == "image_url" else part.text or ""
                                      for part in self.content)
        return data

    def image_urls(self) -> list[str]:
        parts = self.content if isinstance(self.content, list) else ()
        return [part.image_url.url if part.image_url is not None else "" for part in parts if part.type == "image_url"]


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None  # outputs always follow the schema strictly (no properties it does not name)


class ResponseFormat(_Body):
    type: str  # text | json_object | json_schema
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Body):
    """vLLM's `structured_outputs` extra: exactly one constraint."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True, populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: str = "function"
    function: FunctionDefinition


class _SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: BoundedInt = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: BoundedInt | None = None
    min_p: float | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1 - MAX_INT)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: BoundedInt = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: BoundedInt = 0
    return_tokens_as_token_ids: bool = False  # vLLM: logprob tokens read "token_id:<id>"
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # vLLM: only requests with equal salts share prefixes
    # Disaggregation (vLLM's field): {"do_remote_decode": true} to a prefill instance; the prefill answer's
    # kv_transfer_params to a decode instance. Normally set by `deepinfer router --prefill ... --decode ...`.
    kv_transfer_params: dict[str, Any] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: BoundedInt | None = None
    max_completion_tokens: BoundedInt | None = None
    logprobs: bool = False
    top_logprobs: BoundedInt | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None  # auto | none | required | {"type": "function", ...}
    parallel_tool_calls: bool = True
    add_special_tokens: bool = False  # vLLM: the chat template already starts the prompt with BOS

    @property
    def output_limit(self) -> int | None:
        """max_completion_tokens is OpenAI's newer name; it wins when both are given."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """top-N per token, or None without logprobs (top_logprobs alone asks for nothing)."""
        return (self.top_logprobs or 0) if self.logprobs else None


PromptInput = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: BoundedInt | None = 16  # OpenAI's default for completions
    logprobs: BoundedInt | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM: BOS before each text prompt (token-id prompts are sent as given)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]

