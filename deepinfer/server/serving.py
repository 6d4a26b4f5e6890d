"""Request handling for /v1/completions and /v1/chat/completions: prompts, sampling parameters,
engine streams -> choices (detokenisation, stop strings, logprobs, reasoning), and the OpenAI
response / SSE chunk shapes.

Invariants:
- a request is admitted (its prompts x n sequences counted against --max-queue) only after it validated,
  and released exactly once, when its response finished or was abandoned (GuardedStream / `finally`);
- text is tokenised (and chat templates rendered) off the event loop, and only once it is short enough
  to possibly fit the context, so no input stalls /health or other streams;
- a choice's text, token ids and logprobs only grow, and nothing is added after it finished;
- every engine stream a request opened is closed when the request ends, however it ends (normal end,
  stop string, client disconnect, error), so the engine never keeps computing for nobody;
- a failure inside one request fails that request only (its response carries the error).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deepinfer.config_v41 import VisionConfig
from deepinfer.engine.detokenizer import IncrementalDetokenizer
from deepinfer.multimodal.image_processor import ImageError
from deepinfer.multimodal.inputs import expand_placeholders
from deepinfer.multimodal.media import MediaPolicy
from deepinfer.multimodal.prompts import process_sources, tokens_around_images
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.engine_client import EngineDeadError, ReplicaLost
from deepinfer.server.errors import APIError, bad_request
from deepinfer.server.metrics import Metrics, RequestTimer
from deepinfer.server.protocol import (
    MAX_LOGPROBS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from deepinfer.server.reasoning import ReasoningStream, split_reasoning, thinking_enabled
from deepinfer.server.structured import GrammarChecker, check_spec, request_spec
from deepinfer.server.tool_formats import (
    DSMLStream,
    format_of,
    output_decoder,
    render_prompt,
    uses_builtin_renderer,
)
from deepinfer.server.tools import ToolCallStream, ToolSetup, tool_setup
from deepinfer.structured.params import StructuredOutputsParams

logger = logging.getLogger("deepinfer")

MIN_LOGPROB = -9999.0  # -inf is not JSON; OpenAI clients get this floor instead (as from vLLM)
MAX_STOP_STRINGS = 32  # each generated token is checked against every stop string
_RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "tokenize")
_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                      "frequency_penalty", "repetition_penalty")


@dataclass
class ServerSettings:
    model_name: str
    api_keys: tuple[str, ...] = ()  # any of them authorizes /v1/*; none: the API is open
    max_queue: int = 512
    max_n: int = 16
    max_body_bytes: int = 16 * 2**20
    retry_after_s: int = 1
    max_request_seqs: int | None = None  # prompts x n one request may hold; None: a quarter of max_queue
    grammar_timeout_s: float = 30.0  # a structured-output constraint that does not build in time is a 400
    prefix_cache_isolation: str = "none"  # "key": each API key's requests share cached prefixes only among themselves
    vision: VisionConfig | None = None  # the served model's vision tower (None: text only)
    image_token_id: int = -1
    media: MediaPolicy = MediaPolicy()  # where images may come from, and their limits


def default_request_share(limit: int) -> int:
    """A quarter of the queue (at least 1): one request never keeps three quarters from other clients."""
    return max(1, limit // 4)


class Admission:
    """Engine sequences in flight (prompts x n of every admitted request).

    Invariants: 0 <= count <= limit; no request holds more than `per_request` (<= limit) sequences, so
    however large one request is, the rest of the queue stays open to the others (first come, first
    served; nothing waits: a request that does not fit now gets 429)."""

    def __init__(self, limit: int, retry_after_s: int, per_request: int | None = None):
        self.limit, self.retry_after_s, self.count = limit, retry_after_s, 0
        self.per_request = min(per_request or default_request_share(limit), limit)

    @property
    def full(self) -> bool:
        """Not even one sequence fits: checked before a request body is parsed, so rejecting is cheap."""
        return self.count >= self.limit

    def busy(self) -> APIError:
        return APIError(429, f"the server is at its limit of {self.limit} in-flight sequences; retry later",
                        headers={"Retry-After": str(self.retry_after_s)})

    def check_share(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.per_request:
            raise bad_request(f"the request needs {num_prompts} prompts x n={n} sequences but one request may "
                              f"hold at most {self.per_request}", param="prompt" if num_prompts > 1 else "n")

    def precheck(self, num_prompts: int, n: int) -> None:
        """What acquire would answer now, before the request is tokenised (so a request that cannot be
        admitted costs no tokenising or templating); acquire decides again at admission."""
        self.check_share(num_prompts, n)
        if self.count + num_prompts * n > self.limit:
            raise self.busy()

    def acquire(self, num_prompts: int, n: int) -> int:
        """Admits the request or raises (400 over its share, 429 when it does not fit now); returns the
        sequences to release."""
        self.check_share(num_prompts, n)
        k = num_prompts * n
        if self.count + k > self.limit:
            raise self.busy()
        self.count += k
        return k

    def release(self, k: int) -> None:
        self.count -= k


# --- prompts -------------------------------------------------------------------------------------
@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]
    thinking: bool = False  # the prompt leaves the model inside <think>
    images: list | None = None  # image spans (multimodal.inputs.ImageSpan) of token_ids, placeholders expanded


class _NoText:
    """Decoder for checkpoints without a tokenizer: outputs are token ids only (text stays empty)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    try:
        text.encode("utf-8")  # JSON can carry lone surrogates ("\ud800"); tokenizers cannot
    except UnicodeEncodeError as e:
        raise bad_request(f"the text is not valid Unicode ({e.reason} at index {e.start})", param="prompt") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def chars_per_token(tokenizer) -> int:
    """A bound on the characters one token covers: twice the longest vocabulary entry (byte-level entries
    are at least as long as the text they cover; the factor 2 leaves room for normalisers that shorten
    text). A text longer than max_model_len times this cannot fit the context, whatever its tokens."""
    if tokenizer is None:
        return 1
    return 2 * max(len(piece) for piece in tokenizer.inner.get_vocab(with_added_tokens=True))


def _check_parts(messages: list, images: bool) -> None:
    """Text parts always; image_url parts (with a url) only where the model takes images."""
    for i, message in enumerate(messages):
        for part in message.content if isinstance(message.content, list) else ():
            if part.type == "image_url" and images:
                if part.image_url is None:
                    raise bad_request(f"messages[{i}]: an image_url part needs image_url.url", param="messages")
            elif part.type == "image_url":
                raise bad_request(f"messages[{i}]: this model takes no image inputs (image_url parts need a vision "
                                  "model such as DeepSeek-V4.1-Flash)", param="messages")
            elif part.type != "text":
                raise bad_request(f"messages[{i}]: content part type {part.type!r} is not supported (text, "
                                  "image_url)", param="messages")


def chat_prompt(tokenizer, req: ChatCompletionRequest, tools: ToolSetup, images: bool = False) -> str:
    """The prompt text of a chat request: its messages in the chat template, with its tools."""
    kwargs = {**(req.chat_template_kwargs or {}), **({"tools": tools.tools} if tools.active else {})}
    return render_chat(tokenizer, req.messages, req.add_generation_prompt, kwargs, tools.format, images)


def render_chat(tokenizer, messages: list, add_generation_prompt: bool, kwargs: dict | None, fmt=None,
                images: bool = False) -> str:
    """The chat template applied to `messages`; template and input problems are the client's (400). DSML
    checkpoints (V3.2, V4, V4.1) without a template for their format are rendered by DeepSeek's encoder
    (server/tool_formats.py); `fmt`: the served tool format (default: the tokenizer's)."""
    if not messages:
        raise bad_request("messages must not be empty", param="messages")
    _check_parts(messages, images)
    extra = {k: v for k, v in (kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS}
    dicts = [m.template_dict() for m in messages]
    fmt = fmt if fmt is not None else format_of(tokenizer)
    try:
        if uses_builtin_renderer(fmt, tokenizer, dicts, extra):
            return render_prompt(fmt, tokenizer, dicts, add_generation_prompt, extra)
        return tokenizer.apply_chat_template(dicts, add_generation_prompt, **extra)
    except (jinja2.TemplateError, TypeError, ValueError, UnicodeError) as e:
        raise bad_request(f"the chat template could not be applied: {e}", param="messages") from None


def prompt_list(prompt) -> list[str | list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> one text or token-id list per engine request."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("the prompt is empty", param="prompt")
    if all(isinstance(t, int) for t in prompt):
        return [prompt]
    return list(prompt)


# --- choices -------------------------------------------------------------------------------------
@dataclass
class Choice:
    index: int  # the OpenAI choice index: prompt index * n + sample index
    detok: IncrementalDetokenizer
    logprobs: list | None  # kept (ids, logprobs, rank) entries when logprobs were asked for
    reasoning: ReasoningStream | None = None  # streaming chat with thinking on
    tools: ToolCallStream | DSMLStream | None = None  # streaming chat with tools
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.detok.output_token_ids)


@dataclass
class Update:
    """What one engine output changed in one choice."""

    choice: Choice
    text: str
    num_tokens: int  # output tokens kept (tokens after a stop string are dropped)
    logprobs: list
    finished: bool


def _engine_error(exc: Exception, dead: bool) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ReplicaLost):  # one replica of several: retrying may well work
        return APIError(503, str(exc), code="replica_lost")
    if isinstance(exc, EngineDeadError):  # gone before this request reached it
        return APIError(503, f"the engine is not running: {exc}", code="engine_dead")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    if dead:
        return APIError(500, f"the engine died while the request ran: {exc}", code="engine_dead")
    return APIError(500, f"the engine failed the request: {exc}")


class Generation:
    """One engine request (one prompt, n samples)."""

    def __init__(self, job: Job, request_id: str, prompt: Prompt, first_index: int):
        self.job, self.request_id, self.prompt = job, request_id, prompt
        params = job.params
        self.choices = [job.new_choice(first_index + i, prompt) for i in range(params.n)]
        self.prompt_logprobs: list = []

    async def updates(self) -> AsyncIterator[Update]:
        client = self.job.serving.client
        stream = client.generate(self.request_id, self.prompt.token_ids, self.job.params, self.job.priority,
                                 self.job.cache_salt, self.job.kv_transfer,
                                 **({"images": self.prompt.images} if self.prompt.images else {}))
        try:
            async for out in stream:  # closed in `finally`, which aborts the engine request if unfinished
                update = self._apply(out)
                if update is not None:
                    yield update
                if all(c.finished for c in self.choices):
                    break  # stop strings may end choices before the engine does
        except Exception as e:
            raise _engine_error(e, client.dead) from e
        finally:
            await stream.aclose()  # aborts the engine request unless it already finished

    def _apply(self, out) -> Update | None:
        if out.error is not None:
            raise APIError(500, out.error, code="engine_dead" if self.job.serving.client.dead else None)
        self.prompt_logprobs.extend(out.prompt_logprobs or ())
        if out.kv_transfer_params is not None:
            self.job.kv_transfer_params = out.kv_transfer_params
        choice = self.choices[out.index]
        if choice.finished:
            return None  # a stop string ended it; outputs already in flight are dropped
        before = choice.num_tokens
        stop = choice.detok.append(out.new_token_ids)
        kept = choice.num_tokens - before
        entries = list(out.logprobs or ())[:kept] if choice.logprobs is not None else []
        if choice.logprobs is not None:
            choice.logprobs.extend(entries)
        self._finish(choice, stop, out)
        if stop is not None and out.finish_reason is None and len(self.choices) > 1:
            self.job.serving.client.abort_sample(self.request_id, out.index)  # the others keep running
        return Update(choice, choice.detok.get_delta(choice.finished), kept, entries, choice.finished)

    def _finish(self, choice: Choice, stop: str | None, out) -> None:
        if stop is not None:
            choice.finish_reason, choice.stop_reason = "stop", stop
        elif out.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason


async def _merge(streams: list[AsyncIterator[Update]]) -> AsyncIterator[Update]:
    """Interleave several prompts' updates as they come; closing this closes (aborts) them all."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as stream:
            async for item in stream:
                yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(s, queue)) for s in streams]
    try:
        for _ in range(len(tasks)):
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def _pump(stream: AsyncIterator[Update], queue: asyncio.Queue) -> None:
    """Copies one stream into `queue`, then None; an exception travels as the item."""
    try:
        async with contextlib.aclosing(stream):
            async for item in stream:
                queue.put_nowait(item)
    except Exception as e:
        queue.put_nowait(e)
    queue.put_nowait(None)


class Job:
    """One HTTP request: its generations (one per prompt), choices, usage and timing."""

    def __init__(self, serving: Serving, request_id: str, prompts: list[Prompt], params: SamplingParams,
                 priority: int, stream: bool, tools: ToolSetup | None = None, cache_salt: str | None = None):
        self.serving, self.request_id, self.prompts = serving, request_id, prompts
        self.cache_salt = cache_salt  # every generation's prefix blocks are keyed by it
        self.kv_transfer: dict | None = None  # disaggregation: the request's kv_transfer_params
        self.kv_transfer_params: dict | None = None  # a prefill engine's answer for the decode engine
        self.tools = tools if tools is not None and tools.active else None  # parse outputs for tool calls
        if self.tools is not None and self.tools.format is None:  # the served model's format
            self.tools.format = format_of(serving.tokenizer)
        self.params, self.priority, self.stream = params, priority, stream
        self.created = int(time.time())
        self.timer = RequestTimer(serving.metrics)
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        self.generations = [Generation(self, rid, p, i * params.n) for i, (rid, p) in enumerate(zip(ids, prompts))]
        self.choices = [c for g in self.generations for c in g.choices]

    def new_choice(self, index: int, prompt: Prompt) -> Choice:
        decoder = self.serving.decoder
        if self.serving.tokenizer is not None and (self.tools is not None or prompt.thinking):
            fmt = self.tools.format if self.tools is not None else None
            decoder = output_decoder(self.serving.tokenizer, fmt, self.tools is not None, prompt.thinking)
        detok = IncrementalDetokenizer(decoder, prompt.token_ids, self.params)
        reasoning = ReasoningStream() if prompt.thinking and self.stream else None
        tools = self.tools.new_stream() if self.tools is not None and self.stream else None
        return Choice(index, detok, [] if self.params.logprobs is not None else None, reasoning, tools)

    async def updates(self) -> AsyncIterator[Update]:
        try:
            async with contextlib.aclosing(_merge([g.updates() for g in self.generations])) as merged:
                async for update in merged:
                    self._observe(update)
                    yield update
        except (GeneratorExit, asyncio.CancelledError):
            self._abandon()  # the client left (or the drain ran out): its open choices were aborted
            raise
        self.timer.on_done()

    def _abandon(self) -> None:
        for choice in self.choices:
            if not choice.finished:
                self.timer.on_finish("abort")

    def _observe(self, update: Update) -> None:
        if update.num_tokens:
            self.timer.on_tokens(update.choice.index, update.num_tokens)
        if update.finished:
            self.timer.on_finish(update.choice.finish_reason)

    async def run(self) -> None:
        async with contextlib.aclosing(self.updates()) as updates:
            async for _ in updates:
                pass

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p.token_ids) for p in self.prompts)
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# --- SSE -----------------------------------------------------------------------------------------
def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


class GuardedStream(StreamingResponse):
    """A StreamingResponse that always runs `on_close` and closes its body iterator, even when the
    client went away before the first chunk (the iterator is then never started by Starlette)."""

    def __init__(self, content: AsyncIterator[str | bytes], on_close: Callable[[], None],
                 headers: dict[str, str] | None = None):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self.body_iterator.aclose()


async def _error_events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Passes events through; a failure becomes an error event. Always ends with [DONE]."""
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                yield event
    except APIError as e:
        yield sse(e.json())
    except Exception as e:
        logger.exception("a streaming request failed")
        yield sse(APIError(500, f"internal server error ({type(e).__name__})").json())
    yield sse("[DONE]")


async def run_until_disconnect(request: Request, work: Awaitable[None]) -> bool:
    """Runs `work`; cancels it if the client disconnects first. True when the work completed."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        return False
    task.result()  # re-raise the request's own error
    return True


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# --- logprob shapes ------------------------------------------------------------------------------
def _floor(lp: float) -> float:
    return max(float(lp), MIN_LOGPROB)


# --- the service ---------------------------------------------------------------------------------
_MEDIA_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="deepinfer-media")  # image fetch / decode


def _image_spans(ids: list[int], urls: list[str], s: ServerSettings) -> tuple[list[int], list]:
    """On the media pool: the images loaded and processed, the placeholders expanded, the wire forms built."""
    ids, spans = expand_placeholders(ids, process_sources(urls, s.media, s.vision), s.image_token_id)
    for span in spans:
        _ = span.wire
    return ids, spans
class Serving:
    def __init__(self, client, tokenizer, settings: ServerSettings, metrics: Metrics):
        self.client, self.tokenizer, self.settings, self.metrics = client, tokenizer, settings, metrics
        self.decoder = tokenizer if tokenizer is not None else _NoText()
        self.admission = Admission(settings.max_queue, settings.retry_after_s, settings.max_request_seqs)
        self._chars_per_token = chars_per_token(tokenizer)
        self._grammar_checker: GrammarChecker | None = None
        self._pieces: dict[int, str] = {}

    @property
    def grammar_checker(self) -> GrammarChecker:
        if self._grammar_checker is None:
            ready = self.client.ready
            self._grammar_checker = GrammarChecker(self.tokenizer, ready.vocab_size, list(ready.eos_token_ids))
        return self._grammar_checker

    def close(self) -> None:
        """Kills the grammar-check workers (a compile in progress dies with its worker)."""
        if self._grammar_checker is not None:
            self._grammar_checker.close()

    @property
    def max_model_len(self) -> int:
        return self.client.ready.max_model_len

    @property
    def max_text_chars(self) -> int:
        """Longer texts cannot fit the context (see chars_per_token): a 400 without tokenising."""
        return self.max_model_len * self._chars_per_token

    # --- checks ----------------------------------------------------------------------------------
    def check_request(self, model: str | None) -> None:
        if self.client.dead or getattr(self.client, "closed", False):
            raise APIError(503, "the engine is not running", code="engine_dead")
        if model is not None and model != self.settings.model_name:
            raise APIError(404, f"the model `{model}` does not exist; this server serves "
                                f"`{self.settings.model_name}`", param="model", code="model_not_found")

    def _require_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise bad_request(f"{what} needs a tokenizer, and this model has no tokenizer.json")
        return self.tokenizer

    def _check_chars(self, text: str, param: str) -> None:
        if len(text) > self.max_text_chars:
            raise bad_request(f"the text has {len(text)} characters; at most {self.max_text_chars} can fit this "
                              f"model's context of {self.max_model_len} tokens", param=param)

    async def _tokens(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """`text`'s token ids, encoded in a worker thread (HF tokenizers releases the GIL) once its length
        passed the cheap bound."""
        self._check_chars(text, param)
        return await asyncio.to_thread(encode_text, self.tokenizer, text, add_special_tokens)

    async def _render(self, messages: list, add_generation_prompt: bool, kwargs: dict | None) -> str:
        """render_chat in a worker thread: a large conversation must not stall the event loop."""
        return await asyncio.to_thread(render_chat, self._require_tokenizer("chat"), messages,
                                       add_generation_prompt, kwargs)

    def _check_prompt(self, ids: list[int], max_tokens: int | None) -> None:
        """What the engine would reject, answered here with a 400 before anything is queued."""
        vocab = self.client.ready.vocab_size
        if not ids:
            raise bad_request("the prompt is empty", param="prompt")
        self._check_length(len(ids), max_tokens)  # first: cheap, and bounds the scan below
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")

    def _check_length(self, n: int, max_tokens: int | None) -> None:
        limit = self.max_model_len
        capacity = min(limit, getattr(self.client.ready, "kv_capacity_tokens", limit))
        if n >= capacity:
            raise bad_request(f"the prompt has {n} tokens but the model's context (or KV cache) holds {capacity} "
                              "tokens, and at least one must be left for the output", param="prompt")
        if max_tokens is not None and n + max_tokens > limit:
            raise bad_request(f"this model's maximum context length is {limit} tokens, but {n} prompt tokens + "
                              f"max_tokens {max_tokens} were requested", param="max_tokens")

    def cache_salt(self, req, request: Request) -> str | None:
        """The salt the engine keys the request's prefix blocks by: its own `cache_salt`, inside the caller's
        API-key namespace under --prefix-cache-isolation key (the Gate put it in `request.state.tenant`).
        The namespace has a fixed length, so distinct (namespace, salt) pairs never give the same salt."""
        if self.settings.prefix_cache_isolation != "key":
            return req.cache_salt
        return f"{getattr(request.state, 'tenant', '')}:{req.cache_salt or ''}"

    # --- sampling parameters ---------------------------------------------------------------------
    def sampling_params(self, req, max_tokens: int | None, echo_logprobs: bool = False,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """SamplingParams for `req`; every invalid value is a 400 naming the problem."""
        self._check_limits(req)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        num = req.num_logprobs
        chosen = {k: getattr(req, k) for k in _OPTIONAL_SAMPLING if getattr(req, k) is not None}
        try:
            return SamplingParams(n=req.n, max_tokens=max_tokens, stop=stop, stop_token_ids=req.stop_token_ids or [],
                                  ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, logprobs=num,
                                  prompt_logprobs=num if echo_logprobs else None,
                                  skip_special_tokens=req.skip_special_tokens,
                                  include_stop_str_in_output=req.include_stop_str_in_output,
                                  structured_outputs=structured, **chosen)
        except ValueError as e:
            raise bad_request(str(e)) from None

    def _check_limits(self, req) -> None:
        """The server's own limits (SamplingParams checks the rest)."""
        if not 1 <= req.n <= self.settings.max_n:
            raise bad_request(f"n must be in [1, {self.settings.max_n}], got {req.n}", param="n")
        num = req.num_logprobs
        if num is not None and not 0 <= num <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {num}", param="logprobs")
        if isinstance(req.stop, list) and len(req.stop) > MAX_STOP_STRINGS:
            raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings, got {len(req.stop)}", param="stop")

    # --- jobs ------------------------------------------------------------------------------------
    async def respond(self, request: Request, job: Job, shape: _Shape) -> Response:
        """Admit the job, then answer: SSE when streaming, else one JSON body."""
        k = self.admission.acquire(len(job.prompts), job.params.n)
        self.metrics.prompt_tokens.inc(sum(len(p.token_ids) for p in job.prompts))
        if job.stream:
            return GuardedStream(_error_events(shape.events(job)), lambda: self.admission.release(k))
        try:
            done = await run_until_disconnect(request, job.run())
        finally:
            self.admission.release(k)
        return JSONResponse(shape.response(job)) if done else Response(status_code=499)

    # --- chat ------------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        return await self.chat_as(req, request, ChatShape(self, req), f"chatcmpl-{uuid.uuid4().hex}")

    # --- completions -----------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        self.check_request(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        raw = prompt_list(req.prompt)
        self._check_limits(req)
        self.admission.precheck(len(raw), req.n)  # before any tokenising
        prompts = [await self._text_prompt(p, req.add_special_tokens) if isinstance(p, str) else Prompt(None, list(p))
                   for p in raw]
        for p in prompts:
            self._check_prompt(p.token_ids, req.max_tokens)
        spec = request_spec(req, thinking=False)
        await check_spec(spec, self.grammar_checker, self.settings.grammar_timeout_s, max_tokens=req.max_tokens)
        params = self.sampling_params(req, req.max_tokens, echo_logprobs=req.echo and req.logprobs is not None,
                                      structured=spec)
        job = Job(self, f"cmpl-{uuid.uuid4().hex}", prompts, params, req.priority, req.stream,
                  cache_salt=self.cache_salt(req, request))
        if req.kv_transfer_params is not None and len(prompts) != 1:
            raise bad_request("kv_transfer_params takes a single prompt", param="kv_transfer_params")
        job.kv_transfer = req.kv_transfer_params
        return await self.respond(request, job, CompletionShape(self, req))

    async def _structured_params(self, req, max_tokens: int | None, thinking: bool,
                                 tools: ToolSetup) -> SamplingParams:
        if tools.format is None:  # the served model's format
            tools.format = format_of(self.tokenizer)
        try:
            forced = tools.constraint(self.tokenizer)
        except ValueError as e:
            raise bad_request(f"the tools cannot be constrained: {e}", param="tools") from None
        spec = request_spec(req, thinking, forced)
        budget = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        await check_spec(spec, self.grammar_checker, self.settings.grammar_timeout_s, "tools" if forced else None,
                         max_tokens, budget)
        return self.sampling_params(req, max_tokens, structured=spec)

    async def _image_prompt(self, text: str, urls: list[str], add_special_tokens: bool) -> Prompt:
        """A rendered chat prompt with images: the text between image parts tokenised piece by piece, each image's
        placeholder token between, the images loaded and processed off the event loop, placeholders expanded."""
        s = self.settings
        try:
            s.media.check_count(len(urls))
        except ImageError as e:
            raise bad_request(str(e), param="messages") from None
        self._check_chars(text, "messages")
        encode = lambda piece, special: encode_text(self.tokenizer, piece, special)  # noqa: E731
        try:
            ids = await asyncio.to_thread(tokens_around_images, encode, text, len(urls), s.image_token_id,
                                          add_special_tokens)
            # on a pool of their own: slow image hosts must not take the threads tokenising needs
            ids, spans = await asyncio.get_running_loop().run_in_executor(_MEDIA_POOL, _image_spans, ids, urls, s)
        except ImageError as e:
            raise bad_request(str(e), param="messages") from None
        self.metrics.images_received.inc(len(spans))
        return Prompt(text, ids, thinking_enabled(text), spans)

    async def _text_prompt(self, text: str, add_special_tokens: bool = True) -> Prompt:
        """A text prompt's tokens; special tokens (BOS) only with `add_special_tokens`."""
        self._require_tokenizer("a text prompt")
        if not text:  # checked on the text: "" would tokenise to [BOS] alone
            raise bad_request("the prompt is empty", param="prompt")
        return Prompt(text, await self._tokens(text, add_special_tokens))

    # --- tokenize / detokenize -------------------------------------------------------------------
    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self.check_request(req.model)
        self._require_tokenizer("tokenize")
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages")
        if req.messages is not None:
            if any(m.image_urls() for m in req.messages):
                raise bad_request("tokenize takes text content parts only (an image's tokens depend on its size: "
                                  "usage.prompt_tokens of a chat request counts them)", param="messages")
            text = await self._render(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
            ids = await self._tokens(text, add_special_tokens=False, param="messages")
        else:
            ids = await self._tokens(req.prompt, req.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.check_request(req.model)
        tok = self._require_tokenizer("detokenize")
        # ids the tokenizer lacks decode to nothing, as in outputs; a worker thread, as for encoding
        return {"prompt": await asyncio.to_thread(tok.decode, req.tokens)}

    # --- token pieces ----------------------------------------------------------------------------
    def visible(self, token_id: int) -> str:
        """A token's text as it appears in outputs (special tokens skipped)."""
        return self.decoder.decode([token_id])

    def piece(self, token_id: int, as_id: bool = False) -> str:
        """A token's own text (special tokens included), as logprobs show it; "token_id:<id>" with `as_id`."""
        if as_id:
            return f"token_id:{token_id}"
        if token_id not in self._pieces:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else ""
            self._pieces[token_id] = text
        return self._pieces[token_id]

    # --- chat answered in another API's shape ----------------------------------------------------
    async def chat_as(self, req: ChatCompletionRequest, request: Request, shape: _Shape, request_id: str) -> Response:
        """`chat`'s whole path (checks, tools, template, thinking, structured constraint, admission, abort on
        disconnect) for a request another API was translated into, answered by `shape` (its `response` and
        `events`): ChatShape for chat completions, server/anthropic_api.py's for messages."""
        self.check_request(req.model)
        self._check_limits(req)
        self.admission.precheck(1, req.n)  # before any templating or tokenising
        tools = tool_setup(req, format_of(self.tokenizer))
        urls = [url for m in req.messages for url in m.image_urls()]
        vision = self.settings.vision is not None
        text = await asyncio.to_thread(chat_prompt, self._require_tokenizer("chat"), req, tools, vision)  # off the loop
        if urls:
            prompt = await self._image_prompt(text, urls, req.add_special_tokens)
        else:
            prompt = Prompt(text, await self._tokens(text, req.add_special_tokens, param="messages"),
                            thinking_enabled(text))
        self._check_prompt(prompt.token_ids, req.output_limit)
        params = await self._structured_params(req, req.output_limit, prompt.thinking, tools)
        job = Job(self, request_id, [prompt], params, req.priority, req.stream, tools,
                  cache_salt=self.cache_salt(req, request))
        job.kv_transfer = req.kv_transfer_params
        return await self.respond(request, job, shape)


# --- response shapes -----------------------------------------------------------------------------
class _Shape:
    """How one endpoint renders a job: the whole response, and the SSE events of a stream."""

    object_name = ""
    chunk_name = ""

    def __init__(self, serving: Serving, req):
        self.serving, self.req = serving, req

    def piece(self, token_id: int) -> str:
        return self.serving.piece(token_id, self.req.return_tokens_as_token_ids)

    def _envelope(self, job: Job, name: str) -> dict[str, Any]:
        return {"id": job.request_id, "object": name, "created": job.created,
                "model": self.serving.settings.model_name}

    def response(self, job: Job) -> dict[str, Any]:
        choices = [self.final_choice(job, c) for c in job.choices]
        body = {**self._envelope(job, self.object_name), "choices": choices, "usage": job.usage()}
        if job.kv_transfer_params is not None:
            body["kv_transfer_params"] = job.kv_transfer_params
        return body

    def chunk(self, job: Job, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {**self._envelope(job, self.chunk_name), "choices": choices}

    async def events(self, job: Job) -> AsyncIterator[str]:
        for event in self.opening(job):
            yield sse(event)
        async with contextlib.aclosing(job.updates()) as updates:
            async for update in updates:
                body = self.update_choice(update)
                if body is not None:
                    yield sse(self.chunk(job, [body]))
        if self.req.include_usage:
            yield sse({**self.chunk(job, []), "usage": job.usage()})

    def opening(self, job: Job) -> Iterator[dict[str, Any]]:
        return iter(())

    def final_choice(self, job: Job, choice: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def update_choice(self, update: Update) -> dict[str, Any] | None:
        raise NotImplementedError


class ChatShape(_Shape):
    object_name, chunk_name = "chat.completion", "chat.completion.chunk"

    def final_choice(self, job: Job, choice: Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": choice.detok.output_text}
        if job.prompts[0].thinking:
            message["reasoning_content"], message["content"] = split_reasoning(choice.detok.output_text)
        finish_reason = choice.finish_reason
        if job.tools is not None and message["content"] is not None:
            message["content"], calls = job.tools.message(message["content"])
            if calls:
                message["tool_calls"] = calls
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return {"index": choice.index, "message": message, "logprobs": self._logprobs(choice.logprobs),
                "finish_reason": finish_reason, "stop_reason": choice.stop_reason}

    def opening(self, job: Job) -> Iterator[dict[str, Any]]:
        for choice in job.choices:
            body = {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}
            yield self.chunk(job, [body])

    def update_choice(self, update: Update) -> dict[str, Any] | None:
        delta = self._delta(update)
        if not (delta or update.logprobs or update.finished):
            return None
        choice = update.choice
        return {"index": choice.index, "delta": delta, "logprobs": self._logprobs(update.logprobs),
                "finish_reason": self._finish_reason(choice) if update.finished else None,
                **({"stop_reason": choice.stop_reason} if update.finished else {})}

    @staticmethod
    def _finish_reason(choice: Choice) -> str | None:
        """"tool_calls" only when the choice stopped after emitting at least one call."""
        called = choice.tools is not None and choice.tools.num_calls > 0
        return "tool_calls" if called and choice.finish_reason == "stop" else choice.finish_reason

    @staticmethod
    def _delta(update: Update) -> dict[str, Any]:
        choice = update.choice
        reasoning, content = "", update.text
        if choice.reasoning is not None:
            reasoning, content = choice.reasoning.feed(update.text, final=update.finished)
        calls = []
        if choice.tools is not None and (content or update.finished) and (choice.reasoning is None
                                                                           or choice.reasoning.in_content):
            content, calls = choice.tools.feed(content, final=update.finished)
        delta: dict[str, Any] = {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}
        return {**delta, "tool_calls": calls} if calls else delta

    def _logprobs(self, entries: list | None) -> dict[str, Any] | None:
        if entries is None or self.req.num_logprobs is None:
            return None
        return {"content": [self._token_logprob(e) for e in entries]}

    def _token_logprob(self, entry) -> dict[str, Any]:
        ids, lps, _ = entry
        top = [self._top(t, lp) for t, lp in zip(ids[1:], lps[1:])]
        return {**self._top(ids[0], lps[0]), "top_logprobs": top}

    def _top(self, token_id: int, lp: float) -> dict[str, Any]:
        piece = self.piece(token_id)
        return {"token": piece, "logprob": _floor(lp), "bytes": list(piece.encode("utf-8", "replace"))}


class CompletionShape(_Shape):
    object_name = chunk_name = "text_completion"

    def final_choice(self, job: Job, choice: Choice) -> dict[str, Any]:
        prefix = self._echo(job, choice)
        entries = choice.logprobs
        if prefix and entries is not None:
            gen = job.generations[choice.index // job.params.n]
            entries = [None, *gen.prompt_logprobs, *entries]
            return self._choice(choice, prefix + choice.detok.output_text,
                                self._logprobs(entries, 0, gen.prompt.token_ids[:1]))
        return self._choice(choice, prefix + choice.detok.output_text, self._logprobs(entries, len(prefix)))

    def _choice(self, choice: Choice, text: str, logprobs) -> dict[str, Any]:
        return {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason}

    def _echo(self, job: Job, choice: Choice) -> str:
        if not self.req.echo:
            return ""
        prompt = job.generations[choice.index // job.params.n].prompt
        return prompt.text if prompt.text is not None else self.serving.decoder.decode(prompt.token_ids)

    def opening(self, job: Job) -> Iterator[dict[str, Any]]:
        for choice in job.choices if self.req.echo else ():
            body = {"index": choice.index, "text": self._echo(job, choice), "logprobs": None, "finish_reason": None}
            yield self.chunk(job, [body])

    def update_choice(self, update: Update) -> dict[str, Any] | None:
        if not (update.text or update.logprobs or update.finished):
            return None
        choice = update.choice
        offset = len(choice.detok.output_text) - len(update.text)
        return {"index": choice.index, "text": update.text,
                "logprobs": self._logprobs(update.logprobs if choice.logprobs is not None else None, offset),
                "finish_reason": choice.finish_reason if update.finished else None,
                **({"stop_reason": choice.stop_reason} if update.finished else {})}

    def _logprobs(self, entries: list | None, offset: int, first_ids: list[int] = ()) -> dict[str, Any] | None:
        """OpenAI's legacy shape; a None entry is the first prompt token (it has no logprob).
        text_offset advances by each token's visible text (special tokens add nothing)."""
        if entries is None:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for entry in entries:
            token_id = entry[0][0] if entry is not None else first_ids[0]
            piece = self.piece(token_id)
            out["tokens"].append(piece)
            out["token_logprobs"].append(_floor(entry[1][0]) if entry is not None else None)
            out["top_logprobs"].append(self._top(entry) if entry is not None else None)
            out["text_offset"].append(offset)
            offset += len(self.serving.visible(token_id))
        return out

    def _top(self, entry) -> dict[str, float]:
        ids, lps, _ = entry
        top = {self.piece(t): _floor(lp) for t, lp in zip(ids[1:], lps[1:])}
        top.setdefault(self.piece(ids[0]), _floor(lps[0]))
        return top
