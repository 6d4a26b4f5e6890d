"""Request fields -> StructuredOutputsParams: OpenAI `response_format`, vLLM's `structured_outputs` and
its older `guided_*` names, and forced tool calls. Every problem is a 400 naming the field, found
before anything is queued (the grammar is built here, off the event loop, under a time limit)."""

from __future__ import annotations

import asyncio
import threading

from deepinfer.server.errors import bad_request
from deepinfer.structured.params import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _response_format(req) -> dict | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format.json_schema.schema is required for type json_schema",
                              param="response_format")
        return {"json": fmt.json_schema.schema_}
    raise bad_request(f"response_format.type must be text, json_object or json_schema, got {fmt.type!r}",
                      param="response_format")


def _constraints(req, tool_spec: dict | None) -> list[tuple[str, dict]]:
    found = []
    if (fields := _response_format(req)) is not None:
        found.append(("response_format", fields))
    if req.structured_outputs is not None:
        fields = {k: v for k, v in req.structured_outputs.model_dump().items() if v is not None}
        found.append(("structured_outputs", {("json" if k == "json_" else k): v for k, v in fields.items()}))
    found += [(name, {kind: getattr(req, name)}) for name, kind in _GUIDED.items() if getattr(req, name) is not None]
    if tool_spec is not None:
        found.append(("tool_choice", tool_spec))
    return found


def request_spec(req, thinking: bool, tool_spec: dict | None = None) -> StructuredOutputsParams | None:
    """The request's one constraint (None without any); with thinking on it applies after `</think>`."""
    found = _constraints(req, tool_spec)
    if len(found) > 1:
        raise bad_request(f"give at most one output constraint; got {', '.join(name for name, _ in found)}",
                          param=found[1][0])
    if not found:
        return None
    name, fields = found[0]
    if isinstance(fields.get("json"), bool):
        raise bad_request("a JSON schema must be an object", param=name)
    try:
        return StructuredOutputsParams(**fields, after_reasoning=thinking)
    except ValueError as e:
        raise bad_request(str(e), param=name) from None


class GrammarChecker:
    """Compiles constraints against the served tokenizer, as the engine will (xgrammar's own cache keeps
    repeated schemas cheap), so a grammar that fails or is too slow to compile is the client's 400 rather
    than a failed request later. Thread-safe; built with the first constraint."""

    CACHE_BYTES = 64 * 2**20

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, stop_token_ids
        self._compiler = None
        self._lock = threading.Lock()

    def __call__(self, spec: StructuredOutputsParams) -> None:
        from deepinfer.structured import backend  # xgrammar loads with the first constraint, off the event loop

        grammar = backend.build_grammar(spec)
        if self.tokenizer is None:
            return  # the engine answers (it cannot constrain without a tokenizer)
        with self._lock:
            if self._compiler is None:
                info = backend.tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
                self._compiler = backend.Compiler(info, cache_bytes=self.CACHE_BYTES)
        try:
            self._compiler.compile(grammar)
        except Exception as e:
            raise ValueError(f"the {spec.kind} constraint failed to compile: {backend.reason(e)}") from None


async def check_spec(spec: StructuredOutputsParams | None, check: GrammarChecker, timeout_s: float,
                     param: str | None = None) -> None:
    """Builds and compiles the grammar in a worker thread: a bad schema / regex / grammar, or one that does
    not compile within `timeout_s`, is a 400 with the reason."""
    if spec is None:
        return
    try:
        await asyncio.wait_for(asyncio.to_thread(check, spec), timeout_s)
    except ValueError as e:
        raise bad_request(str(e), param=param) from None
    except asyncio.TimeoutError:
        raise bad_request(f"the {spec.kind} constraint did not compile within {timeout_s:g} s", param=param) from None
